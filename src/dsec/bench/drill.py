"""Fault-injection drill: concurrent scripted episodes under random real faults.

The controller (``run_drill``) starts a real API server process serving episodes
(``python -m dsec.bench.drill serve``), runs a fault-free baseline of every seed,
then runs the same seeds again while injecting faults at random:

* ``kill_server``   SIGKILL the server process (we started it), start a new one
* ``restart_server`` SIGTERM + start (clean stop)
* ``kill_sandbox``  SIGKILL every process inside one live sandbox, tear its root down
* ``fill_disk``     fill the tmpfs checkpoint replica until ENOSPC, free it shortly after
* ``corrupt_replica`` overwrite one stored object on one replica
* ``cut_write``     restart the server with a fault point that kills it half-way
                    through a blob write (``blob.local.mid_write``) at a random hit

Every client runs the agent loop from step 0 after any error (resume = fast-forward).
At the end each trajectory is compared with the baseline of its seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zstandard

from dsec import errors

FAULT_KINDS = ("kill_server", "restart_server", "kill_sandbox", "fill_disk", "corrupt_replica", "cut_write")


def script(seed: int, steps: int) -> list[tuple[str, str]]:
    """A realistic, deterministic coding-agent script: (kind, command) per step."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for i in range(steps):
        r = rng.random()
        n = rng.randint(1, 40)
        if r < 0.25:
            cmd = f"mkdir -p /work/src && yes 'line {seed}-{i}' | head -n {n * 10} > /work/src/mod{i % 5}.txt"
        elif r < 0.40:
            cmd = f"sed -i 's/line/LINE/' /work/src/mod{n % 5}.txt 2>/dev/null; ls /work/src 2>/dev/null | wc -l"
        elif r < 0.55:
            cmd = f"grep -c LINE /work/src/mod{n % 5}.txt 2>/dev/null || echo 0"        # read-only 'tests'
        elif r < 0.65:
            cmd = f"head -c {n * 2500} /dev/zero | tr '\\0' 'x' > /work/blob{i % 3}.bin && wc -c < /work/blob{i % 3}.bin"
        elif r < 0.75:
            cmd = f"rm -rf /work/tmp{n % 2}; mkdir -p /work/tmp{n % 2} && echo {i} > /work/tmp{n % 2}/x"
        elif r < 0.85:
            cmd = "cat /work/src/*.txt 2>/dev/null | md5sum"
        else:
            cmd = f"echo {i} > /work/note && cat /work/note"
        if r < 0.55 and r >= 0.40 or 0.75 <= r < 0.85:
            out.append(("read", cmd))  # read-only steps must cost (almost) nothing to checkpoint
        else:
            # Writing steps append to a counter: a logged step that ran twice changes all later output.
            out.append(("exec", f"echo {i} >> /work/.steps; {cmd}; echo steps=$(wc -l < /work/.steps)"))
    return out


# --- server side ---------------------------------------------------------------------------

def _node_settings(work: Path):
    from dsec.config import load_settings
    # Agent sockets live under run_dir and sun_path is 108 bytes: keep it short and stable
    # across server restarts (a restarted server adopts the sandboxes the last one left).
    run_dir = Path("/tmp") / f"dsd-{hashlib.sha256(str(work).encode()).hexdigest()[:10]}"
    return load_settings(home=work / "home", run_dir=run_dir, net_enabled=False)


def _node_host(work: Path):
    from dsec.checkpoints.nodehost import NodeEpisodeHost
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock
    from dsec.node.agent import LocalNodeAgent
    settings = _node_settings(work)
    store = ImageStore(work / "home" / "images", settings)
    ensure_stock(store, only=["busybox"], log=lambda _: None)
    node = LocalNodeAgent(settings, images=store)
    return node, NodeEpisodeHost(node)


def serve(work: Path, port: int, host_kind: str = "dir") -> None:
    """The drill server: the real episodes API with two checkpoint replicas.

    ``host_kind``: ``dir`` (overlay + chroot, cheap) or ``node`` (real runc sandboxes).
    """
    from contextlib import asynccontextmanager
    from types import SimpleNamespace

    import uvicorn
    from fastapi import FastAPI

    from dsec.api.auth import TenantAuth
    from dsec.api.episodes import include_episodes
    from dsec.api.errors import install_error_handlers
    from dsec.blobs import LocalBlobStore, ReplicatedBlobStore
    from dsec.checkpoints.dirhost import DirHost
    from dsec.checkpoints.engine import EpisodeEngine
    from dsec.config import load_settings
    from dsec.state.sqlite import SqliteStateStore

    node = None
    if host_kind == "node":
        node, host = _node_host(work)
        settings = node.settings
    else:
        settings = load_settings(home=work / "home")
        host = DirHost(work / "sbx", {"bb": work / "img", "busybox": work / "img"})
    store = ReplicatedBlobStore([LocalBlobStore(work / "r1"), LocalBlobStore(work / "r2")])
    engine = EpisodeEngine(settings, store, host, cache_dir=work / "layer-cache")

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if node is not None:
            await node.manager.start()  # reconcile: adopt or clean what a killed server left
        yield
        if node is not None:
            node.manager.close()

    app = FastAPI(lifespan=lifespan)
    async def admit(tenant: object, spec: object) -> None:
        return None  # the drill's own tenant and spec: no SandboxService to judge them

    # The episodes router authenticates and has open's spec judged by services.sandboxes.
    app.state.services = SimpleNamespace(auth=TenantAuth(SqliteStateStore(work / "state.db")),
                                         sandboxes=SimpleNamespace(check_spec=admit))
    install_error_handlers(app, 0.2)
    include_episodes(app, engine)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def node_sandbox_pids(work: Path) -> dict[str, list[int]]:
    """PIDs of each sandbox of the drill's own node (never another node's sandboxes)."""
    from dsec.config import load_settings
    from dsec.node import cgroups
    parent = load_settings().cgroup_parent  # the drill's server inherits this environment
    out: dict[str, list[int]] = {}
    base = work / "home" / "sandboxes"
    for sid in (p.name for p in base.iterdir()) if base.is_dir() else ():
        f = cgroups.CGROUP_ROOT / "pids" / parent / sid / "cgroup.procs"
        try:
            pids = [int(x) for x in f.read_text().split()]
        except OSError:
            continue
        if pids:
            out[sid] = pids
    return out


async def cleanup_node(work: Path) -> int:
    """Destroy every sandbox the drill's node still has (end of a node-mode drill)."""
    node, _ = _node_host(work)
    await node.manager.start()
    n = 0
    for sid in list(node.manager.live):
        try:
            await node.manager.destroy(sid)
            n += 1
        except Exception:  # noqa: BLE001 - best effort; reported as leaks by the caller
            pass
    node.manager.close()
    import shutil
    shutil.rmtree(node.settings.runtime_dir, ignore_errors=True)
    return n


@dataclass
class ServerProc:
    work: Path
    port: int
    host_kind: str = "dir"
    proc: subprocess.Popen | None = None
    standby: subprocess.Popen | None = None

    def _spawn(self) -> subprocess.Popen:
        """A standby server process: imports done, waiting on stdin for its fault spec.

        Python + FastAPI + node imports take ~1 s on this class of machine; a restart
        that only has to hand the port to an already-imported process makes the drill's
        fault rate limited by recovery, not by interpreter start-up. The standby holds
        no state: the node agent, the engine and the port are all set up after the go.
        """
        env = {k: v for k, v in os.environ.items() if k != "DSEC_FAULTS"}
        return subprocess.Popen([sys.executable, "-m", "dsec.bench.drill", "standby", str(self.work),
                                 str(self.port), self.host_kind], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=open(self.work / "server.log", "ab"))

    def start(self, faults: str = "") -> None:
        proc = self.standby if self.standby is not None and self.standby.poll() is None else self._spawn()
        self.standby = None
        assert proc.stdin is not None
        proc.stdin.write(faults.encode() + b"\n")
        proc.stdin.close()
        self.proc = proc
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                try:
                    httpx.get(f"http://127.0.0.1:{self.port}/docs", timeout=0.5)
                    return
                except httpx.HTTPError:
                    if self.proc.poll() is not None:
                        if faults:  # an armed fault point may kill it before it listens
                            return
                        raise errors.DSecError(f"drill server exited with {self.proc.returncode}; "
                                               f"see {self.work}/server.log") from None
                    time.sleep(0.02)
            raise errors.Timeout("drill server did not start within 60 s")
        finally:
            self.standby = self._spawn()  # imports while the episodes run

    def close(self) -> None:
        """Stop the server and the standby (end of the drill)."""
        self.stop(signal.SIGTERM)
        if self.standby is not None and self.standby.poll() is None:
            self.standby.stdin.close()  # EOF: the standby exits without serving
            try:
                self.standby.wait(10)
            except subprocess.TimeoutExpired:
                self.standby.kill()
                self.standby.wait()
        self.standby = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- client side ---------------------------------------------------------------------------

@dataclass
class EpisodeRun:
    episode_id: str
    seed: int
    acked: dict[int, str] = field(default_factory=dict)
    failures: int = 0
    recoveries: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)
    live_steps: int = 0
    live_cost: list[tuple[float, float]] = field(default_factory=list)  # (exec s, checkpoint s)
    done: bool = False
    error: str | None = None


def run_agent(url: str, token: str, run: EpisodeRun, steps: int, deadline: float, image: str = "bb") -> None:
    """Drive one episode to the end, resuming from step 0 after any failure."""
    from dsec.sdk import Client
    from dsec.sdk.episode import Episode
    client = Client(url=url, token=token, retries=1, timeout=30)
    cmds = script(run.seed, steps)
    failed_at: float | None = None
    while time.monotonic() < deadline:
        try:
            ep = Episode.open(run.episode_id, image=image, client=client, cpu=0.5, memory="256M", disk="256M")
            if ep.resumed:
                run.restore_s.append(ep.info.restore_s)
            for i, (_, cmd) in enumerate(cmds):
                r = ep.exec(cmd, timeout=30)
                if i in run.acked and run.acked[i] != r.stdout:
                    run.error = f"step {i} changed after being acknowledged"
                run.acked[i] = r.stdout
                if not r.replayed:
                    run.live_steps += 1
                    run.live_cost.append((r.duration, r.checkpoint_s))
                    if failed_at is not None:
                        run.recoveries.append(time.monotonic() - failed_at)
                        failed_at = None
                if i % 10 == 9:
                    ep.save_context({"messages": [f"turn {j}" for j in range(i + 1)], "seed": run.seed})
            ep.close()
            run.done = True
            if failed_at is not None:
                run.recoveries.append(time.monotonic() - failed_at)
            return
        except (errors.DSecError, httpx.HTTPError, OSError) as exc:
            run.failures += 1
            if failed_at is None:
                failed_at = time.monotonic()
            if isinstance(exc, errors.ReplayDiverged):
                run.error = str(exc)
                return
            time.sleep(0.1)
    run.error = "deadline passed before the episode finished"


def trajectory(url: str, token: str, episode_id: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/episodes/{episode_id}/export", headers={"authorization": f"Bearer {token}"},
                  timeout=60)
    r.raise_for_status()
    raw = zstandard.ZstdDecompressor().stream_reader(r.content, read_across_frames=True).read()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def standby(work: Path, port: int, host_kind: str = "dir") -> None:
    """Import everything ``serve`` needs, then wait for the go (one line: the fault spec)."""
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401

    import dsec.api.episodes
    import dsec.checkpoints.engine
    import dsec.checkpoints.nodehost
    import dsec.node.agent  # noqa: F401
    line = sys.stdin.readline()
    if not line:
        return  # EOF: the drill ended without needing this standby
    if line.strip():
        os.environ["DSEC_FAULTS"] = line.strip()
    serve(work, port, host_kind)


if __name__ == "__main__" and len(sys.argv) in (4, 5) and sys.argv[1] in ("serve", "standby"):
    (serve if sys.argv[1] == "serve" else standby)(Path(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
