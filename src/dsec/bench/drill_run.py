"""The drill controller: baseline, faulted rounds, verification, report (see ``drill``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dsec.checkpoints.dirhost import DirHost, make_busybox_rootfs
from dsec.bench.drill import (
    FAULT_KINDS,
    EpisodeRun,
    ServerProc,
    cleanup_node,
    node_sandbox_pids,
    run_agent,
    trajectory,
)
from dsec.node import syscalls


@dataclass
class DrillConfig:
    work: Path
    episodes: int = 8
    steps: int = 30
    faults: int = 100
    seed: int = 1
    fault_interval_s: float = 0.4
    kinds: tuple[str, ...] = FAULT_KINDS
    tmpfs_bytes: int = 256 * 1024 * 1024
    deadline_s: float = 3600.0
    host_kind: str = "dir"  # "dir" (overlay + chroot) or "node" (real runc sandboxes)


@dataclass
class DrillResult:
    faults: Counter = field(default_factory=Counter)
    episodes: int = 0
    verified: int = 0
    mismatched: list[str] = field(default_factory=list)
    steps_reexecuted: int = 0
    recoveries: list[float] = field(default_factory=list)
    restores: list[float] = field(default_factory=list)
    live_cost: list[tuple[float, float]] = field(default_factory=list)
    fs_bytes: list[int] = field(default_factory=list)
    leaked_mounts: int = 0
    inject_s: dict[str, list[float]] = field(default_factory=dict)  # time to inject, per kind
    wall_s: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(cfg: DrillConfig) -> str:
    from dsec.api.auth import TenantAuth
    from dsec.state.sqlite import SqliteStateStore
    cfg.work.mkdir(parents=True, exist_ok=True)
    make_busybox_rootfs(cfg.work / "img")
    (cfg.work / "r2").mkdir(exist_ok=True)
    syscalls.mount_tmpfs(str(cfg.work / "r2"), cfg.tmpfs_bytes)  # the small checkpoint disk
    async def make() -> str:
        state = SqliteStateStore(cfg.work / "state.db")
        _, token = await TenantAuth(state).create_tenant(f"drill{os.getpid()}{int(time.time())}")
        await state.close()
        return token

    return asyncio.run(make())


class Injector:
    def __init__(self, cfg: DrillConfig, server: ServerProc, rng: random.Random) -> None:
        self.cfg, self.server, self.rng = cfg, server, rng
        self.host = DirHost(cfg.work / "sbx", {})
        self.lock = threading.Lock()
        self.timers: list[threading.Timer] = []

    def inject(self, kind: str) -> bool:
        """Inject one fault; False if it had no target right now (not counted)."""
        with self.lock:
            return getattr(self, kind)()

    def kill_server(self) -> bool:
        self.server.stop(signal.SIGKILL)
        self.server.start()
        return True

    def restart_server(self) -> bool:
        self.server.stop(signal.SIGTERM)
        self.server.start()
        return True

    def kill_sandbox(self) -> bool:
        if self.cfg.host_kind == "node":
            live = node_sandbox_pids(self.cfg.work)
            if not live:
                return False
            for pid in live[self.rng.choice(sorted(live))]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return True
        root = self.cfg.work / "sbx"
        live = [p.name for p in root.iterdir() if os.path.ismount(p / "merged")] if root.exists() else []
        if not live:
            return False
        self.host.kill(self.rng.choice(live))
        return True

    def fill_disk(self) -> bool:
        # The disk stays full for a while, but the injector does not wait for it: other
        # faults (a server kill with a full disk) may land meanwhile, as in real life.
        filler = self.cfg.work / "r2" / f"fill-{self.rng.getrandbits(32):08x}.bin"
        try:
            with open(filler, "wb") as fh:
                while True:
                    fh.write(b"\0" * (1 << 20))
        except OSError:
            pass
        timer = threading.Timer(self.rng.uniform(0.2, 1.0), filler.unlink, kwargs={"missing_ok": True})
        timer.daemon = True
        timer.start()
        self.timers.append(timer)
        return True

    def corrupt_replica(self) -> bool:
        root = self.cfg.work / self.rng.choice(["r1", "r2"])
        files = sorted(Path(d) / f for d, _, fs in os.walk(root) for f in fs if "/cas/" in d or "/units" in d)
        self.rng.shuffle(files)
        for victim in files:  # retention may delete a file under our feet: take the next one
            try:
                data = bytearray(victim.read_bytes())
                if not data:
                    continue
                data[self.rng.randrange(len(data))] ^= 0xFF
                victim.write_bytes(bytes(data))
                return True
            except OSError:
                continue
        return False

    def cut_write(self) -> bool:
        self.server.stop(signal.SIGKILL)
        self.server.start(faults=f"blob.local.mid_write=exit@{self.rng.randint(1, 40)}")
        return True

    def settle(self) -> None:
        """Free every filled disk now (end of a round)."""
        for t in self.timers:
            t.join()
        self.timers.clear()

    def heal(self) -> None:
        """Restart the server if it died on its own (an armed fault point fired)."""
        with self.lock:
            if not self.server.alive():
                self.server.start()


def _round(cfg: DrillConfig, url: str, token: str, prefix: str, injector: Injector | None,
           res: DrillResult, rng: random.Random, deadline: float) -> list[EpisodeRun]:
    runs = [EpisodeRun(f"{prefix}-{i}", cfg.seed + i) for i in range(cfg.episodes)]
    image = "busybox" if cfg.host_kind == "node" else "bb"
    threads = [threading.Thread(target=run_agent, args=(url, token, r, cfg.steps, deadline, image)) for r in runs]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if injector is None:
            time.sleep(0.05)
            continue
        time.sleep(rng.expovariate(1 / cfg.fault_interval_s))
        injector.heal()
        n = sum(res.faults.values())
        if n < cfg.faults:
            # Every kind once first (a short drill still covers them all), then at random.
            kind = cfg.kinds[n] if n < len(cfg.kinds) else rng.choice(cfg.kinds)
            t_inj = time.monotonic()
            if injector.inject(kind):
                res.faults[kind] += 1
                res.inject_s.setdefault(kind, []).append(time.monotonic() - t_inj)
    for t in threads:
        t.join()
    if injector is not None:
        injector.settle()
        injector.heal()
    return runs


def _key(rec: dict) -> tuple:
    return rec["command"], rec["exit_code"], rec["stdout"], rec["fs_digest"]


def run_drill(cfg: DrillConfig, progress: Callable[[str, int, int], None] = lambda *_: None) -> DrillResult:
    rng = random.Random(cfg.seed)
    res = DrillResult()
    t0 = time.monotonic()
    token = _setup(cfg)
    server = ServerProc(cfg.work, _free_port(), cfg.host_kind)
    url = f"http://127.0.0.1:{server.port}"
    deadline = time.monotonic() + cfg.deadline_s
    try:
        server.start()
        progress("baseline", 0, cfg.faults)
        base_runs = _round(cfg, url, token, "base", None, res, rng, deadline)
        baseline = {r.seed: [_key(x) for x in trajectory(url, token, r.episode_id)] for r in base_runs}
        for r in base_runs:
            res.live_cost += r.live_cost
            res.fs_bytes += [x["fs_bytes"] for x in trajectory(url, token, r.episode_id)]
        injector = Injector(cfg, server, rng)
        rnd = 0
        while sum(res.faults.values()) < cfg.faults and time.monotonic() < deadline:
            runs = _round(cfg, url, token, f"r{rnd}", injector, res, rng, deadline)
            for r in runs:
                res.episodes += 1
                res.recoveries += r.recoveries
                res.restores += r.restore_s
                try:
                    got = [_key(x) for x in trajectory(url, token, r.episode_id)]
                except Exception as exc:  # noqa: BLE001 - an unreadable trajectory is a failed episode
                    res.mismatched.append(f"{r.episode_id}: export failed: {exc}")
                    continue
                res.steps_reexecuted += sum(1 for i, out in r.acked.items() if i < len(got) and got[i][2] != out)
                if r.done and got == baseline[r.seed] and r.error is None:
                    res.verified += 1
                else:
                    res.mismatched.append(f"{r.episode_id}: done={r.done} error={r.error} "
                                          f"steps={len(got)}/{cfg.steps}")
            rnd += 1
            progress("faults", sum(res.faults.values()), cfg.faults)
    finally:
        server.close()
        if cfg.host_kind == "node":
            import asyncio
            res.leaked_mounts = asyncio.run(cleanup_node(cfg.work))
        mounts = [m for m in syscalls.mounts_under(str(cfg.work / "sbx"))]
        res.leaked_mounts += len(mounts)
        for m in [*mounts, *syscalls.mounts_under(str(cfg.work / "r2"))]:
            try:
                syscalls.umount(m)
            except OSError:
                pass
        res.wall_s = time.monotonic() - t0
    return res


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summary(cfg: DrillConfig, res: DrillResult) -> dict:
    exec_s = sum(c[0] for c in res.live_cost)
    ckpt_s = sum(c[1] for c in res.live_cost)
    changing = [b for b in res.fs_bytes if b > 0]
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "faults_injected": sum(res.faults.values()), "faults_by_kind": dict(res.faults),
        "episodes": res.episodes, "episodes_verified": res.verified,
        "recovery_success_rate": res.verified / res.episodes if res.episodes else None,
        "mismatched": res.mismatched[:50],
        "steps_reexecuted": res.steps_reexecuted,
        "client_recovery_s": {"n": len(res.recoveries), "p50": _pct(res.recoveries, 50),
                              "p99": _pct(res.recoveries, 99)},
        "server_restore_s": {"n": len(res.restores), "p50": _pct(res.restores, 50), "p99": _pct(res.restores, 99)},
        "bytes_checkpointed_per_step": {"mean": float(np.mean(res.fs_bytes)) if res.fs_bytes else None,
                                        "mean_changing": float(np.mean(changing)) if changing else None,
                                        "steps_without_fs_change": len(res.fs_bytes) - len(changing)},
        "checkpoint_overhead_fraction": ckpt_s / (exec_s + ckpt_s) if res.live_cost else None,
        "leaked_mounts_cleaned": res.leaked_mounts, "wall_s": res.wall_s,
        "inject_s_p50_by_kind": {k: _pct(v, 50) for k, v in res.inject_s.items()},
    }


def write_report(out: Path, cfg: DrillConfig, res: DrillResult) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    s = summary(cfg, res)
    (out / "drill.json").write_text(json.dumps(s, indent=2))
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    if res.recoveries:
        ax[0].hist(res.recoveries, bins=40)
    ax[0].set(title="client time to recover (s)", xlabel="s", ylabel="incidents")
    ax[1].bar(list(res.faults), list(res.faults.values()))
    ax[1].set(title="faults injected")
    ax[1].tick_params(axis="x", rotation=30)
    if res.fs_bytes:
        ax[2].hist([b / 1024 for b in res.fs_bytes], bins=30)
    ax[2].set(title="checkpoint bytes per step (KiB)", xlabel="KiB")
    fig.tight_layout()
    fig.savefig(out / "drill.png", dpi=90)
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"
    cr, sr, bp = s["client_recovery_s"], s["server_restore_s"], s["bytes_checkpointed_per_step"]
    lines = ["# DSec recovery drill", "",
             f"- host: {cfg.host_kind}, episodes per round: {cfg.episodes}, steps: {cfg.steps}",
             f"- faults injected: **{s['faults_injected']}** {s['faults_by_kind']}",
             (f"- episodes: {s['episodes']}, verified equal to fault-free run: **{s['episodes_verified']}** "
              f"(success rate {fmt(s['recovery_success_rate'])})"),
             f"- acknowledged steps re-executed: **{s['steps_reexecuted']}**",
             f"- client time to recover p50/p99: {fmt(cr['p50'])} / {fmt(cr['p99'])} s (n={cr['n']})",
             f"- server restore (open->sandbox ready) p50/p99: {fmt(sr['p50'])} / {fmt(sr['p99'])} s (n={sr['n']})",
             (f"- checkpoint bytes/step: mean {fmt(bp['mean'])}, mean over steps changing files "
              f"{fmt(bp['mean_changing'])}, steps with no fs change: {bp['steps_without_fs_change']}"),
             f"- checkpoint overhead (checkpoint s / step wall s, baseline): {fmt(s['checkpoint_overhead_fraction'])}",
             f"- sandboxes/mounts left at the end (cleaned): {s['leaked_mounts_cleaned']}",
             f"- wall time: {s['wall_s']:.1f} s", "", "![plots](drill.png)", ""]
    if s["mismatched"]:
        lines += ["## Mismatches", ""] + [f"- {m}" for m in s["mismatched"]]
    (out / "drill.md").write_text("\n".join(lines) + "\n")
    return s
