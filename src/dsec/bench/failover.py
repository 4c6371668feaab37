"""Issue 13 benchmark: the scheduler leader dies mid-burst (``dsec bench failover``).

A real ``redis-server``, a one-node local Ray cluster (a real node agent, runc) and two
``dsec serve --cluster ... --state redis://...`` processes. Two clients (one given
``[A, B]``, the other ``[B, A]``) send ``n`` creates with request ids; A, the leader, is
killed -9 once a quarter of them are answered. Reported:

* ``no_placement_s``: the longest time between two consecutive sandbox creations on the
  node (the sandboxes' own ``created_at``): how long nothing was placed (target <= 5 s);
* ``takeover_s``: A's last lease renewal -> B's election (B's ``GET /v1/scheduler``);
* exactly once: request ids answered, distinct sandbox ids, sandboxes on the node.

The e2e test ``tests/e2e/test_state_redis.py::test_leader_killed_mid_burst_every_create_once``
runs the same pieces (``leader_pair``, ``burst``) and asserts on them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

BURST_SPEC: dict[str, Any] = {"cpu": 0.01, "memory": "16M", "disk": "16M", "labels": {"run": "burst"}}


class Pair(BaseModel):
    a_url: str
    b_url: str
    a_pid: int
    token: str = Field(..., description="The admin token both servers accept (one tenant record)")
    cgroup_parent: str = Field(..., description="The node's cgroup parent (leak checks)")


class BurstReport(BaseModel):
    n: int
    took_s: float
    killed_after: int
    got: dict[str, str] = Field(..., description="request id -> sandbox id")
    created_at: list[float] = Field(..., description="node creation times of the tenant's sandboxes")
    on_node: list[str] = Field(..., description="the tenant's sandboxes the node holds after the burst")
    no_placement_s: float
    leader_before: dict[str, Any]
    leader_after: dict[str, Any]


async def _flush(url: str) -> None:
    from dsec.state.redis_store import RedisStateStore

    st = RedisStateStore(url)
    await st._r.flushdb()
    await st.close()


@contextlib.contextmanager
def leader_pair(base: Path, redis_url: str) -> Iterator[Pair]:
    """Cluster + two API servers on ``redis_url`` (flushed first); A starts first and leads."""
    from dsec.api.launch import start_serve
    from dsec.cluster import local

    asyncio.run(_flush(redis_url))
    c = local.up(base / "c", 1, ["busybox"], log=lambda _m: None)
    env = {"DSEC_CLUSTER": c.address, "DSEC_STATE_URL": redis_url, **local.shared_env(c),
           # the box's own load must not refuse the burst (not what this measures)
           "DSEC_OVERCOMMIT_THRESHOLD": "100"}
    procs: list[Any] = []
    try:
        procs.append(start_serve(base / "a", env, timeout=180))
        (base / "b").mkdir(parents=True, exist_ok=True)
        shutil.copy(base / "a" / "token", base / "b" / "token")  # one admin tenant, one token
        procs.append(start_serve(base / "b", env, timeout=180))
        yield Pair(a_url=procs[0].url, b_url=procs[1].url, a_pid=procs[0].proc.pid, token=procs[0].token,
                   cgroup_parent=c.nodes[0].cgroup_parent)
    finally:
        for sp in procs:
            if sp.proc.poll() is None:
                sp.proc.send_signal(signal.SIGTERM)
                sp.proc.wait(60)
        local.down(base / "c", log=lambda _m: None)


def scheduler_view(url: str, token: str) -> dict[str, Any]:
    import httpx

    r = httpx.get(f"{url}/v1/scheduler", headers={"authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def new_tenant(url: str, admin_token: str, name: str) -> str:
    import httpx

    r = httpx.post(f"{url}/v1/tenants", json={"name": name}, headers={"authorization": f"Bearer {admin_token}"},
                   timeout=30)
    r.raise_for_status()
    return str(r.json()["token"])


def no_placement_gap(created_at: list[float]) -> float:
    """The longest pause between two consecutive creations."""
    made = sorted(created_at)
    return max((y - x for x, y in itertools.pairwise(made)), default=0.0)


def burst(pair: Pair, token: str, n: int, workers: int = 8) -> BurstReport:
    """``n`` creates (request ids burst-<i>) from two clients; A killed -9 after n/4 answers."""
    import dsec
    from dsec.models import SandboxSpec

    before = scheduler_view(pair.b_url, pair.token)
    got: dict[str, str] = {}
    lock = threading.Lock()
    killed = threading.Event()
    kill_after = max(1, n // 4)
    clients = [dsec.Client(url=[pair.a_url, pair.b_url], token=token, retries=12, timeout=60),
               dsec.Client(url=[pair.b_url, pair.a_url], token=token, retries=12, timeout=60)]

    def create(i: int) -> None:
        rid = f"burst-{i}"
        sid = clients[i % 2].create(SandboxSpec(image="busybox", request_id=rid, **BURST_SPEC)).id
        with lock:
            got[rid] = sid
            if len(got) >= kill_after and not killed.is_set():
                os.kill(pair.a_pid, signal.SIGKILL)  # the leader dies with creates in flight
                killed.set()

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(create, i) for i in range(n)]:
                f.result(timeout=300)
    finally:
        for cl in clients:
            cl.close()
    took = time.monotonic() - t0
    with dsec.Client(url=pair.b_url, token=token, timeout=60) as cb:
        listed = cb.list(labels={"run": "burst"})
    created = [s.created_at for s in listed]
    return BurstReport(n=n, took_s=round(took, 2), killed_after=kill_after, got=got, created_at=created,
                       on_node=sorted(s.id for s in listed), no_placement_s=round(no_placement_gap(created), 3),
                       leader_before=before["leadership"] or {}, leader_after=scheduler_view(pair.b_url, pair.token)
                       ["leadership"] or {})


def live_inits(cgroup_parent: str, ids: set[str]) -> list[str]:
    """Which of ``ids`` still have a process in the node's cgroups."""
    out = set()
    for d in Path("/sys/fs/cgroup").glob(f"*/{cgroup_parent}/sb-*"):
        if d.name in ids:
            with contextlib.suppress(OSError):
                if (d / "cgroup.procs").read_text().strip():
                    out.add(d.name)
    return sorted(out)


def run(n: int = 200) -> dict[str, Any]:
    import dsec
    from dsec.config import Settings
    from dsec.testing.redis_server import redis_server

    with redis_server() as rs, tempfile.TemporaryDirectory(prefix="dsec-failover-") as d, \
            leader_pair(Path(d), f"{rs.url.rsplit('/', 1)[0]}/3") as pair:
        token = new_tenant(pair.b_url, pair.token, "burst")
        rep = burst(pair, token, n)
        with dsec.Client(url=pair.b_url, token=token, timeout=120) as cb:
            killed = cb.kill_by_labels({"run": "burst"})
        ids = set(rep.got.values())
        deadline = time.monotonic() + 30
        while (left := live_inits(pair.cgroup_parent, ids)) and time.monotonic() < deadline:
            time.sleep(0.5)
    return {"creates": n, "clients": 2, "leader_killed_after": rep.killed_after, "took_s": rep.took_s,
            "no_placement_s": rep.no_placement_s, "takeover_s": rep.leader_after.get("last_takeover_s"),
            "lease_ttl_s": Settings().scheduler_lease_ttl_s, "fencing_token": [rep.leader_before.get("token"), rep.leader_after.get("token")],
            "request_ids_answered": len(rep.got), "distinct_sandboxes": len(ids),
            "sandboxes_on_node": len(rep.on_node), "killed": len(killed), "left_running_after_kill": len(left),
            "target_no_placement_s": 5.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=200, help="creates in the burst")
    print(json.dumps(run(ap.parse_args().n), indent=2))


if __name__ == "__main__":
    main()
