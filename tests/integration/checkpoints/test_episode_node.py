"""Episodes on real sandboxes (runc via the node agent): checkpoint, lose the sandbox, restore."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import pytest

from dsec import errors
from dsec.blobs import LocalBlobStore, ReplicatedBlobStore
from dsec.checkpoints.engine import EpisodeEngine
from dsec.checkpoints.nodehost import NodeEpisodeHost
from dsec.images import ImageStore
from dsec.images.stock import ensure_stock
from dsec.models import ExecRequest, SandboxSpec
from dsec.runtime.agent_build import ensure_agent_binary

sys.path.insert(0, str(Path(__file__).parents[1] / "sandbox"))
from sbx_helpers import SharedEnv, node_settings, start_node, stop_node

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> SharedEnv:
    home = tmp_path_factory.mktemp("ep-images")
    store = ImageStore(home / "images", node_settings(home, home / "run"))
    ensure_stock(store, only=["busybox"], log=lambda _: None)
    ensure_agent_binary(home / "bin")
    return SharedEnv(home, store, home / "bin")


@pytest.fixture
async def node(env, tmp_path):
    n = await start_node(env, tmp_path / "home")
    yield n
    await stop_node(n)


def _engine(node, tmp_path: Path, **over) -> EpisodeEngine:
    from dsec.config import load_settings
    s = load_settings(home=tmp_path / "home", checkpoint_keep=3, checkpoint_full_every=3, **over)
    store = ReplicatedBlobStore([LocalBlobStore(tmp_path / "r1"), LocalBlobStore(tmp_path / "r2")])
    return EpisodeEngine(s, store, NodeEpisodeHost(node), cache_dir=Path(tempfile.mkdtemp(dir=tmp_path)))


SPEC = SandboxSpec(image="busybox", cpu=0.5, memory="256M", disk="64M")
CMDS = ["mkdir -p /work && echo a > /work/a && echo 1 >> /work/log && wc -l < /work/log",
        "rm /etc/hostname 2>/dev/null; ln -s /work/a /work/link && echo 2 >> /work/log && wc -l < /work/log",
        "cat /work/link",
        "head -c 300000 /dev/urandom > /work/big && rm /work/a && echo 3 >> /work/log && wc -l < /work/log",
        "rm -rf /work/sub; mkdir -p /work/sub && echo x > /work/sub/x && echo 4 >> /work/log && wc -l < /work/log",
        "ls -la /work | wc -l; md5sum /work/big | cut -c1-8 > /work/sum; cat /work/log | wc -l"]


async def test_episode_on_runc_sandbox_restores_after_sandbox_loss(node, tmp_path):
    """A real runc sandbox's upper dir is checkpointed per step; when the sandbox dies
    (destroyed behind the engine's back) and the server forgets everything, reopening
    restores a new sandbox from image + checkpoint layers with the same files, the logged
    steps fast-forward and later steps see exactly the state after the last logged step."""
    eng = _engine(node, tmp_path)
    await eng.open("ep", SPEC)
    outs = [(await eng.step("ep", i, ExecRequest(cmd=c))).stdout for i, c in enumerate(CMDS[:5])]
    info = await eng.info("ep")
    await node.destroy(info.sandbox_id)              # the sandbox dies
    await eng.forget("ep")                           # and the server loses its memory
    eng2 = _engine(node, tmp_path)
    info2 = await eng2.open("ep")
    assert info2.resumed and info2.steps == 5 and info2.fs_digest == info.fs_digest
    for i, c in enumerate(CMDS[:5]):
        r = await eng2.step("ep", i, ExecRequest(cmd=c))
        assert r.replayed and r.stdout == outs[i]
    r = await eng2.step("ep", 5, ExecRequest(cmd=CMDS[5]))
    assert not r.replayed and r.stdout.strip().endswith("4")   # four logged writes, none re-run
    sid = (await eng2.info("ep")).sandbox_id
    got = await node.exec(sid, ExecRequest(cmd="cat /work/sub/x; test -e /work/a || echo gone; "
                                               "test -e /etc/hostname || echo nohost; readlink /work/link"))
    assert got.stdout.split() == ["x", "gone", "nohost", "/work/a"]
    await eng2.close("ep")


async def test_preemption_checkpoint_and_stop_then_resume(node, tmp_path):
    """checkpoint_and_stop (the scheduler's preemption hook) stops the sandbox after a
    complete unit; the next step transparently restores it with its files."""
    eng = _engine(node, tmp_path)
    await eng.open("ep", SPEC)
    await eng.step("ep", 0, ExecRequest(cmd="echo keep > /tmp/state"))
    sid = (await eng.info("ep")).sandbox_id
    ref = await eng.checkpoint_and_stop(sid)
    assert ref.steps == 1
    with pytest.raises(errors.DSecError):
        node.manager.live_record(sid)  # the preempted sandbox is gone
    r = await eng.step("ep", 1, ExecRequest(cmd="cat /tmp/state"))
    assert r.stdout == "keep\n"
    await eng.close("ep")


async def test_destroying_a_sandbox_left_frozen_succeeds(node, tmp_path):
    """A server killed between freeze and thaw of a capture leaves its sandbox frozen, and
    frozen tasks cannot die; destroying it through the episode host thaws it first, so
    the leftover goes away instead of failing (EBUSY) on every retry."""
    host = NodeEpisodeHost(node)
    info = await node.create(SPEC)
    await node.manager.freeze(info.id)               # as a killed server leaves it
    freezer = host._freezer_dir(info.id)
    assert (freezer / "freezer.state").read_text().strip() == "FROZEN"
    await asyncio.wait_for(host.destroy(info.id), 60)
    with pytest.raises(errors.DSecError):
        node.manager.live_record(info.id)
    assert not freezer.exists()
