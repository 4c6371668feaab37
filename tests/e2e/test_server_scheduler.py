"""`dsec serve` places creates through the control-plane scheduler: warm-pool hand-over
is the common path, a burst is absorbed without 5xx inside the overcommit bound, a create
that finds no room is withdrawn with 429 + Retry-After, and clients can see where their
request is. Real server process, real runc sandboxes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_server import Server, running_server

pytestmark = pytest.mark.integration

SMALL = {"image": "busybox", "cpu": 0.5, "memory": "64M", "disk": "64M", "timeout": 300}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "dsec-sched", {"DSEC_API_CREATE_WAIT_S": "3"}) as s:
        yield s


def _auth(s: Server) -> dict[str, str]:
    return {"authorization": f"Bearer {s.token}"}


def _state(c: httpx.Client) -> dict:
    return c.get("/v1/scheduler").json()


def test_warm_pool_is_the_common_path(srv: Server) -> None:
    """After demand for a shape was seen, the pool pre-creates members and the next creates
    of that shape are hand-overs (counted by the scheduler), whose TTL starts at hand-over
    and which run commands like any sandbox."""
    with httpx.Client(base_url=srv.url, headers=_auth(srv), timeout=60) as c:
        first = [c.post("/v1/sandboxes", json=SMALL).json()["id"] for _ in range(3)]
        for sid in first:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204
        for _ in range(200):
            if sum(n["warm"] for n in _state(c)["nodes"]) >= 1:
                break
            asyncio.run(asyncio.sleep(0.05))
        hits0 = _state(c)["stats"]["warm_hits"]
        sb = c.post("/v1/sandboxes", json={**SMALL, "labels": {"who": "warm"}}).json()
        assert _state(c)["stats"]["warm_hits"] == hits0 + 1
        assert sb["labels"] == {"who": "warm"} and sb["started_at"] is not None
        r = c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "echo warm"}).json()
        assert r["exit_code"] == 0 and r["stdout"] == "warm\n"
        assert c.delete(f"/v1/sandboxes/{sb['id']}").status_code == 204


def test_burst_absorbed_within_overcommit_bound(srv: Server) -> None:
    """40 creates at once on a node that holds ~20 of them: every answer is 201 or 429
    (never 5xx), every 429 carries Retry-After, the allocation never passes the bound, and
    each 201 sandbox is real."""

    async def burst() -> tuple[list[httpx.Response], float]:
        peak = 0.0
        done = asyncio.Event()
        async with httpx.AsyncClient(base_url=srv.url, headers=_auth(srv), timeout=120) as c:
            async def watch() -> None:
                nonlocal peak
                while not done.is_set():
                    for n in (await c.get("/v1/scheduler")).json()["nodes"]:
                        peak = max(peak, n["cpu_allocated"] / n["cpu_bound"])
                    await asyncio.sleep(0.02)

            w = asyncio.create_task(watch())
            answers = await asyncio.gather(*(c.post("/v1/sandboxes", json={**SMALL, "request_id": f"b{i}"})
                                             for i in range(40)))
            done.set()
            await w
        return list(answers), peak

    answers, peak = asyncio.run(burst())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {201, 429}, codes
    assert codes.count(201) >= 5 and peak <= 1.0
    assert all(float(r.headers["retry-after"]) > 0 for r in answers if r.status_code == 429)
    with httpx.Client(base_url=srv.url, headers=_auth(srv), timeout=60) as c:
        live = c.get("/v1/sandboxes").json()
        assert len(live) == codes.count(201)
        # A withdrawn request is forgotten: its id can be submitted again later.
        refused = next((i for i, r in enumerate(answers) if r.status_code == 429), None)
        for sb in live:
            c.delete(f"/v1/sandboxes/{sb['id']}")
        if refused is not None:
            again = c.post("/v1/sandboxes", json={**SMALL, "request_id": f"b{refused}"})
            assert again.status_code == 201
            c.delete(f"/v1/sandboxes/{again.json()['id']}")


def test_request_status_and_unplaceable_request(srv: Server) -> None:
    """A finished request reports its sandbox; an unknown request id is 404 naming it; a
    request no node can ever hold is refused at submit (4xx naming the limit), not queued."""
    with httpx.Client(base_url=srv.url, headers=_auth(srv), timeout=60) as c:
        sb = c.post("/v1/sandboxes", json={**SMALL, "request_id": "status-1"}).json()
        st = c.get("/v1/requests/status-1").json()
        assert st["state"] == "created" and st["sandbox_id"] == sb["id"]
        missing = c.get("/v1/requests/nope-1")
        assert missing.status_code == 404 and "nope-1" in missing.json()["message"]
        huge = c.post("/v1/sandboxes", json={**SMALL, "cpu": 4096})
        assert 400 <= huge.status_code < 500 and "cpu" in huge.text
        c.delete(f"/v1/sandboxes/{sb['id']}")


def test_scheduler_state_is_admin_only(srv: Server, tmp_path: Path) -> None:
    """Node allocation is operator information: a plain tenant gets 403."""
    with httpx.Client(base_url=srv.url, headers=_auth(srv), timeout=60) as c:
        token = c.post("/v1/tenants", json={"name": "plain-sched"}).json()["token"]
    r = httpx.get(f"{srv.url}/v1/scheduler", headers={"authorization": f"Bearer {token}"})
    assert r.status_code == 403


def test_declared_pool_is_built_and_handed_out(srv: Server) -> None:
    """An operator declares a warm pool for a shape: it is built before any demand, shows
    in GET /v1/pools, the next create of the shape is a hand-over, and size 0 removes it;
    an unknown image is 404 naming it."""
    shape = {**SMALL, "cpu": 0.25, "memory": "48M"}
    with httpx.Client(base_url=srv.url, headers=_auth(srv), timeout=60) as c:
        r = c.put("/v1/pools", json={"spec": shape, "size": 2})
        assert r.status_code == 200 and r.json()["pools"][0]["floor"] == 2
        for _ in range(300):
            mine = [p for p in c.get("/v1/pools").json()["pools"] if p["memory"] == 48 << 20]
            if mine and mine[0]["ready"] >= 2:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert mine[0]["ready"] >= 2 and mine[0]["cpu"] == 0.25
        hits0 = _state(c)["stats"]["warm_hits"]
        sb = c.post("/v1/sandboxes", json=shape).json()
        assert _state(c)["stats"]["warm_hits"] == hits0 + 1
        c.delete(f"/v1/sandboxes/{sb['id']}")
        assert c.put("/v1/pools", json={"spec": shape, "size": 0}).json()["pools"][0]["floor"] == 0
        missing = c.put("/v1/pools", json={"spec": {**shape, "image": "no-such-image:1"}, "size": 1})
        assert missing.status_code == 404 and "no-such-image" in missing.text


@pytest.fixture(scope="module")
def small_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose node offers 4G of memory: two 3G sandboxes cannot both run."""
    with running_server(tmp_path_factory, "dsec-preempt", {"DSEC_NODE_MEMORY": "4G", "DSEC_API_CREATE_WAIT_S": "20"}) as s:
        yield s


def test_preemption_checkpoints_victim_and_resumes_it_under_the_same_id(small_node: Server) -> None:
    """A high-priority create on a full node preempts the low-priority sandbox: its files
    are checkpointed first, operations on it answer 503 + Retry-After (nothing runs), and
    when capacity returns it comes back under the same id with its files intact."""
    big = {"image": "busybox", "memory": "3G", "cpu": 0.5, "timeout": 300}
    with httpx.Client(base_url=small_node.url, headers=_auth(small_node), timeout=120) as c:
        low = c.post("/v1/sandboxes", json={**big, "priority": "low"}).json()
        c.put(f"/v1/sandboxes/{low['id']}/files", params={"path": "/work/state.txt"}, content=b"step 7\n")
        high = c.post("/v1/sandboxes", json={**big, "priority": "high"})
        assert high.status_code == 201, high.text
        r = c.post(f"/v1/sandboxes/{low['id']}/exec", json={"cmd": "echo hi"})
        assert r.status_code == 503 and "preempted" in r.json()["message"] and float(r.headers["retry-after"]) > 0
        assert _state(c)["stats"]["preemptions"] == 1
        assert c.delete(f"/v1/sandboxes/{high.json()['id']}").status_code == 204
        for _ in range(300):
            r = c.post(f"/v1/sandboxes/{low['id']}/exec", json={"cmd": "cat /work/state.txt"})
            if r.status_code == 200:
                break
            asyncio.run(asyncio.sleep(0.1))
        assert r.status_code == 200 and r.json()["stdout"] == "step 7\n"
        assert c.delete(f"/v1/sandboxes/{low['id']}").status_code == 204


@pytest.fixture(scope="module")
def leasy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with a short lease window (0.5 s heartbeats, reaped after 4 misses: 2 s, so
    a stalled server on a loaded box does not reap a renewed lease)."""
    with running_server(tmp_path_factory, "dsec-lease", {"DSEC_HEARTBEAT_INTERVAL_S": "0.5", "DSEC_HEARTBEAT_MISSES": "4",
                                                         "DSEC_REAPER_INTERVAL_S": "0.1"}) as s:
        yield s


def test_lease_keeps_sandboxes_alive_and_release_kills_them(leasy: Server) -> None:
    """Inside a dsec.Lease the owner's sandbox outlives several reap windows; leaving the
    block releases the lease and kills the owner's sandboxes at once."""
    import time

    import dsec

    with dsec.Client(url=leasy.url, token=leasy.token) as client:
        with dsec.Lease("run-live", client=client) as lease:
            sb = dsec.Sandbox.create(image="busybox", cpu=0.25, memory="32M", owner="run-live", client=client)
            time.sleep(4.5)  # two reap windows and more
            assert sb.exec("echo alive").stdout == "alive\n"
        assert lease.released == [sb.id]
        assert all(s.id != sb.id for s in dsec.Sandbox.list(client=client))


def test_silent_owner_is_reaped_and_audited(leasy: Server) -> None:
    """A trainer that stops renewing (crashed) loses its sandboxes after the window; the
    sandbox's audit log says why."""
    with httpx.Client(base_url=leasy.url, headers=_auth(leasy), timeout=60) as c:
        assert c.post("/v1/leases/run-dead/heartbeat").json()["reap_after_s"] == 2.0
        sb = c.post("/v1/sandboxes", json={**SMALL, "owner": "run-dead"}).json()
        other = c.post("/v1/sandboxes", json=SMALL).json()  # no owner: only its TTL applies
        for _ in range(100):
            if all(s["id"] != sb["id"] for s in c.get("/v1/sandboxes").json()):
                break
            asyncio.run(asyncio.sleep(0.1))
        ids = {s["id"] for s in c.get("/v1/sandboxes").json()}
        assert sb["id"] not in ids and other["id"] in ids
        audit = c.get(f"/v1/sandboxes/{sb['id']}/audit").json()
        assert {"kind": "reaped", "reason": "reaped: lease_expired"} in [
            {"kind": e["kind"], "reason": e["data"].get("reason")} for e in audit], audit
        c.delete(f"/v1/sandboxes/{other['id']}")


def test_cli_pool_and_sched(srv: Server) -> None:
    """`dsec pool set/ls` and `dsec sched` drive and show the same state as the API."""
    import json

    def run(*args: str) -> str:
        return srv.cli(*args).stdout

    table = run("pool", "set", "busybox", "--size", "1", "--cpu", "0.25", "--memory", "40M")
    assert "busybox" in table and "40M" in table
    pools = json.loads(run("pool", "ls", "--json"))
    assert any(p["memory"] == 40 << 20 and p["floor"] == 1 for p in pools)
    st = json.loads(run("sched", "--json"))
    assert st["nodes"] and "warm_hits" in st["stats"]
    assert "CPU ALLOC/BOUND" in run("sched")
    run("pool", "set", "busybox", "--size", "0", "--cpu", "0.25", "--memory", "40M")


def test_scheduler_metrics_are_exported(srv: Server) -> None:
    """/metrics carries the scheduler's queue depth, counters and per-node allocation vs
    the overcommit bound (labels: node ids and fixed counter names only)."""
    text = httpx.get(f"{srv.url}/metrics", headers=_auth(srv), timeout=60).text
    assert "dsec_scheduler_queue_depth " in text
    assert 'dsec_scheduler_events_total{event="warm_hits"}' in text
    assert "dsec_node_cpu_allocated_ratio{node=" in text and "dsec_node_warm_sandboxes{node=" in text
