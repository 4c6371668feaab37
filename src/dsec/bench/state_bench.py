"""Issue 13 benchmark: the state store on the create path, Redis vs SQLite, in one run.

    python -m dsec.bench.state_bench [--n 40] [--ops 500]

1. State operations of one create (what SandboxService does: reserve the request id,
   record the sandbox, complete the request id), in-process, each store: added latency.
2. create -> first exec through a real ``dsec serve`` on each store (both servers up at
   once, requests alternated so both see the same machine load): medians and their ratio
   (target: Redis <= 1.3x SQLite).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.state import IdempotencyRecord, SqliteStateStore, StateStore
from dsec.state.keys import new_tenant_uid
from dsec.state.redis_store import RedisStateStore
from dsec.testing.redis_server import redis_server


async def _state_ops(store: StateStore, n: int) -> list[float]:
    await store.open()
    uid, out = new_tenant_uid(), []
    for i in range(n):
        t0 = time.perf_counter()
        rec = await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id=f"b{i}", sandbox_id=f"sb{i}",
                                                         created_at=time.time()))
        await store.record_sandbox(rec.sandbox_id, uid, time.time())
        await store.idem_complete(uid, f"b{i}", {"id": rec.sandbox_id, "state": "idle"})
        out.append(time.perf_counter() - t0)
    await store.close()
    return out


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3), "p90_ms": round(xs[int(len(xs) * 0.9)] * 1e3, 3)}


def _create_exec(url: str, token: str, n: int) -> list[float]:
    import dsec
    from dsec.models import SandboxSpec
    out = []
    with dsec.Client(url=url, token=token) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            info = c.create(SandboxSpec(image="busybox"))
            sb = dsec.Sandbox.connect(info.id, client=c)
            sb.exec("true")
            out.append(time.perf_counter() - t0)
            c.kill(info.id)
    return out


def run(n: int, ops: int) -> dict[str, Any]:
    from dsec.api.launch import start_serve
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    report: dict[str, Any] = {}
    with redis_server() as rs, tempfile.TemporaryDirectory(prefix="dsec-sbench-") as d:
        work = Path(d)
        report["state_ops_per_create"] = {
            "sqlite": _ms(asyncio.run(_state_ops(SqliteStateStore(work / "ops.db"), ops))),
            "redis": _ms(asyncio.run(_state_ops(RedisStateStore(rs.url, prefix="bench:"), ops))),
        }
        servers = {}
        try:
            for i, kind in enumerate(("sqlite", "redis")):
                home = work / kind
                ensure_stock(ImageStore(home / "images", Settings(home=home)), only=["busybox"], log=lambda _: None)
                env = {"DSEC_NODE_ID": f"m{i}", "DSEC_CGROUP_PARENT": f"dsec-m{i}", "DSEC_NET_CIDR": f"10.{231 + i}.0.0/16"}
                if kind == "redis":
                    env["DSEC_STATE_URL"] = rs.url
                servers[kind] = start_serve(home, env, log_name="bench.log")
            series: dict[str, list[float]] = {"sqlite": [], "redis": []}
            for kind in series:  # warm-up (image cache, pools)
                _create_exec(servers[kind].url, servers[kind].token, 3)
            for _ in range(n):  # alternate: both stores see the same load
                for kind in series:
                    series[kind] += _create_exec(servers[kind].url, servers[kind].token, 1)
        finally:
            for sp in servers.values():
                if sp.proc.poll() is None:
                    sp.proc.send_signal(signal.SIGTERM)
                    sp.proc.wait(60)
            shutil.rmtree(work, ignore_errors=True)
        s, r = _ms(series["sqlite"]), _ms(series["redis"])
        report["create_to_first_exec"] = {"sqlite": s, "redis": r, "n": n,
                                          "ratio_median": round(r["median_ms"] / s["median_ms"], 3),
                                          "added_ms_median": round(r["median_ms"] - s["median_ms"], 3)}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=40, help="create->exec pairs per store")
    ap.add_argument("--ops", type=int, default=500, help="in-process state-op rounds per store")
    a = ap.parse_args()
    print(json.dumps(run(a.n, a.ops), indent=2))


if __name__ == "__main__":
    main()
