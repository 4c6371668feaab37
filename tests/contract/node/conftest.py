"""Implementations for the NodeAgent contract suite.

- ``fake``: ``dsec.testing.FakeNodeAgent`` (in memory; no root).
- ``router``: ``dsec.cluster.router.ClusterRouter`` over two fakes sharing a checkpoint
  store (what the API service talks to on a cluster).
- ``wire``: ``RayNodeProxy`` over the fake inside an in-process ``NodeAgentServer``
  (``LocalHandle``, no Ray): every call crosses the direct data path (TCP on loopback,
  JSON frames), so each method's arguments, results and errors survive that wire.
- ``local``: the real ``LocalNodeAgent`` in this process (real runc, overlayfs; integration).
- ``ray``: the same real agent inside its Ray actor on a one-node Ray cluster that this
  session starts with ``dsec.cluster.local.up`` (own temp dir and ports, tracked by PID)
  and stops with ``down``, reached through ``RayNodeProxy`` (integration): node calls take
  the agent's direct data endpoint (the fixture checks no call fell back to Ray).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.config import load_settings
from dsec.testing import FakeNodeAgent

IMPLS = ["fake", "router", "wire", pytest.param("local", marks=pytest.mark.integration),
         pytest.param("ray", marks=pytest.mark.integration)]


@pytest.fixture(scope="session")
def node_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One image store with busybox and one compiled dsec-init, shared by the local nodes."""
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock
    from dsec.runtime.agent_build import ensure_agent_binary

    home = tmp_path_factory.mktemp("node-images")
    ensure_stock(ImageStore(home / "images", load_settings(home=home)), only=["busybox"], log=lambda _: None)
    ensure_agent_binary(home / "bin")
    return home


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ray")
    from dsec.cluster import local

    base = tmp_path_factory.mktemp("ray-cluster")
    c = local.up(base, 1, ["busybox"], log=lambda _m: None)
    try:
        yield c
    finally:
        local.down(base, log=lambda _m: None)


async def _local(node_images: Path, tmp_path: Path) -> Any:
    from dsec.images import ImageStore
    from dsec.node.agent import LocalNodeAgent

    home = tmp_path / "home"
    home.mkdir()
    (home / "bin").symlink_to(node_images / "bin")
    run_dir = Path(tempfile.mkdtemp(prefix="dnc-", dir="/tmp"))  # short: socket paths
    settings = load_settings(home=home, run_dir=run_dir, layer_compression="tar", node_id="local-node")
    node = LocalNodeAgent(settings, images=ImageStore(node_images / "images", settings))
    await node.start()
    return node


async def _cleanup(node: Any) -> None:
    for info in await node.list():
        with contextlib.suppress(Exception):
            await node.destroy(info.id)


@pytest.fixture(params=IMPLS)
async def node(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "fake":
        n: Any = FakeNodeAgent(load_settings(home=tmp_path), node_id="fake-node")
        await n.start()
        yield n
        await n.close()
        return
    if request.param == "router":
        from dsec.cluster.router import ClusterRouter
        from dsec.testing import FakeCheckpointStore

        shared = FakeCheckpointStore()
        r = ClusterRouter({nid: FakeNodeAgent(load_settings(home=tmp_path), node_id=nid, checkpoints=shared)
                           for nid in ("f1", "f2")})
        await r.start()
        yield r
        await r.close()
        return
    if request.param == "local":
        n = await _local(request.getfixturevalue("node_images"), tmp_path)
        try:
            yield n
        finally:
            await _cleanup(n)
            await n.close()
            shutil.rmtree(n.settings.runtime_dir, ignore_errors=True)
        return
    if request.param == "wire":
        from dsec.cluster.ray import LocalHandle, NodeAgentServer, RayNodeProxy

        server = NodeAgentServer("fake", {"home": tmp_path, "node_id": "fake-node"})
        n = RayNodeProxy("fake-node", LocalHandle(server))
        await n.start()
        try:
            yield n
            assert n.stats["ray"] == 0 and n.stats["direct"] > 0, n.stats
        finally:
            await n.close()
            await server.close()
        return
    from dsec.cluster.ray import RayNodeProxy, get_agent

    request.getfixturevalue("ray_cluster")
    n = RayNodeProxy("n0", get_agent("n0"))
    await n.start()
    try:
        yield n
        assert n.stats["ray"] == 0 and n.stats["direct"] > 0, n.stats  # the direct data path was used
    finally:
        await _cleanup(n)
        await n.close()
