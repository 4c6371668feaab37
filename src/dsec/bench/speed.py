"""Issue 15's table, each row with its baseline from the same run.

| metric | how (baseline in the same run) |
|---|---|
| warm acquire -> first exec result | ``dsec.bench.pool``: SDK create + exec("true") on a primed pool (cold create, pools off) |
| SDK over HTTP added to node-local exec | ``dsec.bench.api`` overhead: paired sync / async vs ``node.exec`` (sync on urllib3, async on aiohttp) |
| gVisor exec round trip vs container | ``gvisor``: node-local exec("true") on both tiers interleaved (and gVisor via ``runsc exec``) |
| idle sandboxes at once / host memory each | ``density``: N idle busybox through a server with the request ratios; exec p99 while they exist (same probes with 32 sandboxes alone); memory charged to the sandboxes' cgroups per sandbox (and the MemTotal-MemAvailable delta); leftovers after destroying all |
| short episodes per second | ``episodes``: create -> exec -> destroy by C workers for T s, overcommit bound polled (podman run --rm back to back, from the cold row) |
| cold start create -> first exec | ``dsec.bench.sandbox.bench_start`` (podman run --rm, alternated) |

Run: ``dsec bench speed`` or ``python -m dsec.bench.speed [--only gvisor,episodes,...]``
(root; imports busybox into temporary homes).

Where the time goes (py-spy on ``dsec serve``, 2-core VM at load ~8-13, 2026-11-30):

- Short episodes: before recycling (~10-15/s with 8 workers, every start a warm
  hand-over) ~40 % of the samples were teardown plus a cold refill per episode. Now a
  killed pool member is recycled (``SandboxManager.start_recycle``, docs/speed.md); the
  ``episodes`` row runs recycling off first (same run) as its baseline, measures the
  sustained rate after a warm-up, and reports CPU per episode for the server, the client,
  the sandboxes and the rest of the box. 2026-12-01, load ~19: 90.9/s sustained, 9.56 ms
  of the bench's CPU per episode (server 7.19, client 0.58, sandboxes 1.79); the box was
  CPU-bound (other jobs took ~1.1 of the 2 cores).
- Warm hand-over (create call ~5 ms + first exec ~3-4 ms at load ~2): the create is
  HTTP both ways, admission, four state-store hops (request id reserve, owner record,
  then owner + dead id + answer together) and the node's claim (a SQLite record write on
  the loop); the exec is HTTP both ways plus the agent round trip (~1.4-2 ms: fork+exec
  of the command inside the sandbox).
- gVisor exec (ptrace platform; the KVM one cannot run on this VM's paravirtual KVM):
  ``profile_ms`` splits an exec into the agent round trip + spawn without a program image
  (``/nonexistent``), the program's image and run (``/bin/true``) and the PATH search
  (``true``). Every gVisor syscall is a ptrace stop of a stub process, every new address
  space a new stub; docs/exec-agent.md "gVisor tier" has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.node.usage import parse_proc_stat, read_cgroup_cpu_ns

ROWS = ("warm", "sdk", "gvisor", "density", "episodes", "cold")
EPISODE_SHAPE = {"image": "busybox", "cpu": 0.25, "memory": "64M", "disk": "64M", "timeout": 600}
IDLE_SHAPE = {"image": "busybox", "cpu": 0.1, "memory": "16M", "timeout": 3600}
BASELINE_SANDBOXES = 32  # density's same-run baseline: exec probes when only this many exist


def _ms(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "median_ms": round(statistics.median(s) * 1000, 3),
            "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1000, 3)}


def _home(tag: str) -> Path:
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    home = Path(tempfile.mkdtemp(prefix=f"dsec-speed-{tag}-"))
    ensure_stock(ImageStore(home / "images", Settings(home=home)), only=["busybox"], log=lambda _: None)
    return home


# --------------------------------------------------------------------------- gVisor


async def _gvisor(n: int, progress: Callable[[str], None]) -> dict[str, Any]:
    from dsec.config import Settings
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.node.agent import LocalNodeAgent

    home = _home("gvisor")
    node = LocalNodeAgent(Settings(home=home, net_enabled=False))
    await node.start()
    req = ExecRequest(cmd=["true"])
    # The profile of one exec, per tier, in the same rounds: a missing program (the agent
    # round trip and the spawn, no program image: exit 127) and /bin/true (no PATH search).
    parts = {"no_exec": (ExecRequest(cmd=["/nonexistent"]), 127), "abs_path": (ExecRequest(cmd=["/bin/true"]), 0)}
    series: dict[str, list[float]] = {"container": [], "gvisor": [], "gvisor_runsc_exec": []}
    try:
        ids = {t: (await node.create(SandboxSpec(image="busybox", isolation=t, cpu=1, memory="256M",
                                                 disk="256M"))).id for t in ("container", "gvisor")}
        for i in range(n + 5):  # 5 warm-up rounds (the first gVisor exec starts its relay)
            row = {}
            for tier, sid in ids.items():
                t0 = time.perf_counter()
                r = await node.exec(sid, req)
                row[tier] = time.perf_counter() - t0
                assert r.exit_code == 0, r
                for part, (preq, code) in parts.items():
                    t0 = time.perf_counter()
                    r = await node.exec(sid, preq)
                    row[f"{tier}_{part}"] = time.perf_counter() - t0
                    assert r.exit_code == code, r
            if i % 5 == 0:  # the old path (runsc exec of dsec-init run), sampled
                t0 = time.perf_counter()
                r = await node._exec_gvisor(ids["gvisor"], ["true"], {"PATH": "/bin"}, "/", 10.0, None)
                row["gvisor_runsc_exec"] = time.perf_counter() - t0
            if i >= 5:
                for k, v in row.items():
                    series.setdefault(k, []).append(v)
        progress(f"gvisor: {n} rounds")
        # The floor of each tier: one fork+exec of `true` inside the sandbox (a shell loop),
        # which every exec pays once; gVisor's ptrace platform makes it ~20x dearer.
        floor = {}
        for tier, sid in ids.items():
            r = await node.exec(sid, ExecRequest(cmd=(
                "time sh -c 'i=0; while [ $i -lt 50 ]; do /bin/true; i=$((i+1)); done'"), timeout=120))
            real = next((ln.split(None, 1)[1] for ln in r.stderr.splitlines() if ln.startswith("real")), "")
            mins, _, secs = real.strip().rstrip("s").partition("m")  # busybox: "real\t0m 1.29s"
            if secs:
                floor[tier] = round((int(mins) * 60 + float(secs)) / 50 * 1000, 2)  # ms per fork+exec
        for sid in ids.values():
            await node.destroy(sid)
    finally:
        await node.close()
        shutil.rmtree(home, ignore_errors=True)
    out: dict[str, Any] = {k: _ms(v) for k, v in series.items()}
    out["runsc_platform"] = node.settings.runsc_platform
    # where an exec's time goes, medians in ms: agent round trip + spawn without a program
    # image, + the program's image and run (exec of /bin/true), + the PATH search for "true"
    out["profile_ms"] = {t: {"round_trip_and_spawn": out[f"{t}_no_exec"]["median_ms"],
                             "program_image_and_run": round(out[f"{t}_abs_path"]["median_ms"]
                                                            - out[f"{t}_no_exec"]["median_ms"], 3),
                             "path_search": round(out[t]["median_ms"] - out[f"{t}_abs_path"]["median_ms"], 3)}
                         for t in ("container", "gvisor")}
    c = out["container"]["median_ms"]
    out["ratio_gvisor_vs_container"] = round(out["gvisor"]["median_ms"] / c, 2)
    out["ratio_runsc_exec_vs_container"] = round(out["gvisor_runsc_exec"]["median_ms"] / c, 2)
    out["in_sandbox_fork_exec_ms"] = floor
    if floor.get("container") and floor.get("gvisor"):
        out["floor_ratio_gvisor_vs_container"] = round(floor["gvisor"] / floor["container"], 1)
        out["gvisor_exec_vs_its_fork_exec_floor"] = round(out["gvisor"]["median_ms"] / floor["gvisor"], 2)
    return out


# -------------------------------------------------------------------------- density


def _cgroup_mem() -> int:
    """Memory charged to every sandbox's cgroup (cgroup v1 or v2 ``dsec`` parent)."""
    for f in ("/sys/fs/cgroup/memory/dsec/memory.usage_in_bytes", "/sys/fs/cgroup/dsec/memory.current",
              "/sys/fs/cgroup/unified/dsec/memory.current"):
        try:
            return int(Path(f).read_text())
        except (OSError, ValueError):
            continue
    return 0


def _mem_used() -> int:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def _leftovers(home: Path, ids: list[str], parent: str = "dsec") -> dict[str, int]:
    """What destroying everything may have left of the sandboxes ``ids``: their dirs,
    mounts under ``home`` (rootfs, scratch tmpfs, netns binds), their cgroups in any
    controller (v1 or v2; other users of the parent cgroup on a shared box are not
    counted), processes still in one of them, and node records not destroyed."""
    import re
    import sqlite3

    mine = set(ids)
    mounts = sum(str(home) in line for line in Path("/proc/self/mounts").read_text().splitlines())
    root = Path("/sys/fs/cgroup")
    bases = [root / parent, *(c / parent for c in root.iterdir() if (c / parent).is_dir())]
    cgroups = sum((b / sid).is_dir() for b in bases for sid in mine)
    procs = zombies = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mine & set(re.findall(r"sb-[0-9a-f]+", (d / "cgroup").read_text())):
                    # A zombie keeps showing its (removed) cgroup until its parent reaps it.
                    zombie = (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                    zombies += zombie
                    procs += not zombie
            except (OSError, IndexError):
                continue
    records = 0
    with contextlib.suppress(sqlite3.Error):
        db = sqlite3.connect(f"file:{home / 'node' / 'sandboxes.db'}?mode=ro", uri=True)
        try:
            records = db.execute("SELECT COUNT(*) FROM sandboxes WHERE state NOT IN ('stopped', 'destroyed')"
                                 ).fetchone()[0]
        finally:
            db.close()
    sdirs = home / "sandboxes"
    return {"sandbox_dirs": len(list(sdirs.iterdir())) if sdirs.is_dir() else 0, "mounts": mounts,
            "cgroups": cgroups, "processes": procs, "zombies": zombies, "node_records_not_destroyed": records}


async def _density(count: int, execs: int, progress: Callable[[str], None]) -> dict[str, Any]:
    from dsec.api.launch import reap_home, start_serve
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.sdk import AsyncClient

    home = _home("density")
    env = {"DSEC_CPU_REQUEST_RATIO": "0.01", "DSEC_MEMORY_REQUEST_RATIO": "0.1", "DSEC_WARM_POOL_MAX_PER_NODE": "0"}
    srv = start_serve(home, env)
    out: dict[str, Any] = {"asked": count, "shape": IDLE_SHAPE, "env": env}
    try:
        async with AsyncClient(srv.url, srv.token) as c:
            async def probes(pick: Callable[[], str], n: int) -> list[float]:
                """n execs of `true`, 10 at a time, into sandboxes chosen by pick()."""
                lat: list[float] = []

                async def probe(sid: str) -> None:
                    t = time.perf_counter()
                    r = await c.exec(sid, ExecRequest(cmd=["true"]))
                    lat.append(time.perf_counter() - t)
                    assert r.exit_code == 0, r
                for _ in range(max(1, n // 10)):
                    await asyncio.gather(*(probe(pick()) for _ in range(10)))
                return lat

            # Baseline, same run: the same probes spread over a few sandboxes that are alone on
            # the node (one sandbox would not do: 10 concurrent execs into one 0.1-CPU sandbox
            # wait on its CFS quota, which 1,000 sandboxes picked at random never do).
            few = [(await c.create(SandboxSpec(**IDLE_SHAPE))).id for _ in range(BASELINE_SANDBOXES)]  # type: ignore[arg-type]
            rng0 = random.Random(16)
            out["exec_few_sandboxes_alone"] = {**_ms(await probes(lambda: rng0.choice(few), execs)),
                                               "sandboxes": BASELINE_SANDBOXES}
            await asyncio.gather(*(c.kill(s) for s in few))
            base, cg_base = _mem_used(), _cgroup_mem()
            ids: list[str] = []
            refusals: dict[str, int] = {}
            sem = asyncio.Semaphore(16)
            t0 = time.perf_counter()

            async def one(i: int) -> None:
                async with sem:
                    try:
                        info = await c.create(SandboxSpec(**IDLE_SHAPE, request_id=f"idle-{i}"))  # type: ignore[arg-type]
                        ids.append(info.id)
                    except Exception as e:  # noqa: BLE001 - a refusal names the resource (counted by message)
                        key = f"{type(e).__name__}: {str(e)[:120]}"
                        refusals[key] = refusals.get(key, 0) + 1
                    if (len(ids) + sum(refusals.values())) % 100 == 0:
                        progress(f"density: {len(ids)} placed, {sum(refusals.values())} refused")

            await asyncio.gather(*(one(i) for i in range(count)))
            out["placed"], out["create_all_s"], out["refusals"] = len(ids), round(time.perf_counter() - t0, 1), refusals
            await asyncio.sleep(2)  # let creation transients settle before reading memory
            used, cg_used = _mem_used() - base, _cgroup_mem() - cg_base
            # Charged to the sandboxes' cgroups (processes, tmpfs, page cache, kernel memory
            # where accounted): the per-sandbox cost. The host-wide MemAvailable delta is
            # reported too, but other work on a shared machine moves it by GBs.
            out["host_memory_mb_each"] = round(cg_used / max(1, len(ids)) / 2**20, 2)
            out["host_wide_memavailable_delta_mb_each"] = round(used / max(1, len(ids)) / 2**20, 2)
            rng = random.Random(15)
            lat = await probes(lambda: rng.choice(ids), execs) if ids else []
            # Almost every one of these is the first exec into its sandbox (or the first after
            # agent_keepalive_idle_s): a connect and the agent's handler fork included.
            out["exec_while_all_exist"] = _ms(lat) if lat else {}
            # The baseline's very pattern (32 sandboxes, connections kept alive) while all
            # exist: what 1,000 sandboxes cost every other exec on the node.
            rng0, some = random.Random(16), ids[:BASELINE_SANDBOXES]
            lat = await probes(lambda: rng0.choice(some), execs) if ids else []
            out["exec_few_while_all_exist"] = {**_ms(lat), "sandboxes": len(some)} if lat else {}
            t0 = time.perf_counter()
            for i in range(0, len(ids), 32):
                await asyncio.gather(*(c.kill(s) for s in ids[i:i + 32]))
            out["destroy_all_s"] = round(time.perf_counter() - t0, 1)
            out["listed_after_destroy"] = len(await c.list())
        t0 = time.perf_counter()
        while True:  # killed processes may take a moment to be gone (and reaped by their parent)
            left = _leftovers(home, ids)
            if not any(left.values()) or time.perf_counter() - t0 > 10:
                break
            await asyncio.sleep(0.5)
        out["leftovers_after_destroy"], out["leftovers_checked_after_s"] = left, round(time.perf_counter() - t0, 1)
    finally:
        srv.stop()
        # A run that failed half-way must not leave up to 1,000 sandboxes on a shared box.
        await asyncio.to_thread(reap_home, home)
        shutil.rmtree(home, ignore_errors=True)
    return out


# ------------------------------------------------------------------------- episodes


def _proc_cpu_s(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of a process, user + system, all threads."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / hz, (int(f[13]) + int(f[14])) / hz


def _machine_busy_s() -> float:
    """CPU seconds the whole machine was busy (every core, every process, the kernel)."""
    with open("/proc/stat") as fh:
        total, idle = parse_proc_stat(fh.read())  # idle includes iowait
    return (total - idle) / os.sysconf("SC_CLK_TCK")


def _cgroup_cpu_s(parent: str) -> float | None:
    ns = read_cgroup_cpu_ns(parent)  # None when unreadable: it never raises
    return None if ns is None else ns / 1e9


def _cpu_sample(server_pid: int, cgroup_parent: str) -> dict[str, float | None]:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    own, children = _proc_cpu_s(server_pid)
    return {"wall": time.perf_counter(), "server": own, "server_children": children,
            "client": ru.ru_utime + ru.ru_stime, "sandboxes": _cgroup_cpu_s(cgroup_parent),
            "machine": _machine_busy_s()}


def cpu_per_episode(a: dict[str, float | None], b: dict[str, float | None], episodes: int,
                    cores: int) -> dict[str, Any]:
    """Where an episode's CPU goes between two ``_cpu_sample``s (ms each), the client's share
    of what the bench's own processes used, and the episodes/s those processes would reach
    with every core to themselves (the box is shared: ``other`` is what the rest used)."""
    def d(k: str) -> float:
        x, y = a.get(k), b.get(k)
        return (y - (x or 0.0)) if y is not None else 0.0  # a cgroup made after the first sample used 0 then
    wall = d("wall")
    ms = {k: round(d(k) / max(episodes, 1) * 1000, 2) for k in ("server", "server_children", "client", "sandboxes")}
    ours = sum(ms.values())
    machine = d("machine") / max(episodes, 1) * 1000
    return {"ms_per_episode": ms, "ours_ms_per_episode": round(ours, 2),
            "other_ms_per_episode": round(max(0.0, machine - ours), 2),
            "client_share": round(ms["client"] / ours, 3) if ours else None,
            "machine_busy_cores": round(d("machine") / wall, 2) if wall else None,
            "episodes_per_s_if_all_cores_ours": round(cores * 1000 / ours, 1) if ours else None}


async def _episodes(seconds: float, workers: int, progress: Callable[[str], None],
                    env: dict[str, str] | None = None, warmup_s: float | None = None) -> dict[str, Any]:
    from dsec.api.launch import start_serve
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.node import cgroups
    from dsec.sdk import AsyncClient

    warmup_s = min(5.0, seconds / 4) if warmup_s is None else warmup_s
    home = _home("episodes")
    # Its own parent cgroup: the sandboxes' CPU is read there, apart from other runs on the box.
    parent = f"dsec-speed-ep{os.getpid()}-{random.randrange(1 << 20):05x}"  # one per run: no counter carried over
    srv = start_serve(home, {"DSEC_CGROUP_PARENT": parent, **(env or {})})
    out: dict[str, Any] = {"shape": EPISODE_SHAPE, "workers": workers, "seconds": seconds, "env": env or {}}
    try:
        async with AsyncClient(srv.url, srv.token) as c:
            http = c._http  # the scheduler view is admin-only and not in the SDK
            await http.put("/v1/pools", json={"spec": EPISODE_SHAPE, "size": workers})
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the floor is built before timing starts
                pools = (await http.get("/v1/pools")).json()["pools"]
                if pools and all(p["ready"] >= min(p["target"], workers) for p in pools):
                    break
                await asyncio.sleep(0.1)
            out["pools_at_start"] = (await http.get("/v1/pools")).json()["pools"]
            out["nodes_at_start"] = (await http.get("/v1/scheduler")).json()["nodes"]
            peak = {"ratio": 0.0}
            stop = asyncio.Event()

            async def watch() -> None:
                # Every 0.25 s: at 0.05 s this admin view (through FastAPI) was ~6 % of the
                # server's time, a cost of the bench, not of an episode.
                while not stop.is_set():
                    for node in (await http.get("/v1/scheduler")).json()["nodes"]:
                        peak["ratio"] = max(peak["ratio"], node["cpu_allocated"] / node["cpu_bound"])
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.25)

            done, errors, lat = 0, 0, []
            phases: dict[str, list[float]] = {"create": [], "exec": [], "kill": []}
            first_errors: dict[str, int] = {}

            async def worker(end: float, record: bool = True) -> None:
                nonlocal done, errors
                while time.monotonic() < end:
                    t = time.perf_counter()
                    try:
                        info = await c.create(SandboxSpec(**EPISODE_SHAPE))  # type: ignore[arg-type]
                        t1 = time.perf_counter()
                        r = await c.exec(info.id, ExecRequest(cmd=["true"]))
                        t2 = time.perf_counter()
                        await c.kill(info.id)
                        t3 = time.perf_counter()
                        assert r.exit_code == 0
                        if not record:
                            continue
                        done += 1
                        lat.append(t3 - t)
                        for k, v in (("create", t1 - t), ("exec", t2 - t1), ("kill", t3 - t2)):
                            phases[k].append(v)
                    except Exception as e:  # noqa: BLE001 - counted and shown by kind
                        if not record:
                            continue
                        errors += 1
                        first_errors.setdefault(f"{type(e).__name__}: {str(e)[:160]}", 0)
                        first_errors[f"{type(e).__name__}: {str(e)[:160]}"] += 1

            watcher = asyncio.create_task(watch())
            # Sustained rate: a warm-up first (not counted), in which the pool grows to what
            # this rate needs (cold creates: ~100 ms of runc CPU each, which would otherwise
            # be charged to the first seconds' episodes).
            warm_end = time.monotonic() + warmup_s
            await asyncio.gather(*(worker(warm_end, False) for _ in range(workers)))
            stats0 = (await http.get("/v1/scheduler")).json()["stats"]
            t0 = time.perf_counter()
            cpu0 = _cpu_sample(srv.proc.pid, parent)
            end = time.monotonic() + seconds
            await asyncio.gather(*(worker(end) for _ in range(workers)))
            cpu1 = _cpu_sample(srv.proc.pid, parent)
            wall = time.perf_counter() - t0
            stop.set()
            await watcher
            out["cpu"] = cpu_per_episode(cpu0, cpu1, done + errors, os.cpu_count() or 1)
            out["load_avg_after"] = os.getloadavg()
            out |= {"episodes": done, "errors": errors, "error_kinds": first_errors, "per_s": round(done / wall, 1),
                    "episode": _ms(lat) if lat else {}, "phases": {k: _ms(v) for k, v in phases.items() if v},
                    "peak_cpu_fraction_of_bound": round(peak["ratio"], 3),
                    "within_bound": peak["ratio"] <= 1.0}
            stats = (await http.get("/v1/scheduler")).json()["stats"]
            for k in ("warm_hits", "warm_misses", "recycled"):
                out[k] = (stats.get(k) or 0) - (stats0.get(k) or 0)  # in the timed window
            out["warmup_s"] = warmup_s
            progress(f"episodes: {out['per_s']}/s")
    finally:
        srv.stop()
        shutil.rmtree(home, ignore_errors=True)
        for h in cgroups.CGROUP_ROOT.iterdir() if cgroups.CGROUP_ROOT.is_dir() else ():
            with contextlib.suppress(OSError):
                (h / parent).rmdir()  # empty once the server tore its sandboxes down
    return out


# ----------------------------------------------------------------------------- run


def run(only: tuple[str, ...] = ROWS, rounds: int = 20, samples: int = 300, gvisor_n: int = 200,
        idle: int = 1000, episode_s: float = 20.0, workers: int = 8,
        progress: Callable[[str], Any] = print) -> dict[str, Any]:
    """Every selected row; the report carries each row's same-run baseline."""
    report: dict[str, Any] = {"load_avg_at_start": os.getloadavg()}
    if "warm" in only:
        from dsec.bench import pool
        report["warm"] = pool.run(rounds=rounds, burst=0, progress=progress)["warm_vs_cold"]
    if "sdk" in only:
        from dsec.bench import api
        report["sdk"] = api.run(sandboxes=0, samples=samples)["overhead"]["added"]
    if "gvisor" in only:
        report["gvisor"] = asyncio.run(_gvisor(gvisor_n, progress))
    if "density" in only:
        report["density"] = asyncio.run(_density(idle, 1000, progress))
    if "episodes" in only:
        # Baseline in the same run: the same load with recycling off (destroy + cold refill).
        report["episodes_no_recycle"] = asyncio.run(_episodes(episode_s / 2, workers, progress,
                                                              {"DSEC_WARM_POOL_RECYCLE": "0"}))
        report["episodes"] = asyncio.run(_episodes(episode_s, workers, progress))
    if "cold" in only:
        from dsec.bench import sandbox
        from dsec.config import get_settings
        from dsec.node.agent import LocalNodeAgent

        async def cold() -> dict[str, Any]:
            agent = LocalNodeAgent(get_settings())
            await agent.start()
            work = Path(tempfile.mkdtemp(prefix="dsec-speed-cold-"))
            # Same-run baseline: the cold path as it was before (runc compiles the seccomp
            # profile on each create, DSEC_INIT_SECCOMP=false, and runs at the node's nice,
            # DSEC_RUNTIME_NICE=0); own home and cgroup parent (its reconcile must not see
            # ours), the same image store.
            base = get_settings()
            alt = LocalNodeAgent(base.model_copy(update={
                "home": work / "alt", "run_dir": Path(tempfile.mkdtemp(prefix="dsr-", dir="/tmp")),
                "cgroup_parent": f"{base.cgroup_parent}-bench-alt", "init_seccomp": False, "runtime_nice": 0}),
                images=agent.images)
            await alt.manager.start()
            try:
                return await sandbox.bench_start(agent, "busybox", rounds, work, progress,
                                                 variants={"previous_path": alt})
            finally:
                for sid in list(alt.manager.live):
                    await alt.destroy(sid)
                alt.manager.close()
                from dsec.node import cgroups  # the baseline's own (now empty) parent cgroups
                cgroups.kill_and_remove("", alt.settings.cgroup_parent)
                shutil.rmtree(alt.settings.runtime_dir, ignore_errors=True)
                shutil.rmtree(work, ignore_errors=True)
                await agent.close()
        report["cold"] = asyncio.run(cold())
    report["table"] = table(report)
    return report


def table(r: dict[str, Any]) -> str:
    """The issue's table from a report (rows that were not run are left out)."""
    rows = ["| metric | measured | baseline (same run) | target |", "|---|---|---|---|"]
    if "warm" in r:
        w = r["warm"]
        rows.append(f"| warm acquire -> first exec result, median | {w['warm']['median_ms']} ms "
                    f"| cold create {w['cold']['median_ms']} ms | <= 5 ms |")
    if "sdk" in r:
        a = r["sdk"]
        rows.append(f"| SDK over HTTP added to node-local exec (sync / async) | {a['sdk_sync_exec']['median_added_ms']}"
                    f" / {a['sdk_async_exec']['median_added_ms']} ms | sync on urllib3 "
                    f"{a['baseline_sdk_sync_exec_urllib3_driver']['median_added_ms']} ms, async on aiohttp "
                    f"{a.get('baseline_sdk_async_exec_aiohttp_driver', {}).get('median_added_ms')} ms "
                    f"| <= 1 / <= 0.5 ms |")
    if "gvisor" in r:
        g = r["gvisor"]
        rows.append(f"| gVisor exec round trip vs container tier | {g['ratio_gvisor_vs_container']}x "
                    f"({g['gvisor']['median_ms']} vs {g['container']['median_ms']} ms) | runsc exec "
                    f"{g['ratio_runsc_exec_vs_container']}x; in-sandbox fork+exec floor "
                    f"{g.get('floor_ratio_gvisor_vs_container')}x; round trip + spawn without a program "
                    f"{g['gvisor_no_exec']['median_ms']} vs {g['container_no_exec']['median_ms']} ms "
                    f"({g['runsc_platform']}) | <= 2x |")
    if "density" in r:
        d = r["density"]
        rows.append(f"| idle sandboxes at once / host memory each | {d['placed']} of {d['asked']} / "
                    f"{d['host_memory_mb_each']} MB; exec p99 {d.get('exec_while_all_exist', {}).get('p99_ms')} ms "
                    f"(first exec into each), {d.get('exec_few_while_all_exist', {}).get('p99_ms')} ms "
                    f"(into {BASELINE_SANDBOXES} of them) | the same probes into "
                    f"{BASELINE_SANDBOXES} sandboxes alone: p99 {d.get('exec_few_sandboxes_alone', {}).get('p99_ms')} ms "
                    f"| 1,000 / <= 15 MB; p99 <= 50 ms |")
    if "episodes" in r:
        e = r["episodes"]
        pod = r.get("cold", {}).get("podman_run_rm", {}).get("median_ms")
        base = f"podman run --rm back to back: {1000 / pod:.1f}/s" if pod else "- (run with cold)"
        if "episodes_no_recycle" in r:
            base = f"recycling off (destroy + cold refill): {r['episodes_no_recycle']['per_s']}/s; {base}"
        cpu = e.get("cpu", {})
        rows.append(f"| short episodes (create->exec->destroy) per second | {e['per_s']} (bound respected: "
                    f"{e['within_bound']}; CPU ms/episode {cpu.get('ms_per_episode')}, client share "
                    f"{cpu.get('client_share')}, other load {cpu.get('other_ms_per_episode')} ms/episode; "
                    f"{cpu.get('episodes_per_s_if_all_cores_ours')}/s if every core were the bench's) "
                    f"| {base} | >= 100 |")
    if "cold" in r:
        c = r["cold"]
        alt = c.get("previous_path")
        alt_txt = (f"; previous path (runc compiles the seccomp profile, nice 0): {alt['median_ms']:.1f} ms"
                   if alt else "")
        share = c.get("of_ours", {})
        runc_txt = (f"; of which runc run -d {share['runc_run_d']['median_ms']:.1f} ms"
                    if share.get("runc_run_d", {}).get("n") else "")
        rows.append(f"| cold start create -> first exec (busybox), median | {c['ours']['median_ms']:.1f} ms "
                    f"(min {c['ours']['min_ms']:.1f}{runc_txt}) | podman run --rm "
                    f"{c['podman_run_rm']['median_ms']:.1f} ms ({c['ratio_ours_vs_podman']:.3f}x){alt_txt} "
                    f"| <= 0.25x and < 50 ms |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(ROWS), help=f"comma-separated rows of {ROWS}")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--gvisor-n", type=int, default=200)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--episode-s", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args()
    rep = run(tuple(a.only.split(",")), a.rounds, a.samples, a.gvisor_n, a.idle, a.episode_s, a.workers)
    print(json.dumps(rep, indent=2, default=str))
    print(rep["table"])


if __name__ == "__main__":
    main()
