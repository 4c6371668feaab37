"""On the Ray path, RayNodeProxy coalesces control calls into one actor round trip per
event-loop pass.

The actor's dispatcher (``NodeAgentServer`` over the shared fake) runs in-process behind a
stand-in handle that records every round trip: no Ray processes are started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dsec import errors
from dsec.cluster.ray import NodeAgentServer, RayNodeProxy
from dsec.models import SandboxSpec

SPEC = SandboxSpec(image="busybox", cpu=0.1, memory=64 * 2**20, disk=64 * 2**20)


class _Remote:
    """``handle.<method>.remote(...)``: records the round trip, returns an awaitable."""

    def __init__(self, name: str, fn: Callable[..., Awaitable[Any]], trips: list[tuple[str, int]],
                 fail: list[BaseException]) -> None:
        self.name, self.fn, self.trips, self.fail = name, fn, trips, fail

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        self.trips.append((self.name, len(args[0]) if self.name == "call_many" else 1))

        async def go() -> Any:
            if self.fail:
                raise self.fail[0]
            return await self.fn(*args, **kwargs)
        return asyncio.ensure_future(go())


class _Handle:
    def __init__(self, server: NodeAgentServer) -> None:
        self.trips: list[tuple[str, int]] = []
        self.fail: list[BaseException] = []
        for name in ("start", "call", "call_many", "close"):
            setattr(self, name, _Remote(name, getattr(server, name), self.trips, self.fail))


@pytest.fixture
async def proxy(tmp_path: Path) -> Any:
    server = NodeAgentServer("fake", {"home": str(tmp_path), "node_id": "f1"})
    p = RayNodeProxy("f1", _Handle(server), 30, direct=False)  # the Ray path (no data endpoint)
    await p.start()
    p.handle.trips.clear()
    yield p
    await server.close()


async def test_concurrent_creates_share_one_round_trip(proxy: RayNodeProxy) -> None:
    """20 creates issued together reach the node in ONE actor call (Ray's per-call cost
    capped the control plane near 200-500 placements/s); each caller still gets its own
    answer, and the node holds all 20."""
    infos = await asyncio.gather(*(proxy.create(SPEC, sandbox_id=f"sb-{i}", tenant="t") for i in range(20)))
    assert [i.id for i in infos] == [f"sb-{i}" for i in range(20)]
    assert proxy.handle.trips == [("call_many", 20)]
    assert len(await proxy.list()) == 20
    assert proxy.handle.trips[-1] == ("call", 1)  # a call alone goes out as a plain call


async def test_one_failing_call_fails_only_its_caller(proxy: RayNodeProxy) -> None:
    """Errors stay per call inside a batch: an unknown image is NotFound for that create
    alone (same class and status as a single call), its neighbours are created."""
    bad = SPEC.model_copy(update={"image": "nosuchimage"})
    out = await asyncio.gather(proxy.create(SPEC, sandbox_id="sb-a"), proxy.create(bad, sandbox_id="sb-b"),
                               proxy.create(SPEC, sandbox_id="sb-c"), return_exceptions=True)
    assert [getattr(o, "id", None) for o in out] == ["sb-a", None, "sb-c"]
    assert isinstance(out[1], errors.NotFound) and out[1].details.get("image") == "nosuchimage"
    assert proxy.handle.trips == [("call_many", 3)]


async def test_a_dead_actor_fails_every_call_of_the_batch_as_node_lost(proxy: RayNodeProxy) -> None:
    """When the actor's round trip itself fails (node or agent gone), every caller of that
    batch gets NodeLost (410), none hangs; a proxy marked lost sends nothing at all."""
    import ray.exceptions as rx

    proxy.handle.fail.append(rx.ActorUnavailableError("gone", None))
    out = await asyncio.gather(*(proxy.destroy(f"sb-{i}") for i in range(3)), return_exceptions=True)
    assert all(isinstance(o, errors.NodeLost) for o in out), out
    proxy.handle.fail.clear()
    proxy.mark_lost()
    proxy.handle.trips.clear()
    with pytest.raises(errors.NodeLost):
        await proxy.get("sb-0")
    assert proxy.handle.trips == []
