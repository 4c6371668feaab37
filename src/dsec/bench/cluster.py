"""``dsec bench cluster``: the control plane over many node agents, and a 3-node cluster.

Placements (issue 11: "Control plane with 100 node agents ... >= 1,000 placements/s end
to end through the real driver"):

- The REAL driver of ``dsec serve --cluster`` (``dsec.control.driver.SchedulerDriver``
  over the pure ``Scheduler``) places ``placements`` creates, all submitted at once by
  ``concurrency`` callers, over ``nodes`` node agents.
- End to end = ``driver.create`` called -> placement decided -> ``create`` answered by
  the node agent -> the caller has its ``SandboxInfo``. placements/s = placements / wall.
- Two runs side by side, same driver code, same fake agent (``dsec.testing.FakeNodeAgent``,
  held to the node contract suite):
  - ``in_process``: the agents are plain objects in the driver's process (the cost of the
    control plane alone);
  - ``ray``: each agent is a Ray actor (``dsec.cluster.ray.ensure_agent(kind="fake")``,
    exactly what ``dsec serve --cluster`` starts per node, minus runc), reached through
    ``RayNodeProxy``. The 100 DSec nodes are 100 ``dsec_node_<ID>`` custom resources on
    one local Ray node (``ray.init``), so each actor is pinned as on a real cluster.
  The ratio ``ray / in_process`` is what the Ray hop costs.
- Every run checks what it measured: each node agent lists the sandboxes it was said to
  have created (no placement counted that did not happen).

3-node throughput (``--real``): sandboxes created + exec'd + destroyed per second by
``workers`` SDK clients for ``seconds`` through ``dsec serve --cluster`` on a
``dsec cluster up --nodes 3`` vs a single-node ``dsec serve`` in the same run (real runc).

Where the time goes is written up in docs/cluster.md ("Control-plane throughput").

Run: ``dsec bench cluster [--nodes 100 --placements 5000] [--real]``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dsec.config import Settings, load_settings
from dsec.models import SandboxSpec
from dsec.node.api import NodeAgent
from dsec.node.proctree import descendants

# Small enough that 100 fake nodes (8 CPUs, 100 sandboxes each) hold every placement.
SHAPE: dict[str, Any] = {"image": "busybox", "cpu": 0.1, "memory": 64 * 2**20, "disk": 64 * 2**20}
TENANTS = 8  # requests come from several tenants, as in a real burst
FAKE_MAX_SANDBOXES = 100  # FakeNodeAgent's default per-node cap (the actors run the defaults)


def driver_settings(home: Path) -> Settings:
    """The driver's settings for the placement runs: ``dsec serve``'s defaults, except no
    demand-driven warm pools (pool builds would add creates of their own to the count)."""
    return load_settings(home=home, warm_pool_factor=0.0)


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": round(xs[len(xs) // 2] * 1000, 2), "p99": round(xs[int(len(xs) * 0.99)] * 1000, 2),
            "mean": round(statistics.mean(xs) * 1000, 2)}


def _cpu_s(pids: set[int]) -> float:
    """CPU seconds (user + system) the live processes ``pids`` used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    me, own, ticks = os.getpid(), 0.0, 0
    for pid in pids:
        if pid == me:  # /proc counts in 10 ms ticks: a quick run's driver would read 0
            own = time.process_time()
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return own + ticks / tick


def cpu_split(actor_pids: set[int]) -> dict[str, set[int]]:
    """Where CPU goes: this process (the driver), the node agent actors, Ray's own processes."""
    me = os.getpid()
    return {"driver": {me}, "agents": set(actor_pids), "ray_system": set(descendants([me])) - {me} - set(actor_pids)}


async def place(agents: Mapping[str, NodeAgent], placements: int, concurrency: int, settings: Settings,
                warmup: int = 0, actor_pids: set[int] | None = None) -> dict[str, Any]:
    """``placements`` creates through a fresh ``SchedulerDriver`` over ``agents``, ``concurrency``
    in flight; returns placements/s, latency and how the placements spread."""
    from dsec.control.driver import SchedulerDriver
    from dsec.control.scheduler import Scheduler

    driver = SchedulerDriver(Scheduler(settings), agents, settings)
    await driver.start()
    spec = SandboxSpec(**SHAPE)
    lat: list[float] = []
    where: dict[str, str] = {}
    try:
        for i in range(warmup):  # first calls pay one-time costs (imports, connections)
            info = await driver.create(spec, f"sb-warm-{i}", "t0")
            await driver.release(info.id)
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                info = await driver.create(spec, f"sb-bench-{i}", f"t{i % TENANTS}")
                lat.append(time.perf_counter() - t)
                where[info.id] = info.node or ""

        groups = cpu_split(actor_pids or set())
        cpu0 = {k: _cpu_s(v) for k, v in groups.items()}
        trips0, calls0 = _batching(agents.values())
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(placements)))
        wall = time.perf_counter() - t0
        cpu = {k: round(_cpu_s(v) - cpu0[k], 4) for k, v in groups.items()}
        trips, calls = _batching(agents.values())
        trips, calls = trips - trips0, calls - calls0
        if not actor_pids:
            del cpu["agents"], cpu["ray_system"]
        # What the agents hold must be what was counted.
        listed = await asyncio.gather(*(a.list() for a in agents.values()))
        held = {i.id for infos in listed for i in infos}
        missing = sorted(set(where) - held)[:5]
        per_node = [sum(1 for n in where.values() if n == nid) for nid in agents]
        stats = dict(driver.sched.stats) if hasattr(driver.sched, "stats") else {}
        return {"nodes": len(agents), "placements": len(where), "concurrency": concurrency,
                "wall_s": round(wall, 3), "per_s": round(len(where) / wall, 1), "latency_ms": _ms(lat),
                "cpu_s": cpu, "cpu_ms_per_placement": round(sum(cpu.values()) * 1000 / max(len(where), 1), 3),
                # What one driver core would sustain if the driver had it to itself (on a real
                # cluster the agents run on their own machines): the box-independent figure.
                "driver_cpu_ms_per_placement": round(cpu["driver"] * 1000 / max(len(where), 1), 3),
                "per_s_per_driver_core": round(len(where) / cpu["driver"], 1) if cpu["driver"] else None,
                "load_avg_1m": os.getloadavg()[0],
                "calls_per_round_trip": round(calls / trips, 2) if trips else None, "nodes_used": sum(1 for c in per_node if c), "per_node_min": min(per_node),
                "per_node_max": max(per_node), "held_by_agents": len(held & set(where)), "missing": missing,
                "scheduler_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
    finally:
        await driver.close()
        await asyncio.gather(*(_clear(a) for a in agents.values()), return_exceptions=True)


def _batching(agents: Any) -> tuple[int, int]:
    """(actor round trips, control calls) the Ray proxies sent so far (0, 0 in-process)."""
    stats = [getattr(a, "batching", {}) for a in agents]
    return sum(x.get("round_trips", 0) for x in stats), sum(x.get("calls", 0) for x in stats)


async def _clear(agent: NodeAgent) -> None:
    for info in await agent.list():
        await agent.destroy(info.id)


def fake_agents(nodes: int, settings: Settings) -> dict[str, NodeAgent]:
    """In-process fakes, the same class and defaults the Ray actors run."""
    from dsec.testing import FakeNodeAgent

    return {f"f{i}": FakeNodeAgent(settings, node_id=f"f{i}") for i in range(nodes)}


async def ray_agents(nodes: int, home: Path, timeout_s: float = 600.0, direct: bool = True
                     ) -> dict[str, NodeAgent]:
    """One fake node agent actor per simulated DSec node on the local Ray instance, started
    the way ``dsec serve --cluster`` starts real ones (``ensure_agent``), behind proxies:
    ``direct`` as the server (calls on each agent's data endpoint), or every call an actor
    call (the fallback path, where control calls are coalesced per loop pass)."""
    from dsec.cluster.ray import RayNodeProxy, ensure_agent

    handles = {f"f{i}": ensure_agent(f"f{i}", kind="fake", overrides={"home": str(home)}) for i in range(nodes)}
    proxies = {nid: RayNodeProxy(nid, h, timeout_s, direct=direct) for nid, h in handles.items()}
    await asyncio.gather(*(p.start() for p in proxies.values()))
    return dict(proxies)


def start_local_ray(nodes: int) -> None:
    """A local Ray instance whose one node carries ``nodes`` DSec node resources."""
    import logging

    import ray

    from dsec.cluster.ray import NAMESPACE, node_resource

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Explicit, as `dsec cluster up` does: without it Ray 2.5x may switch token auth on
    # for every later cluster on the box (it writes ~/.ray/auth_token on a bare init).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=os.cpu_count() or 2, resources={node_resource(f"f{i}"): 1 for i in range(nodes)},
             namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
             configure_logging=False, object_store_memory=128 * 2**20)


def run_placements(nodes: int = 100, placements: int = 5000, concurrency: int = 5000, use_ray: bool = True,
                   progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Both runs (in-process, then Ray) with the same driver, agents and load."""
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-cluster-"))
    settings = driver_settings(home)
    out: dict[str, Any] = {"shape": {k: v for k, v in SHAPE.items()}, "target_per_s": 1000}
    try:
        progress(f"in-process: {placements} placements over {nodes} fake agents")
        out["in_process"] = asyncio.run(_in_process(nodes, placements, concurrency, settings))
        progress(f"in-process: {out['in_process']['per_s']}/s")
        if use_ray:
            import ray

            progress(f"ray: starting {nodes} node agent actors")
            t0 = time.perf_counter()
            start_local_ray(nodes)
            try:
                out |= asyncio.run(_on_ray(nodes, placements, concurrency, settings, home, t0, progress))
            finally:
                ray.shutdown()
            progress(f"ray: {out['ray']['per_s']}/s, actor calls only: {out['ray_actor_calls']['per_s']}/s")
            base = out["in_process"]["per_s"]
            out["ray_vs_in_process"] = round(out["ray"]["per_s"] / base, 3)
            out["ray_actor_calls_vs_in_process"] = round(out["ray_actor_calls"]["per_s"] / base, 3)
            out["target_met"] = out["ray"]["per_s"] >= out["target_per_s"]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return out


async def _in_process(nodes: int, placements: int, concurrency: int, settings: Settings) -> dict[str, Any]:
    agents = fake_agents(nodes, settings)
    await asyncio.gather(*(a.start() for a in agents.values()))
    return await place(agents, placements, concurrency, settings, warmup=min(20, placements))


async def _on_ray(nodes: int, placements: int, concurrency: int, settings: Settings, home: Path, t0: float,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    agents = await ray_agents(nodes, home)
    started = time.perf_counter() - t0
    progress(f"ray: {nodes} actors up in {started:.1f}s; placing")
    pids = {await a.agent_pid() for a in agents.values()}  # type: ignore[attr-defined]
    res = await place(agents, placements, concurrency, settings, warmup=min(20, placements), actor_pids=pids)
    res["transport"] = _transport(agents)
    res["actors_start_s"] = round(started, 1)
    res["actor_processes"] = len(pids)
    progress(f"ray: {res['per_s']}/s ({res['transport']}); again with every call an actor call")
    # The same actors, every call through Ray (the proxy's fallback when no data endpoint).
    calls = await ray_agents(nodes, home, direct=False)
    res2 = await place(calls, placements, concurrency, settings, warmup=min(20, placements), actor_pids=pids)
    res2["transport"] = _transport(calls)
    for a in agents.values():
        await a.shutdown()  # type: ignore[attr-defined]
    return {"ray": res, "ray_actor_calls": res2}


def _transport(agents: Mapping[str, NodeAgent]) -> str:
    """Which path the proxies' calls took (direct data endpoint or Ray actor calls)."""
    stats = [getattr(a, "stats", {}) for a in agents.values()]
    direct, ray = sum(x.get("direct", 0) for x in stats), sum(x.get("ray", 0) for x in stats)
    return f"direct {direct} / ray {ray} calls"


# ------------------------------------------------------------------ 3 real nodes

REAL_SHAPE: dict[str, Any] = {"image": "busybox", "cpu": 0.1, "memory": "64M", "disk": "64M", "timeout": 600}
# Both servers get the same settings. The usage-based overcommit guard is off: every
# `dsec cluster up` node on one box measures the same machine, so other jobs' load
# (load average 10-80 here) would make all nodes refuse placements and the figure would
# measure that load, not create -> exec -> destroy. The reservation bound stays on.
REAL_ENV = {"DSEC_OVERCOMMIT_THRESHOLD": "1000"}


async def _load(url: str, token: str, seconds: float, workers: int, warmup_s: float) -> dict[str, Any]:
    """``workers`` SDK clients, each create -> exec -> destroy back to back for ``seconds``
    (after ``warmup_s`` of the same, not counted: demand-driven pools form on both sides)."""
    from dsec.models import ExecRequest
    from dsec.sdk import AsyncClient

    done, errors, lat, nodes = 0, 0, [], {}
    kinds: dict[str, int] = {}
    async with AsyncClient(url, token) as c:
        async def worker(until: float, count: bool) -> None:
            nonlocal done, errors
            while time.monotonic() < until:
                t = time.perf_counter()
                try:
                    info = await c.create(SandboxSpec(**REAL_SHAPE))
                    r = await c.exec(info.id, ExecRequest(cmd=["true"]))
                    await c.kill(info.id)
                    if r.exit_code != 0:
                        raise RuntimeError(f"exit {r.exit_code}")
                except Exception as e:  # noqa: BLE001 - counted and shown by kind
                    if count:
                        errors += 1
                        k = f"{type(e).__name__}: {str(e)[:120]}"
                        kinds[k] = kinds.get(k, 0) + 1
                    continue
                if count:
                    done += 1
                    lat.append(time.perf_counter() - t)
                    nodes[info.node or ""] = nodes.get(info.node or "", 0) + 1

        await asyncio.gather(*(worker(time.monotonic() + warmup_s, False) for _ in range(workers)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(time.monotonic() + seconds, True) for _ in range(workers)))
        wall = time.perf_counter() - t0
    return {"sandboxes": done, "errors": errors, "error_kinds": kinds, "per_s": round(done / wall, 2),
            "cycle_ms": _ms(lat) if lat else {}, "by_node": nodes, "workers": workers, "seconds": seconds}


def run_real(seconds: float = 20.0, workers: int = 8, progress: Callable[[str], None] = lambda _m: None
             ) -> dict[str, Any]:
    """create -> exec -> destroy per second: a single-node ``dsec serve``, then ``dsec serve
    --cluster`` on a 3-node ``dsec cluster up`` (real runc), same load, same box."""
    from dsec.api.launch import reap_home, start_serve
    from dsec.cluster import local
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    out: dict[str, Any] = {"shape": REAL_SHAPE, "cpus": os.cpu_count(), "server_env": REAL_ENV}
    base = Path(tempfile.mkdtemp(prefix="dsec-bench-real-"))
    try:
        single = base / "single"
        ensure_stock(ImageStore(single / "images", Settings(home=single)), only=["busybox"], log=lambda _m: None)
        progress("real: single-node dsec serve")
        srv = start_serve(single, REAL_ENV, timeout=240)
        try:
            out["single_node"] = asyncio.run(_load(srv.url, srv.token, seconds, workers, min(5.0, seconds / 4)))
        finally:
            srv.stop()
            reap_home(single)
        progress(f"real: single node {out['single_node']['per_s']}/s; starting a 3-node cluster")
        c = local.up(base / "cluster", 3, ["busybox"], log=lambda _m: None)
        try:
            api = base / "api"
            srv = start_serve(api, {"DSEC_CLUSTER": c.address, **local.shared_env(c), **REAL_ENV}, timeout=240)
            try:
                progress("real: dsec serve --cluster (3 nodes)")
                out["cluster_3_nodes"] = asyncio.run(_load(srv.url, srv.token, seconds, workers,
                                                           min(5.0, seconds / 4)))
            finally:
                srv.stop()
        finally:
            local.down(base / "cluster", log=lambda _m: None)
        out["ratio"] = round(out["cluster_3_nodes"]["per_s"] / max(out["single_node"]["per_s"], 1e-9), 2)
        progress(f"real: 3 nodes {out['cluster_3_nodes']['per_s']}/s ({out['ratio']}x)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def run(nodes: int = 100, placements: int = 5000, concurrency: int = 5000, use_ray: bool = True,
        real: bool = False, real_seconds: float = 20.0, workers: int = 8,
        progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """``dsec bench cluster``: the placement runs, and with ``real`` the 3-node figure."""
    from dsec.errors import InvalidArgument

    if nodes < 1 or placements < 1:
        raise InvalidArgument("--nodes and --placements must be at least 1", field="nodes")
    room = nodes * FAKE_MAX_SANDBOXES
    if placements > room * 0.9:  # the spread is uneven: leave some room on every node
        raise InvalidArgument(f"--placements {placements} does not fit {nodes} fake nodes of "
                              f"{FAKE_MAX_SANDBOXES} sandboxes each (at most {int(room * 0.9)}); add nodes",
                              field="placements")
    report = run_placements(nodes, placements, concurrency, use_ray, progress)
    if real:
        report["real"] = run_real(real_seconds, workers, progress)
    report["table"] = table(report)
    return report


def table(r: dict[str, Any]) -> str:
    head = ("| run | nodes | placements | placements/s | latency p50 / p99 (ms) | driver CPU ms / placement "
            "(placements/s per driver core) | all CPU ms / placement | load |")
    rows = [head, "|---|---|---|---|---|---|---|---|"]
    for key, name in (("in_process", "driver + in-process fake agents"),
                      ("ray", "driver + fake agents as Ray actors (direct data endpoint)"),
                      ("ray_actor_calls", "driver + fake agents as Ray actors (every call an actor call)")):
        if key in r:
            x = r[key]
            rows.append(f"| {name} | {x['nodes']} | {x['placements']} | {x['per_s']} | "
                        f"{x['latency_ms']['p50']} / {x['latency_ms']['p99']} | {x['driver_cpu_ms_per_placement']} "
                        f"({x['per_s_per_driver_core']}) | {x['cpu_ms_per_placement']} | {x['load_avg_1m']:.1f} |")
    if "ray_vs_in_process" in r:
        rows.append(f"| Ray actors (direct) / in-process | | | {r['ray_vs_in_process']}x | | | | |")
        rows.append(f"| Ray actors (actor calls) / in-process | | | {r['ray_actor_calls_vs_in_process']}x | | | | |")
    if "real" in r:
        real = r["real"]
        rows += ["", "| create -> exec -> destroy | sandboxes/s | errors |", "|---|---|---|"]
        for key in ("single_node", "cluster_3_nodes"):
            if key in real:
                rows.append(f"| {key} | {real[key]['per_s']} | {real[key]['errors']} |")
        if "ratio" in real:
            rows.append(f"| 3 nodes / 1 node | {real['ratio']}x | |")
    return "\n".join(rows)
