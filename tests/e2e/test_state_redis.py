"""Issue 13 end to end: shared state on a real redis-server.

* Episode ownership race: two servers (two engines, their own sandboxes, one checkpoint
  store, one state store) open the same episode at the same moment: exactly one of them
  may write it, the other is fenced, on both state stores.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

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
