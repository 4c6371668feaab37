"""Issue 13 end to end: shared state on a real redis-server.

* Episode ownership race: two servers (two engines, their own sandboxes, one checkpoint
  store, one state store) open the same episode at the same moment: exactly one of them
  may write it, the other is fenced, on both state stores.
* One fenced scheduler leader: a real one-node Ray cluster and two ``dsec serve --cluster
  ... --state redis://...`` processes; 200 creates from two clients with request ids, the
  leader killed -9 mid-burst: every create succeeds exactly once (no duplicate on the
  node), the other server leads with a higher fencing token, placements stop <= 5 s, and
  nothing runs after the kill (the pieces are dsec.bench.failover's).
* Redis lost while a server runs: 503 + Retry-After naming the store, then recovery.
* Redis unreachable at start / a store of another schema version: serve refuses to start
  and says why.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_server import DSEC, Server, ensure_images, start_server

from dsec import errors
from dsec.blobs import LocalBlobStore
from dsec.checkpoints.dirhost import DirHost, make_busybox_rootfs
from dsec.checkpoints.engine import EpisodeEngine
from dsec.config import load_settings
from dsec.models import ExecRequest, SandboxSpec
from dsec.node import syscalls
from dsec.state import SqliteStateStore, StateStore
from dsec.state.keys import episode_key, new_tenant_uid
from dsec.state.redis_store import RedisStateStore
from dsec.testing.redis_server import RedisServer, redis_server


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    """A real redis-server (free loopback port, own temp dir, stopped by PID)."""
    with redis_server() as srv:
        yield srv


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for mp in syscalls.mounts_under(str(tmp_path)):
        try:
            syscalls.umount(mp)
        except OSError:
            pass


@pytest.fixture(params=["sqlite", "redis"])
async def two_states(request, tmp_path: Path) -> AsyncIterator[tuple[StateStore, StateStore]]:
    """What two API servers on one state would hold: two store objects on one SQLite file
    or on one Redis (same key prefix)."""
    if request.param == "sqlite":
        a, b = SqliteStateStore(tmp_path / "state.db"), SqliteStateStore(tmp_path / "state.db")
    else:
        srv = request.getfixturevalue("redis_srv")
        prefix = f"e{uuid.uuid4().hex[:8]}:"
        a, b = RedisStateStore(srv.url, prefix=prefix), RedisStateStore(srv.url, prefix=prefix)
    await a.open()
    await b.open()
    yield a, b
    await a.close()
    await b.close()


def _engine(work: Path, name: str, state: StateStore | None) -> EpisodeEngine:
    img = make_busybox_rootfs(work / "img")
    s = load_settings(home=work / f"home-{name}")
    store = LocalBlobStore(work / "ckpt")  # one checkpoint store for both servers
    return EpisodeEngine(s, store, DirHost(work / f"sbx-{name}", {"bb": img}), cache_dir=work / f"lc-{name}",
                         state=state)


@pytest.mark.integration
async def test_concurrent_openers_exactly_one_wins(work: Path, two_states: tuple[StateStore, StateStore]) -> None:
    """Two servers open one episode and take its first step at the same moment (several
    rounds): they always get different epochs; exactly one of them logs the step, the
    other is refused with EpisodeFenced (at its open unit or at its step) and keeps no
    copy; the winner goes on. With the old read-then-write owner record in the blob
    store both could get the same epoch and both write."""
    a, b = _engine(work, "a", two_states[0]), _engine(work, "b", two_states[1])
    uid = new_tenant_uid()
    req = ExecRequest(cmd="echo x >> /work/log && wc -l < /work/log")

    async def attempt(eng: EpisodeEngine, ep: str) -> int:
        info = await eng.open(ep, SandboxSpec(image="bb"))
        await eng.step(ep, 0, req, info.epoch)
        return info.epoch

    for rnd in range(6):
        ep = episode_key(uid, f"race{rnd}")
        ra, rb = await asyncio.gather(attempt(a, ep), attempt(b, ep), return_exceptions=True)
        outcomes = {"a": ra, "b": rb}
        won = [k for k, r in outcomes.items() if isinstance(r, int)]
        fenced = [k for k, r in outcomes.items() if isinstance(r, errors.EpisodeFenced)]
        assert len(won) == 1 and len(fenced) == 1, f"round {rnd}: {outcomes}"
        winner, loser = (a, b) if won == ["a"] else (b, a)
        epoch = outcomes[won[0]]
        assert epoch == await two_states[0].episode_epoch(ep) == await two_states[1].episode_epoch(ep)
        assert ep not in loser._live  # the fenced server forgot its copy (and its sandbox)
        r1 = await winner.step(ep, 1, ExecRequest(cmd="wc -l < /work/log"), epoch)
        assert r1.stdout.strip() == "1"  # one logged write, once
        await winner.close(ep, epoch)
    assert syscalls.mounts_under(str(work / "sbx-a")) == [] and syscalls.mounts_under(str(work / "sbx-b")) == []


# --- several API servers on one Redis and one node: one fenced scheduler leader -----------

@pytest.fixture(scope="module")
def leader_pair(tmp_path_factory: pytest.TempPathFactory, redis_srv: RedisServer) -> Iterator[Any]:
    """A one-node local Ray cluster (a real node agent with runc) and two `dsec serve
    --cluster ... --state redis://...` processes on it: A starts first (the scheduler
    leader), B gets A's admin token file (one tenant record, one token)."""
    pytest.importorskip("ray")
    from dsec.bench.failover import leader_pair as pair

    with pair(tmp_path_factory.mktemp("lc"), f"{redis_srv.url.rsplit('/', 1)[0]}/5") as p:
        yield p


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_leader_killed_mid_burst_every_create_once(leader_pair: Any) -> None:
    """Two API servers on one Redis and one real node; A leads (GET /v1/scheduler names
    it on both), B hands its placements to A. Two clients ([A, B] and [B, A]) send 200
    creates with request ids (a tenant made on B); A is killed -9 mid-burst. B takes the
    lease (its fencing token above A's) and every create succeeds exactly once: 200
    distinct sandboxes on the node, each request id answering its own, replaying on B
    answers the same ids. Placements stop for at most 5 s (the largest gap between
    consecutive creations on the node, printed). After one bulk kill nothing runs."""
    import dsec
    from dsec.bench.failover import BURST_SPEC, burst, live_inits, new_tenant, scheduler_view
    from dsec.models import SandboxSpec

    p = leader_pair
    sa, sb = scheduler_view(p.a_url, p.token), scheduler_view(p.b_url, p.token)
    assert sa["leader"] == sb["leader"] == p.a_url, (sa["leadership"], sb["leadership"])
    token = new_tenant(p.b_url, p.token, "burst")  # made on B, valid on A

    rep = burst(p, token, 200)
    after = rep.leader_after
    assert after["is_leader"] and after["token"] > rep.leader_before["token"], after
    assert sorted(rep.got) == sorted(f"burst-{i}" for i in range(200))
    ids = set(rep.got.values())
    assert len(ids) == 200, "a sandbox answered two request ids"
    assert rep.on_node == sorted(ids), "a duplicate or a missing sandbox on the node"
    with dsec.Client(url=p.b_url, token=token, timeout=60) as cb:
        for rid in sorted(rep.got)[::10]:  # replay on B: the same answers (shared request ids)
            assert cb.create(SandboxSpec(image="busybox", request_id=rid, **BURST_SPEC)).id == rep.got[rid]
        assert sorted(cb.kill_by_labels({"run": "burst"})) == sorted(ids)
        assert cb.list() == []
    deadline = time.monotonic() + 30
    while (left := live_inits(p.cgroup_parent, ids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"sandboxes still running after their kill: {left[:5]}"
    print(f"FIGURES failover: 200 creates from 2 clients in {rep.took_s}s, leader A killed -9 after "
          f"{rep.killed_after} answers; B took over {after['last_takeover_s']}s after A's last renewal; "
          f"longest time without placements on the node: {rep.no_placement_s}s")
    assert rep.no_placement_s <= 5.0, f"placements stopped for {rep.no_placement_s}s"


async def _flush(url: str, cls) -> None:
    st = cls(url)
    await st._r.flushdb()
    await st.close()


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory, redis_srv: RedisServer) -> Iterator[Server]:
    """One server on a fresh Redis DB (the node's default settings)."""
    from dsec.state.redis_store import RedisStateStore

    db = f"{redis_srv.url.rsplit('/', 1)[0]}/7"
    asyncio.run(_flush(db, RedisStateStore))
    home = tmp_path_factory.mktemp("srv1")
    ensure_images(home, ["busybox"])
    srv = start_server(home, {"DSEC_STATE_URL": db})
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
        srv.stop()
        from e2e_server import reap_home
        reap_home(home)


@pytest.mark.integration
def test_redis_lost_while_running_503_then_recovery(one: Server, redis_srv: RedisServer) -> None:
    """Redis stops answering: a create answers 503 with Retry-After and code
    state_unavailable naming the store, nothing is created; Redis back: the same create
    (same request id) succeeds on the same server, without a restart."""
    b = one
    with httpx.Client(base_url=b.url, headers={"authorization": f"Bearer {b.token}"}, timeout=60) as c:
        before = {s["id"] for s in c.get("/v1/sandboxes").json()}
        redis_srv.pause()
        try:
            r = c.post("/v1/sandboxes", json={"image": "busybox", "request_id": "lost-1"})
        finally:
            redis_srv.resume()
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "state_unavailable" and "redis://127.0.0.1" in r.json()["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert {s["id"] for s in c.get("/v1/sandboxes").json()} == before  # nothing made
        r2 = c.post("/v1/sandboxes", json={"image": "busybox", "request_id": "lost-1"})
        assert r2.status_code in (200, 201), r2.text
        c.delete(f"/v1/sandboxes/{r2.json()['id']}")


def _serve_refuses(home: Path, state_url: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
    env.update({"DSEC_HOME": str(home), "DSEC_STATE_URL": state_url})
    r = subprocess.run([DSEC, "serve", "--host", "127.0.0.1", "--port", "0"], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode != 0
    return " ".join((r.stdout + r.stderr).split())  # the terminal wraps long lines


@pytest.mark.integration
def test_serve_refuses_unreachable_or_other_schema(tmp_path: Path, redis_srv: RedisServer) -> None:
    """Redis unreachable at start: serve exits naming the URL. A store written by another
    schema version: serve exits naming both versions (nothing in it is touched)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
        out = _serve_refuses(tmp_path / "h1", dead)
    assert "cannot reach the state store" in out and dead in out
    other = f"{redis_srv.url.rsplit('/', 1)[0]}/6"
    import redis as redis_sync

    r = redis_sync.Redis.from_url(other)
    r.flushdb()
    r.set("dsec:schema", "99")
    out = _serve_refuses(tmp_path / "h2", other)
    assert "schema version 99" in out and "speaks version" in out
    assert r.get("dsec:schema") == b"99" and r.dbsize() == 1
    r.flushdb()
    r.close()
