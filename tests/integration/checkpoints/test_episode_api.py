"""Episodes through the real HTTP API and the SDK: create, log, restart the server, resume."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
import zstandard
from ckpt_agent import make_engine
from fastapi import FastAPI

from dsec import errors
from dsec.api.auth import TenantAuth
from dsec.api.episodes import include_episodes
from dsec.api.errors import install_error_handlers
from dsec.node import syscalls
from dsec.sdk import Client
from dsec.sdk.episode import Episode
from dsec.state.sqlite import SqliteStateStore

pytestmark = pytest.mark.integration


async def _admit(tenant: object, spec: object) -> None:
    return None


class Server:
    """A real uvicorn server on loopback serving the episodes router."""

    def __init__(self, work, state):
        app = FastAPI()
        # The episodes router authenticates and has open's spec judged by the services'
        # SandboxService.check_spec; this harness serves the router alone and admits every spec.
        app.state.services = SimpleNamespace(auth=TenantAuth(state), sandboxes=SimpleNamespace(check_spec=_admit))
        install_error_handlers(app, 1.0)
        self.engine = make_engine(work)
        include_episodes(app, self.engine)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def env(tmp_path):
    state = SqliteStateStore(tmp_path / "state.db")
    _, token = asyncio.run(TenantAuth(state).create_tenant("alice"))
    yield tmp_path, state, token
    for mp in syscalls.mounts_under(str(tmp_path)):
        try:
            syscalls.umount(mp)
        except OSError:
            pass


def agent(ep: Episode, n: int) -> list[str]:
    outs = []
    for i in range(n):
        outs.append(ep.exec(f"echo {i} >> /work/log && wc -l < /work/log").stdout.strip())
        if i == 1:
            ep.save_context({"messages": ["hi", i]})
    return outs


def test_sdk_episode_survives_server_restart(env):
    """After the server restarts, the same agent loop fast-forwards its logged steps (no
    re-run: /work/log counts each step once), continues live, and sees its context."""
    work, state, token = env
    srv = Server(work, state)
    c = Client(url=f"http://127.0.0.1:{srv.port}", token=token)
    ep = Episode.open("ep-42", image="bb", client=c)
    assert not ep.resumed
    assert agent(ep, 3) == ["1", "2", "3"]
    ref = ep.checkpoint(weights_ref="s3://bucket/ckpt/step-3", meta={"step": 3})
    assert ref.steps == 3 and ref.episode_id == "ep-42"
    srv.stop()  # "crash": all in-memory episode state is gone; the sandbox is left behind

    srv2 = Server(work, state)
    c2 = Client(url=f"http://127.0.0.1:{srv2.port}", token=token)
    with Episode.open("ep-42", image="bb", client=c2) as ep2:
        assert ep2.resumed and ep2.info.steps == 3 and ep2.info.weights_ref == "s3://bucket/ckpt/step-3"
        assert agent(ep2, 5) == ["1", "2", "3", "4", "5"]
        assert ep2.context() == {"messages": ["hi", 1]}
        lines = zstandard.ZstdDecompressor().stream_reader(ep2.export(), read_across_frames=True).read()
        assert lines.count(b"\n") == 5
    with Episode.open("ep-42", image="bb", client=c2) as ep3:
        ep3.exec("echo 0 >> /work/log && wc -l < /work/log")
        with pytest.raises(errors.ReplayDiverged, match="step 1"):
            ep3.exec("rm -rf /work")
    srv2.stop()


def test_episodes_are_per_tenant(env):
    """Another tenant cannot see or drive an episode with the same id."""
    work, state, token = env
    _, token_b = asyncio.run(TenantAuth(state).create_tenant("bob"))
    srv = Server(work, state)
    url = f"http://127.0.0.1:{srv.port}"
    a = Episode.open("same", image="bb", client=Client(url=url, token=token))
    a.exec("echo a > /work/who")
    b = Episode.open("same", image="bb", client=Client(url=url, token=token_b))
    assert not b.resumed and b.exec("cat /work/who 2>/dev/null || echo none").stdout == "none\n"
    a.close()
    b.close()
    srv.stop()


def test_async_episode_and_fencing_over_http(env):
    """dsec.AsyncEpisode drives the same episode API; when another client opens the same
    episode (the first was thought dead), the old handle gets EpisodeFenced (409) on its
    next write, nothing of it is logged, and the new owner's loop replays and continues."""
    import asyncio

    import dsec
    from dsec.sdk import AsyncClient
    work, state, token = env
    srv = Server(work, state)
    url = f"http://127.0.0.1:{srv.port}"

    async def go():
        ac = AsyncClient(url=url, token=token)
        old = await dsec.AsyncEpisode.open("fenced", image="bb", client=ac)
        assert [(await old.exec(f"echo {i} >> /work/log && wc -l < /work/log")).stdout for i in range(2)] == \
            ["1\n", "2\n"]
        new = Episode.open("fenced", image="bb", client=Client(url=url, token=token))
        assert new.epoch > old.epoch and new.info.steps == 2
        with pytest.raises(errors.EpisodeFenced, match="newer owner"):
            await old.exec("echo 2 >> /work/log && wc -l < /work/log")
        with pytest.raises(errors.EpisodeFenced):
            await old.close()
        outs = [new.exec(f"echo {i} >> /work/log && wc -l < /work/log") for i in range(3)]
        assert [o.replayed for o in outs] == [True, True, False] and outs[2].stdout == "3\n"
        new.close()
        async with await dsec.AsyncEpisode.open("fenced", image="bb", client=ac) as again:
            assert again.resumed and (await again.exec("echo 0 >> /work/log && wc -l < /work/log")).replayed
            assert (await again.refresh()).steps == 3
        await ac.aclose()
    asyncio.run(go())
    srv.stop()
