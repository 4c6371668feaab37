"""Issue 13 end to end: shared state on a real redis-server.

* Episode ownership race: two servers (two engines, their own sandboxes, one checkpoint
  store, one state store) open the same episode at the same moment: exactly one of them
  may write it, the other is fenced, on both state stores.
* Two ``dsec serve --state redis://...`` processes (each its own port and node: own
  DSEC_HOME, cgroup parent, address range): a tenant made on one works on the other; a
  client given both URLs finishes a burst of creates on B after A is killed -9 mid-burst,
  every request id answered once, with one sandbox id, replayable on B.
* Redis lost while a server runs: 503 + Retry-After naming the store, then recovery.
* Redis unreachable at start / a store of another schema version: serve refuses to start
  and says why.

Until the cluster router lands (issue 11) each server reaches only its own node: a
sandbox A made is known to B (owner, request id) but not reachable through it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


# --- several API servers on one Redis -------------------------------------------------------

def _node_env(redis_url: str, i: int) -> dict[str, str]:
    """What keeps two nodes on one machine apart (as `dsec cluster up` does). The cgroup
    parents are fixed names: on this host a node whose cgroup parent is brand new hangs on
    its first creates (node layer; seen 2026-11-30, reported), a known one does not."""
    return {"DSEC_STATE_URL": redis_url, "DSEC_NODE_ID": f"m{i}", "DSEC_CGROUP_PARENT": f"dsec-m{i}",
            "DSEC_NET_CIDR": f"10.{231 + i}.0.0/16"}


def _reap(home: Path, env: dict[str, str]) -> list[str]:
    """Adopt and destroy what a (dead) server's node left; returns the sandbox ids.

    In a child process with the node's own environment: the node's cgroup parent is read
    from DSEC_CGROUP_PARENT when ``dsec.node.manager`` is imported, so an in-process reap
    looked under this process's parent and left the sandboxes' inits running."""
    script = (
        "import asyncio, json\n"
        "from dsec.config import load_settings\n"
        "from dsec.node.agent import LocalNodeAgent\n"
        "async def reap():\n"
        "    node = LocalNodeAgent(load_settings())\n"
        "    await node.start()\n"
        "    try:\n"
        "        ids = [i.id for i in await node.list()]\n"
        "        for sid in ids:\n"
        "            await node.destroy(sid)\n"
        "        return ids\n"
        "    finally:\n"
        "        await node.close()\n"
        "print(json.dumps(asyncio.run(reap())))\n")
    r = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env, "DSEC_HOME": str(home)},
                       capture_output=True, text=True, timeout=180, check=True)
    return list(json.loads(r.stdout.strip().splitlines()[-1]))

# Burst sandboxes are small: each server's node is this 2-core host, which reserves
# 0.25 x 1 CPU per default sandbox, so it holds ~10 default ones and B (which finishes
# most of the burst) queued the rest for capacity that never came: that was the
# "hang after failover" this test was an xfail for (queue_depth 4, cpu_allocated 2.5/2.6).
SMALL: dict[str, object] = {"cpu": 0.05, "memory": "64M"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, redis_srv: RedisServer) -> Iterator[tuple[Server, Server, dict]]:
    """Servers A and B on one fresh Redis DB, each with its own node; they share the local
    admin token (B's DSEC_HOME gets A's token file: one tenant record, one token)."""
    from dsec.state.redis_store import RedisStateStore

    db = f"{redis_srv.url.rsplit('/', 1)[0]}/5"
    asyncio.run(_flush(db, RedisStateStore))
    homes = [tmp_path_factory.mktemp("srvA"), tmp_path_factory.mktemp("srvB")]
    envs = [_node_env(db, i) for i in range(2)]
    for h in homes:
        ensure_images(h, ["busybox"])
    a = start_server(homes[0], envs[0])
    shutil.copy(homes[0] / "token", homes[1] / "token")
    try:
        b = start_server(homes[1], envs[1])
    except BaseException:
        a.stop()
        raise
    info = {"envs": envs, "homes": homes, "db": db}
    try:
        yield a, b, info
    finally:
        for srv in (a, b):
            if srv.proc.poll() is None:
                srv.stop(signal.SIGTERM)
        for h, env in zip(homes, envs, strict=True):
            _reap(h, env)


async def _flush(url: str, cls) -> None:
    st = cls(url)
    await st._r.flushdb()
    await st.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_two_servers_one_state_client_fails_over_mid_burst(pair: tuple[Server, Server, dict]) -> None:
    """A tenant made on A is valid on B. A burst of creates from a client given [A, B]:
    A is killed -9 mid-burst; every create still succeeds, each request id gets one
    sandbox id (no id twice), and replaying every request id on B answers the same id."""
    import dsec
    from dsec.models import SandboxSpec

    a, b, _ = pair
    assert a.token == b.token
    with httpx.Client(base_url=a.url, headers={"authorization": f"Bearer {a.token}"}, timeout=30) as admin:
        r = admin.post("/v1/tenants", json={"name": "burst"})
        assert r.status_code == 201, r.text
        token = r.json()["token"]
    with httpx.Client(base_url=b.url, headers={"authorization": f"Bearer {token}"}, timeout=30) as on_b:
        assert on_b.get("/v1/sandboxes").status_code == 200  # the token A issued works on B

    n, workers, kill_after = 24, 4, 6
    rids = [f"burst-{i}" for i in range(n)]
    got: dict[str, str] = {}
    acked = threading.Event()
    lock = threading.Lock()
    client = dsec.Client(url=[a.url, b.url], token=token, retries=8, timeout=30)

    def create(rid: str) -> None:
        sid = client.create(SandboxSpec(image="busybox", request_id=rid, **SMALL)).id
        with lock:
            got[rid] = sid
            if len(got) >= kill_after:
                acked.set()

    with ThreadPoolExecutor(workers) as pool:
        futs = [pool.submit(create, rid) for rid in rids]
        if not acked.wait(60):
            spy = subprocess.run([str(Path(DSEC).parent / "py-spy"), "dump", "--pid", str(a.proc.pid)],
                                 capture_output=True, text=True, check=False).stdout
            spy += subprocess.run([str(Path(DSEC).parent / "py-spy"), "dump", "--pid", str(os.getpid())],
                                  capture_output=True, text=True, check=False).stdout
            raise AssertionError(f"only {len(got)} creates acknowledged by A in 120 s:\n{spy}\n"
                                 f"{a.log.read_text(errors='replace')[-3000:]}")
        os.kill(a.proc.pid, signal.SIGKILL)  # mid-burst: creates are in flight on A
        t_kill = time.monotonic()
        for f in futs:
            f.result(timeout=60)  # every create finishes (on B)
    took = time.monotonic() - t_kill
    a.proc.wait(10)
    client.close()
    assert client.config.url == b.url
    assert sorted(got) == sorted(rids)
    assert len(set(got.values())) == n, "a sandbox id answered two request ids"
    with dsec.Client(url=b.url, token=token) as cb:  # replay: same answers from B (shared request ids)
        for rid in rids:
            assert cb.create(SandboxSpec(image="busybox", request_id=rid, **SMALL)).id == got[rid]
        on_b = {s.id for s in cb.list()}
    assert on_b <= set(got.values())
    print(f"burst of {n} creates, {workers} workers: A killed after {kill_after} acks; rest done on B "
          f"{took:.2f}s after the kill; {len(on_b)} sandboxes on B")


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
