"""API/SDK benchmark: what the HTTP service layer adds, and how it holds up under load.

1. Baseline, same run, same machine: the node-local exec path (``LocalNodeAgent.exec``
   in-process, no HTTP) — median/p99 of ``true``.
2. The same exec through the SDK over HTTP to a real ``dsec serve`` process (async and
   sync clients): median/p99 and the *added* median vs 1.
3. One asyncio client drives ``sandboxes`` concurrent sandboxes x ``execs`` execs each:
   throughput and p50/p99, while a separate process probes ``GET /health`` every
   ``probe_interval_s`` (its p99 shows whether the server stays responsive).

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SPEC = {"image": "busybox", "cpu": 0.01, "memory": "32M", "timeout": 3600}


def _stats(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    if not ms:
        return {"n": 0}
    pick = lambda q: ms[min(len(ms) - 1, int(len(ms) * q))]  # noqa: E731
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p99_ms": round(pick(0.99), 3),
            "mean_ms": round(statistics.fmean(ms), 3), "max_ms": round(ms[-1], 3)}


async def _node_local(home: Path, samples: int, warmup: int) -> dict[str, Any]:
    from dsec.config import Settings
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.node.agent import LocalNodeAgent

    node = LocalNodeAgent(Settings(home=home))
    await node.start()
    try:
        info = await node.create(SandboxSpec(**SPEC))  # type: ignore[arg-type]
        try:
            req = ExecRequest(cmd=["true"])
            out = []
            for i in range(warmup + samples):
                t0 = time.perf_counter()
                r = await node.exec(info.id, req)
                if i >= warmup:
                    out.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r
            return _stats(out)
        finally:
            await node.destroy(info.id)
    finally:
        await node.close()


def _probe(url: str, interval: float, stop: Any, q: Any) -> None:
    import httpx

    lat: list[float] = []
    errors = 0
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                c.get("/health").raise_for_status()
                lat.append(time.perf_counter() - t0)
            except httpx.HTTPError:
                errors += 1
            time.sleep(interval)
    q.put({"latencies": lat, "errors": errors})


async def _sdk(url: str, token: str, samples: int, warmup: int, sandboxes: int, execs: int,
               probe_interval: float) -> dict[str, Any]:
    from dsec.models import ExecRequest, SandboxSpec
    from dsec.sdk import AsyncClient, Client

    res: dict[str, Any] = {}
    async with AsyncClient(url, token) as c:
        info = await c.create(SandboxSpec(**SPEC))  # type: ignore[arg-type]
        req = ExecRequest(cmd=["true"])
        out = []
        for i in range(warmup + samples):
            t0 = time.perf_counter()
            r = await c.exec(info.id, req)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
            assert r.exit_code == 0, r
        res["sdk_async_exec"] = _stats(out)

        def sync_samples() -> list[float]:
            with Client(url, token) as sc:
                o = []
                for i in range(warmup + samples):
                    t0 = time.perf_counter()
                    sc.exec(info.id, req)
                    if i >= warmup:
                        o.append(time.perf_counter() - t0)
                return o
        res["sdk_sync_exec"] = _stats(await asyncio.to_thread(sync_samples))
        await c.kill(info.id)

        # --- load: N sandboxes x M execs from this one client, /health probed elsewhere ---
        ctx = mp.get_context("spawn")
        stop, q = ctx.Event(), ctx.Queue()
        prober = ctx.Process(target=_probe, args=(url, probe_interval, stop, q), daemon=True)
        prober.start()
        label = {"bench": f"api-{os.getpid()}"}
        t0 = time.perf_counter()
        create_lat: list[float] = []

        async def create_one() -> str:
            s = time.perf_counter()
            i = await c.create(SandboxSpec(**SPEC, labels=label))  # type: ignore[arg-type]
            create_lat.append(time.perf_counter() - s)
            return i.id

        ids = await asyncio.gather(*(create_one() for _ in range(sandboxes)))
        create_wall = time.perf_counter() - t0
        lat: list[float] = []
        failures = 0

        async def drive(sid: str) -> None:
            nonlocal failures
            for k in range(execs):
                s = time.perf_counter()
                r = await c.exec(sid, ExecRequest(cmd=["echo", str(k)]))
                lat.append(time.perf_counter() - s)
                failures += r.exit_code != 0 or r.stdout != f"{k}\n"

        t1 = time.perf_counter()
        await asyncio.gather(*(drive(s) for s in ids))
        exec_wall = time.perf_counter() - t1
        stop.set()
        probe = await asyncio.to_thread(q.get, True, 30)
        prober.join(10)
        killed = await c.kill_by_labels(label)
        res["load"] = {
            "sandboxes": sandboxes, "execs_per_sandbox": execs, "creates": _stats(create_lat),
            "create_wall_s": round(create_wall, 3), "creates_per_s": round(sandboxes / create_wall, 1),
            "exec": _stats(lat), "exec_wall_s": round(exec_wall, 3),
            "execs_per_s": round(len(lat) / exec_wall, 1), "exec_failures": failures,
            "health_during_load": _stats(probe["latencies"]) | {"errors": probe["errors"]},
            "killed": len(killed),
        }
    return res


def _start_server(home: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
    env["DSEC_HOME"] = str(home)
    (home / "server.json").unlink(missing_ok=True)
    log = open(home / "bench-serve.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen([str(Path(sys.executable).parent / "dsec"), "serve", "--port", "0", "--log-level",
                             "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dsec serve exited {proc.returncode}; see {home / 'bench-serve.log'}")
        try:
            info = json.loads((home / "server.json").read_text())
            if info.get("pid") == proc.pid:
                return proc, info["url"], (home / "token").read_text().strip()
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("dsec serve did not start in 120 s")


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
        result: dict[str, Any] = {"node_local_exec": uvloop.run(_node_local(home, samples, warmup))}
        proc, url, token = _start_server(home)
        try:
            result |= uvloop.run(_sdk(url, token, samples, warmup, sandboxes, execs, probe_interval_s))
        finally:
            proc.terminate()
            proc.wait(60)
        base = result["node_local_exec"]["median_ms"]
        result["added_median_ms"] = {"sdk_async": round(result["sdk_async_exec"]["median_ms"] - base, 3),
                                     "sdk_sync": round(result["sdk_sync_exec"]["median_ms"] - base, 3)}
        result["ratio_median"] = {"sdk_async": round(result["sdk_async_exec"]["median_ms"] / base, 2),
                                  "sdk_sync": round(result["sdk_sync_exec"]["median_ms"] / base, 2)}
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
