"""Scheduler on the real server: warm-pool hand-over latency and a burst of creates.

1. Warm vs cold, interleaved round by round so machine noise hits both alike: the time
   from an SDK ``create`` call to the result of the first ``exec("true")`` (each round
   starts once the previous round's kill and pool refill are done) on
   (a) a server whose warm pool for the shape is primed (the common path), and
   (b) the same server build with pools disabled (``DSEC_WARM_POOL_MAX_PER_NODE=0``):
   every create is a cold start. Reported: medians, p90, the ratio, and the warm-hit count
   from the scheduler's own counters (so a miss cannot pass for a hit).
2. Burst: ``burst`` creates fired within one second from one asyncio client. Every answer
   must be 201 or 429 (never 5xx); ``GET /v1/scheduler`` is polled meanwhile and the
   highest CPU allocation is compared with the node's overcommit bound.

Run: ``python -m dsec.bench.pool`` or ``dsec bench pool`` (root; imports busybox into
temporary homes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

SHAPE = {"image": "busybox", "cpu": 0.5, "memory": "64M", "disk": "256M", "timeout": 600}
BURST_SHAPE = {"image": "busybox", "cpu": 0.1, "memory": "32M", "disk": "64M", "timeout": 600}


def _summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"n": len(s), "median_ms": round(statistics.median(s), 2), "p90_ms": round(s[int(len(s) * 0.9)], 2),
            "min_ms": round(s[0], 2)}


async def _create_first_exec(client: Any) -> tuple[float, float]:
    """(create -> first exec result, of which the create call) in ms."""
    from dsec.sdk import AsyncSandbox

    t0 = time.perf_counter()
    sb = await AsyncSandbox.create(**SHAPE, client=client)
    t1 = time.perf_counter()
    r = await sb.exec("true")
    t2 = time.perf_counter()
    if r.exit_code != 0:
        raise RuntimeError(f"exec in {sb.id} failed: {r.stderr!r}")
    await sb.kill()
    return (t2 - t0) * 1000, (t1 - t0) * 1000


async def _sched_state(client: Any) -> dict[str, Any]:
    return (await client._http.get("/v1/scheduler")).json()


async def _wait_warm(client: Any, want: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while True:
        warm = sum(n["warm"] for n in (await _sched_state(client))["nodes"])
        if warm >= want or time.monotonic() > deadline:
            return warm
        await asyncio.sleep(0.05)


async def _wait_settled(client: Any, timeout: float = 30) -> None:
    """Until the pool is back at its target with no member being built and the last kill
    is done: the hand-over is then timed alone, not against the previous round's churn."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await _sched_state(client)
        pools = (await client._http.get("/v1/pools")).json()["pools"]
        if all(p["ready"] >= p["target"] and p["creating"] == 0 for p in pools) and not any(
                n["creating"] for n in st["nodes"]):
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)


async def _warm_vs_cold(warm_url: str, cold_url: str, token: str, cold_token: str, rounds: int,
                        progress: Any) -> dict[str, Any]:
    from dsec.sdk import AsyncClient, AsyncSandbox

    async with AsyncClient(url=warm_url, token=token) as wc, AsyncClient(url=cold_url, token=cold_token) as cc:
        # Prime: demand for the shape (peak concurrency 4) makes the pool build members.
        primed = await asyncio.gather(*(AsyncSandbox.create(**SHAPE, client=wc) for _ in range(4)))
        await asyncio.gather(*(sb.kill() for sb in primed))
        await _wait_warm(wc, 2)
        hits0 = (await _sched_state(wc))["stats"]["warm_hits"]
        warm, cold, warm_create, cold_create = [], [], [], []
        for i in range(rounds):
            await _wait_settled(wc)  # the pool refills between rounds, as between tool calls
            for client, total, create in ((wc, warm, warm_create), (cc, cold, cold_create)):
                t, c = await _create_first_exec(client)
                total.append(t)
                create.append(c)
            progress(f"round {i + 1}/{rounds}: warm {warm[-1]:.1f} ms, cold {cold[-1]:.1f} ms")
        hits = (await _sched_state(wc))["stats"]["warm_hits"] - hits0
    w, c = _summary(warm), _summary(cold)
    w["create_median_ms"] = round(statistics.median(warm_create), 2)
    c["create_median_ms"] = round(statistics.median(cold_create), 2)
    return {"warm": w, "cold": c, "warm_hits": hits, "rounds": rounds,
            "ratio_median": round(w["median_ms"] / c["median_ms"], 3)}


async def _burst(url: str, token: str, n: int, progress: Any) -> dict[str, Any]:
    import httpx

    headers = {"authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120) as http:
        peak = {"alloc": 0.0, "bound": 0.0, "ratio": 0.0, "queue": 0}
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                st = (await http.get("/v1/scheduler")).json()
                for node in st["nodes"]:
                    r = node["cpu_allocated"] / node["cpu_bound"]
                    if r > peak["ratio"]:
                        peak.update(alloc=node["cpu_allocated"], bound=node["cpu_bound"], ratio=round(r, 4))
                peak["queue"] = max(peak["queue"], st["queue_depth"])
                await asyncio.sleep(0.02)

        async def one(i: int) -> tuple[int, float]:
            await asyncio.sleep(i / n)  # spread over one second
            t0 = time.perf_counter()
            r = await http.post("/v1/sandboxes", json={**BURST_SHAPE, "request_id": f"burst-{i}"})
            return r.status_code, time.perf_counter() - t0

        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
        stop.set()
        await watcher
        codes = Counter(code for code, _ in answers)
        progress(f"burst answers: {dict(codes)} in {wall:.1f}s; peak allocation {peak['ratio']:.2%} of the bound")
        live = (await http.get("/v1/sandboxes")).json()
        await asyncio.gather(*(http.delete(f"/v1/sandboxes/{sb['id']}") for sb in live))
        created = [dt * 1000 for code, dt in answers if code == 201]
        return {"requests": n, "answers": {str(k): v for k, v in sorted(codes.items())},
                "server_errors": sum(v for k, v in codes.items() if k >= 500), "wall_s": round(wall, 2),
                "created_latency": _summary(created) if created else {},
                "peak_cpu_allocated": peak["alloc"], "cpu_bound": peak["bound"],
                "peak_fraction_of_bound": peak["ratio"], "peak_queue_depth": peak["queue"],
                "within_bound": peak["ratio"] <= 1.0}


def run(rounds: int = 30, burst: int = 200, progress: Any = print) -> dict[str, Any]:
    import uvloop

    from dsec.api.launch import start_serve
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    root = Path(tempfile.mkdtemp(prefix="dsec-bench-pool-"))
    servers = []
    try:
        for name in ("warm", "cold"):
            home = root / name
            ensure_stock(ImageStore(home / "images", Settings(home=home)), only=["busybox"], log=lambda _: None)
        warm = start_serve(root / "warm")
        servers.append(warm)
        cold = start_serve(root / "cold", {"DSEC_WARM_POOL_MAX_PER_NODE": "0"})
        servers.append(cold)
        progress(f"servers up: warm pools {warm.url}, no pools {cold.url}")
        wc = uvloop.run(_warm_vs_cold(warm.url, cold.url, warm.token, cold.token, rounds, progress))
        bu = uvloop.run(_burst(warm.url, warm.token, burst, progress))
        return {"bench": "scheduler-on-server", "warm_vs_cold": wc, "burst": bu}
    finally:
        for s in servers:
            _kill_all(s.url, s.token)
            s.stop()
        shutil.rmtree(root, ignore_errors=True)


def _kill_all(url: str, token: str) -> None:
    """Leave nothing behind, even when a phase failed half-way (the homes are removed next)."""
    import httpx

    try:
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=60) as c:
            for sb in c.get("/v1/sandboxes").json():
                c.delete(f"/v1/sandboxes/{sb['id']}")
    except httpx.HTTPError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--burst", type=int, default=200)
    a = ap.parse_args()
    print(json.dumps(run(a.rounds, a.burst), indent=2))


if __name__ == "__main__":
    main()
