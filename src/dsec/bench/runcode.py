"""``dsec bench runcode``: SandboxFusion ``/run_code`` throughput vs its baselines, in one run.

The same small python program is run ``calls`` times at ``concurrency`` (64: verl's
default) three ways, side by side:

- ``bare``: ``/usr/bin/python3 -c CODE`` subprocesses, no isolation (the physical floor),
  run before and after ``dsec`` (the ratio uses their mean: the load of a shared box drifts);
- ``dsec``: ``POST <fusion_url>/run_code`` against a real ``dsec serve`` (pooled sandboxes,
  each call isolated by ``sb.reset()``);
- ``podman``: ``podman run --rm`` of the same python rootfs per call (runc,
  ``--ulimit nofile/nproc=1024``).

Also ``sb.reset()``'s median through the SDK on one sandbox. Targets: dsec >= 0.5x bare,
>= 5x podman; reset median <= 5 ms.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

CODE = "import sys\nprint(sum(i * i for i in range(1000)), sys.version_info[0])"
EXPECT = f"{sum(i * i for i in range(1000))} 3\n"
PODMAN_IMAGE = "localhost/dsec-bench-python:latest"
PODMAN_ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def _drive(n: int, concurrency: int, one: Callable[[], Awaitable[str]]) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    bad = 0

    async def call() -> None:
        nonlocal bad
        async with sem:
            t0 = time.perf_counter()
            out = await one()
            lat.append(time.perf_counter() - t0)
            if out != EXPECT:
                bad += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(call() for _ in range(n)))
    wall = time.perf_counter() - t0
    return {"calls": n, "concurrency": concurrency, "wall_s": round(wall, 3), "per_s": round(n / wall, 1),
            "p50_ms": round(_pct(lat, 0.5) * 1000, 1), "p99_ms": round(_pct(lat, 0.99) * 1000, 1),
            "wrong_output": bad}


async def _subprocess(argv: list[str]) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out, _ = await proc.communicate()
    return out.decode()


def _podman_image(rootfs_tar: Path) -> None:
    have = subprocess.run(["podman", "image", "exists", PODMAN_IMAGE], check=False).returncode == 0
    if not have:
        subprocess.run(["podman", "import", str(rootfs_tar), PODMAN_IMAGE], check=True, capture_output=True)


async def _dsec(fusion_url: str, n: int, concurrency: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        async def one() -> str:
            r = await c.post(fusion_url + "/run_code", json={"code": CODE, "language": "python"})
            body = r.json()
            return (body.get("run_result") or {}).get("stdout") or body.get("message", "")
        await _drive(min(n, concurrency * 2), concurrency, one)  # fill the pool first (creates)
        return await _drive(n, concurrency, one)


def _reset_median(url: str, token: str, rounds: int) -> dict[str, Any]:
    from dsec.sdk import Client, Sandbox

    with Client(url, token) as c, Sandbox.create(image="busybox", cpu=0.5, memory="128M", client=c) as sb:
        times = []
        for i in range(rounds):
            sb.exec(f"echo {i} > /tmp/f; (sleep 100 &)")
            t0 = time.perf_counter()
            sb.reset()
            times.append(time.perf_counter() - t0)
    return {"rounds": rounds, "median_ms": round(statistics.median(times) * 1000, 2),
            "p90_ms": round(_pct(times, 0.9) * 1000, 2), "target_ms": 5.0}


def run(calls: int = 512, concurrency: int = 64, podman_calls: int = 64, reset_rounds: int = 200,
        home: Path | None = None, progress: Callable[[str], None] = print) -> dict[str, Any]:
    from dsec.api.launch import reap_home, start_serve
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock, python_rootfs

    tmp = None
    if home is None:
        tmp = tempfile.mkdtemp(prefix="dsec-bench-runcode-")
        home = Path(tmp)
    settings = Settings(home=home)
    store = ImageStore(home / "images", settings)
    progress("ensuring the busybox and python images")
    ensure_stock(store, only=["busybox", "python"], log=lambda _: None)
    report: dict[str, Any] = {"program": CODE, "host_cpus": __import__("os").cpu_count()}

    progress(f"bare python3: {calls} calls at concurrency {concurrency}")
    report["bare"] = asyncio.run(_drive(calls, concurrency, lambda: _subprocess(["/usr/bin/python3", "-c", CODE])))

    srv = start_serve(home, {"DSEC_FUSION_POOL_MAX": str(concurrency)}, log_name="bench-serve.log")
    try:
        fusion_url = json.loads((home / "server.json").read_text())["fusion_url"]
        progress(f"sb.reset(): {reset_rounds} rounds")
        report["reset"] = _reset_median(srv.url, srv.token, reset_rounds)
        progress(f"dsec /run_code: {calls} calls at concurrency {concurrency}")
        report["dsec"] = asyncio.run(_dsec(fusion_url, calls, concurrency))
        # Bare again right after: on a shared box the load drifts; the ratio uses the mean.
        progress(f"bare python3 again: {calls} calls at concurrency {concurrency}")
        report["bare_after"] = asyncio.run(_drive(calls, concurrency,
                                                  lambda: _subprocess(["/usr/bin/python3", "-c", CODE])))
        import httpx

        report["dsec"]["pools"] = httpx.get(srv.url + "/v1/fusion", headers={
            "authorization": f"Bearer {srv.token}"}).json()["pools"]
    finally:
        srv.stop()
        reap_home(home)
    return _finish(report, store, python_rootfs, calls, concurrency, podman_calls, progress, tmp)


def _finish(report: dict[str, Any], store: Any, python_rootfs: Any, calls: int, concurrency: int,
            podman_calls: int, progress: Callable[[str], None], tmp: str | None) -> dict[str, Any]:
    if shutil.which("podman") and podman_calls > 0:
        tar, _ = python_rootfs(store, lambda _: None)
        progress("importing the python rootfs into podman")
        _podman_image(tar)
        argv = ["podman", "run", "--rm", "--network=none", *PODMAN_ULIMITS, PODMAN_IMAGE, "python3", "-c", CODE]
        progress(f"podman run --rm: {podman_calls} calls at concurrency {concurrency}")
        report["podman"] = asyncio.run(_drive(podman_calls, concurrency, lambda: _subprocess(argv)))
    else:
        report["podman"] = None
    d, p = report["dsec"]["per_s"], (report["podman"] or {}).get("per_s")
    b = (report["bare"]["per_s"] + report["bare_after"]["per_s"]) / 2
    report["ratios"] = {"dsec_vs_bare": round(d / b, 2), "target_vs_bare": 0.5,
                        "dsec_vs_podman": round(d / p, 1) if p else None, "target_vs_podman": 5.0}
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return report
