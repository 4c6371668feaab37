"""API/SDK benchmark: what the HTTP service layer adds, and how it holds up under load.

1+2. Overhead, interleaved sample by sample so machine noise hits both sides alike. The
   server (``create_app`` on uvicorn/uvloop/httptools, real ``LocalNodeAgent``) runs on
   this process's event loop; each round times the node-local path (``node.exec`` /
   ``node.get`` awaited directly, no HTTP) and the same operation through the SDK over
   loopback HTTP (async client on the same loop; sync client from a worker thread).
   Reported: medians and the median of paired differences (= what the service layer
   adds). ``get`` isolates the HTTP+service cost from the variance of running a process.
3. Load, against a separate ``dsec serve`` process: one asyncio client drives
   ``sandboxes`` concurrent sandboxes x ``execs`` execs each: throughput and p50/p99,
   while a separate process probes ``GET /health`` every ``probe_interval_s`` (p99
   overall, during the create burst and during the exec phase) and, right after each
   probe, the same endpoint of an idle reference server with the same HTTP stack: the
   baseline that shows what the machine itself adds. The server's own event-loop lag
   histogram is reported too (lag = work on the loop; latency without lag = CPU
   contention outside it).

Run: ``python -m dsec.bench.api [--sandboxes 200 --execs 50]`` (root; needs busybox).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# cpu=1: with a fractional CPU the CFS quota (e.g. 1 ms per 100 ms period at cpu=0.01)
# throttles even `true` to ~100 ms, and that noise, not the API, would be measured.
SPEC = {"image": "busybox", "cpu": 1, "memory": "32M", "timeout": 3600}


# The load measures the API serving execs, not placement: creates go straight to the
# node, so 200 one-CPU sandboxes fit a 2-core machine (the scheduler would, rightly,
# admit only ~2; and fractional CPUs make CFS throttling the measured quantity).
LOAD_SERVER_ENV = {"DSEC_API_SCHEDULER": "0"}


def _stats(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    if not ms:
        return {"n": 0}
    pick = lambda q: ms[min(len(ms) - 1, int(len(ms) * q))]  # noqa: E731
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p99_ms": round(pick(0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3), "max_ms": round(ms[-1], 3)}


def _paired(base: list[float], other: list[float]) -> dict[str, float]:
    d = sorted((o - b) * 1000 for b, o in zip(base, other))
    return {"median_added_ms": round(statistics.median(d), 3), "p90_added_ms": round(d[int(len(d) * 0.9)], 3)}


async def _overhead(home: Path, samples: int, warmup: int) -> dict[str, Any]:
    """Server in a thread (own uvloop); SDK calls from this loop; baseline timed in the server loop."""
    import httpx
    import uvicorn

    from dsec.api.app import create_app
    from dsec.api.server import build_embedded, ensure_local_token, uvicorn_config
    from dsec.config import Settings
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.sdk import AsyncClient, Client

    # No loop boost here: it would stay on this process's main thread and give the load
    # client below (an ordinary program in real use) the server's priority.
    settings = Settings(home=home, api_loop_nice=0)
    services = build_embedded(settings)
    await services.state.open()
    token = await ensure_local_token(services)
    server = uvicorn.Server(uvicorn_config(create_app(services), settings, "127.0.0.1", 0, "warning"))
    # The server runs on THIS event loop: the async SDK and the node-local baseline share
    # it, so "added" is the service layer's own cost (HTTP both ways, auth, audit, metrics)
    # with no thread hand-off. The sync client runs in a worker thread, as it would in a
    # separate program.
    serve_task = asyncio.create_task(server.serve())
    while not server.started:
        if serve_task.done():
            raise RuntimeError("in-process server failed to start")
        await asyncio.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    # In-run baselines for this layer's own choices: the same services behind the plain
    # FastAPI routes (no exec fast path), and the httpx driver instead of aiohttp.
    ref_server = uvicorn.Server(uvicorn_config(create_app(services, manage_lifecycle=False, hot_path=False),
                                               settings, "127.0.0.1", 0, "warning"))
    ref_task = asyncio.create_task(ref_server.serve())
    while not ref_server.started:
        if ref_task.done():
            raise RuntimeError("in-process reference server failed to start")
        await asyncio.sleep(0.02)
    ref_url = f"http://127.0.0.1:{ref_server.servers[0].sockets[0].getsockname()[1]}"
    node = services.node

    async def timed(coro: Any) -> float:
        t0 = time.perf_counter()
        await coro
        return time.perf_counter() - t0

    def timed_sync(fn: Any, *args: Any) -> float:
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0

    req = ExecRequest(cmd=["true"])
    series: dict[str, list[float]] = {k: [] for k in (
        "node_exec", "sdk_async_exec", "sdk_sync_exec", "node_get", "sdk_async_get", "sdk_sync_get",
        "sdk_async_exec_httpx_driver", "sdk_async_exec_fastapi_route", "sdk_sync_exec_urllib3_driver",
        "sdk_async_exec_aiohttp_driver")}
    try:
        async with AsyncClient(url, token) as ac, \
                AsyncClient(url, token, transport=httpx.AsyncHTTPTransport()) as hx, \
                AsyncClient(ref_url, token) as fr, AsyncClient(url, token) as aio:
            aio._aio._raw = None  # type: ignore[union-attr]  # in-run baseline: the async SDK on aiohttp
            sc = Client(url, token)
            su3 = Client(url, token)  # in-run baseline: the sync SDK on urllib3 (before its raw path)
            su3._u3._raw = None  # type: ignore[union-attr]
            info = await ac.create(SandboxSpec(**SPEC))  # type: ignore[arg-type]
            sid = info.id
            try:
                for i in range(warmup + samples):
                    row = {
                        "node_exec": await timed(node.exec(sid, req)),
                        "sdk_async_exec": await timed(ac.exec(sid, req)),
                        "sdk_sync_exec": await asyncio.to_thread(timed_sync, sc.exec, sid, req),
                        "node_get": await timed(node.get(sid)),
                        "sdk_async_get": await timed(ac.get(sid)),
                        "sdk_sync_get": await asyncio.to_thread(timed_sync, sc.get, sid),
                        "sdk_async_exec_httpx_driver": await timed(hx.exec(sid, req)),
                        "sdk_async_exec_fastapi_route": await timed(fr.exec(sid, req)),
                        "sdk_sync_exec_urllib3_driver": await asyncio.to_thread(timed_sync, su3.exec, sid, req),
                        "sdk_async_exec_aiohttp_driver": await timed(aio.exec(sid, req)),
                    }
                    if i >= warmup:
                        for k, v in row.items():
                            series[k].append(v)
            finally:
                await ac.kill(sid)
                sc.close()
                su3.close()
    finally:
        ref_server.should_exit = True
        await ref_task
        server.should_exit = True
        await serve_task
        await services.state.close()
    out: dict[str, Any] = {k: _stats(v) for k, v in series.items()}
    out["added"] = {
        "sdk_async_exec": _paired(series["node_exec"], series["sdk_async_exec"]),
        "sdk_sync_exec": _paired(series["node_exec"], series["sdk_sync_exec"]),
        "sdk_async_get": _paired(series["node_get"], series["sdk_async_get"]),
        "sdk_sync_get": _paired(series["node_get"], series["sdk_sync_get"]),
        "baseline_sdk_async_exec_httpx_driver": _paired(series["node_exec"], series["sdk_async_exec_httpx_driver"]),
        "baseline_sdk_async_exec_fastapi_route": _paired(series["node_exec"],
                                                         series["sdk_async_exec_fastapi_route"]),
        "baseline_sdk_sync_exec_urllib3_driver": _paired(series["node_exec"], series["sdk_sync_exec_urllib3_driver"]),
        "baseline_sdk_async_exec_aiohttp_driver": _paired(series["node_exec"],
                                                          series["sdk_async_exec_aiohttp_driver"]),
    }
    return out


def _probe(url: str, ref_url: str, interval: float, stop: Any, q: Any) -> None:
    """GET /health of the server, then of the idle reference server, every ``interval``.

    The prober runs boosted (nice -10, when root) so that what it measures is the servers,
    not its own wait for a CPU on a busy machine."""
    import httpx

    from dsec.api.priority import boost_current_thread
    boost_current_thread(-10)

    lat: list[tuple[float, float]] = []  # (wall clock at send, latency)
    ref: list[float] = []
    errors = 0
    with httpx.Client(base_url=url, timeout=10) as c, httpx.Client(base_url=ref_url, timeout=10) as r:
        while not stop.is_set():
            at, t0 = time.time(), time.perf_counter()
            try:
                c.get("/health").raise_for_status()
                lat.append((at, time.perf_counter() - t0))
            except httpx.HTTPError:
                errors += 1
            t0 = time.perf_counter()
            try:
                r.get("/health").raise_for_status()
                ref.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                pass
            time.sleep(interval)
    q.put({"latencies": lat, "reference": ref, "errors": errors})


def _reference_server(port: int) -> None:
    """Baseline for /health: the same stack (uvicorn, uvloop, httptools) serving a constant
    /health with nothing else to do. Its latency, probed in the same run by the same
    prober, is what the machine itself adds (CPU contention, the prober's own wake-ups)."""
    import uvicorn

    body = b'{"status":"ok"}'

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="off",
                log_level="warning", access_log=False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _load(url: str, token: str, sandboxes: int, execs: int, probe_interval: float) -> dict[str, Any]:
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.sdk import AsyncClient

    res: dict[str, Any] = {}
    async with AsyncClient(url, token) as c:
        # --- load: N sandboxes x M execs from this one client, /health probed elsewhere ---
        ctx = mp.get_context("spawn")
        stop, q = ctx.Event(), ctx.Queue()
        ref_port = _free_port()
        reference = ctx.Process(target=_reference_server, args=(ref_port,), daemon=True)
        reference.start()
        await _wait_up(f"http://127.0.0.1:{ref_port}")
        prober = ctx.Process(target=_probe, args=(url, f"http://127.0.0.1:{ref_port}", probe_interval, stop, q),
                             daemon=True)
        prober.start()
        label = {"bench": f"api-{os.getpid()}"}
        t0 = time.perf_counter()
        create_lat: list[float] = []

        async def create_one() -> str:
            s = time.perf_counter()
            i = await c.create(SandboxSpec(**SPEC, labels=label))  # type: ignore[arg-type]
            create_lat.append(time.perf_counter() - s)
            return i.id

        lat: list[float] = []
        failures = 0

        async def drive(sid: str) -> None:
            nonlocal failures
            for k in range(execs):
                s = time.perf_counter()
                r = await c.exec(sid, ExecRequest(cmd=["echo", str(k)]))
                lat.append(time.perf_counter() - s)
                failures += r.exit_code != 0 or r.stdout != f"{k}\n"

        try:
            w0 = time.time()
            ids = await asyncio.gather(*(create_one() for _ in range(sandboxes)))
            create_wall = time.perf_counter() - t0
            w1 = time.time()
            lag0 = await _loop_lag_buckets(c)
            t1 = time.perf_counter()
            await asyncio.gather(*(drive(s) for s in ids))
            exec_wall = time.perf_counter() - t1
            lag1 = await _loop_lag_buckets(c)
        finally:  # never leave the benchmark's sandboxes behind, even on failure
            stop.set()
            killed = await c.kill_by_labels(label)
        probe = await asyncio.to_thread(q.get, True, 30)
        prober.join(10)
        reference.terminate()
        reference.join(10)
        res["load"] = {
            "sandboxes": sandboxes, "execs_per_sandbox": execs, "creates": _stats(create_lat),
            "create_wall_s": round(create_wall, 3), "creates_per_s": round(sandboxes / create_wall, 1),
            "exec": _stats(lat), "exec_wall_s": round(exec_wall, 3),
            "execs_per_s": round(len(lat) / exec_wall, 1), "exec_failures": failures,
            "health_during_load": _stats([x for _, x in probe["latencies"]]) | {"errors": probe["errors"]},
            "health_reference_idle_server": _stats(probe["reference"]),
            # Split by phase: create bursts vs the exec phase (different parts of the node work).
            "health_during_creates": _stats([x for at, x in probe["latencies"] if w0 <= at < w1]),
            "health_during_execs": _stats([x for at, x in probe["latencies"] if at >= w1]),
            "killed": len(killed),
            "server_loop_lag_during_execs": _lag_shares(lag0["lag"], lag1["lag"]),
            "server_gc_pauses_during_execs": _lag_shares(lag0["gc"], lag1["gc"]),
        }
    return res


async def _wait_up(url: str) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=1) as c:
        for _ in range(200):
            try:
                (await c.get("/health")).raise_for_status()
                return
            except httpx.HTTPError:
                await asyncio.sleep(0.05)
    raise RuntimeError(f"reference server at {url} did not start")


async def _loop_lag_buckets(c: Any) -> dict[str, dict[str, float]]:
    """Cumulative buckets (``+Inf`` = count) of the server's loop-lag histogram (how late
    its loop runs a timer) and of its GC pauses (all generations summed)."""
    text = (await c._http.get("/metrics")).text
    out: dict[str, dict[str, float]] = {"lag": {}, "gc": {}}
    for line in text.splitlines():
        for key, name in (("lag", "dsec_event_loop_lag_seconds_bucket"), ("gc", "dsec_gc_pause_seconds_bucket")):
            if line.startswith(name):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[key][le] = out[key].get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _lag_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Lag between two snapshots: lag means work ON the loop (or the loop thread waiting
    for a CPU); /health latency without lag is queueing outside the loop."""
    n = after.get("+Inf", 0.0) - before.get("+Inf", 0.0)
    shares = {f"share_le_{le}s": round((after[le] - before.get(le, 0.0)) / n, 4)
              for le in ("0.005", "0.01", "0.025", "0.05", "0.1") if n and le in after}
    return {"samples": int(n), **shares}


def run(home: Path | str | None = None, sandboxes: int = 200, execs: int = 50, samples: int = 300,
        warmup: int = 30, probe_interval_s: float = 0.02) -> dict[str, Any]:
    import uvloop

    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    tmp = None
    if home is None:
        tmp = tempfile.mkdtemp(prefix="dsec-bench-api-")
        home = tmp
    home = Path(home)
    try:
        ensure_stock(ImageStore(home / "images", Settings(home=home)), only=["busybox"], log=lambda _: None)
        result: dict[str, Any] = {}
        if samples > 0:
            result["overhead"] = uvloop.run(_overhead(home, samples, warmup))
        if sandboxes > 0:
            from dsec.api.launch import start_serve

            srv = start_serve(home, log_name="bench-serve.log")
            try:
                result |= uvloop.run(_load(srv.url, srv.token, sandboxes, execs, probe_interval_s))
            finally:
                srv.stop()
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, default=None)
    p.add_argument("--sandboxes", type=int, default=200)
    p.add_argument("--execs", type=int, default=50)
    p.add_argument("--samples", type=int, default=300)
    a = p.parse_args()
    print(json.dumps(run(a.home, a.sandboxes, a.execs, a.samples), indent=2))


if __name__ == "__main__":
    main()
