"""The prefetch executor (dsec.cluster.prefetch.Prefetcher) over the real scheduler driver
and in-memory node agents (dsec.testing.FakeNodeAgent, with the node's ``p2p_admin``
"prefetch" op reduced to recording the call and holding the image afterwards): a pass
does nothing until an image is popular, then asks the node the scheduler ranks next to
prefetch exactly the layers it lacks, tells the scheduler it holds them, and neither
repeats a (node, image) within the retry window nor hammers a node whose prefetch failed."""

from __future__ import annotations

import asyncio
from typing import Any

from dsec.cluster.prefetch import Prefetcher
from dsec.cluster.serve import ImageCatalog
from dsec.control.driver import SchedulerDriver
from dsec.control.scheduler import Scheduler
from dsec.errors import TransientError
from dsec.models import SandboxSpec
from dsec.testing import FakeNodeAgent


class PrefetchingNode(FakeNodeAgent):
    def __init__(self, *a: Any, fail: bool = False, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.prefetched: list[tuple[str, list[str]]] = []
        self.fail = fail

    async def p2p_admin(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        assert op == "prefetch"
        self.prefetched.append((args["ref"], list(args["order"])))
        if self.fail:
            raise TransientError("registry down")
        self.known_images = (*self.known_images, args["ref"].split(":")[0])
        return {"skipped": "", "status": {"sources": {"peer:n0": 1 << 20}}}


class Router:
    def __init__(self, agents: dict[str, Any]) -> None:
        self.agents = agents


async def _setup(**kw: Any) -> tuple[SchedulerDriver, dict[str, PrefetchingNode], Prefetcher]:
    from dsec.config import Settings

    s = Settings(image_registry="127.0.0.1:5999", image_prefetch_nodes=2, batch_window_s=0.01,  # type: ignore[arg-type]
                 overcommit_threshold=100)
    fail = kw.pop("fail", ())
    agents = {f"n{i}": PrefetchingNode(s, node_id=f"n{i}", known_images=("team/pop",) if i == 0 else ("busybox",),
                                       isolation=("container",), fail=f"n{i}" in fail) for i in range(3)}
    catalog = ImageCatalog()
    sched = Scheduler(s)
    for nid, a in agents.items():
        index = await a.layer_index()
        catalog.add(index)
        cap = a.capacity()
        sched.upsert_node(nid, cap.cpu, cap.memory, cap.disk, isolation=tuple(cap.isolation), layers=index.digests())
    driver = SchedulerDriver(sched, agents, s, image_resolver=catalog)  # type: ignore[arg-type]
    await driver.start()
    for a in agents.values():
        await a.start()
    return driver, agents, Prefetcher(s, Router(agents), driver)


async def _creates(driver: SchedulerDriver, n: int) -> None:
    for i in range(n):
        info = await driver.create(SandboxSpec(image="team/pop", cpu=1, memory="1G", disk="1G"), f"sb-{i}", "t1")
        assert info.node == "n0"  # the holder: layer coverage


async def test_popular_image_prefetched_onto_the_next_ranked_node_once() -> None:
    """No pass prefetches before the image is popular (2 creates); then the node ranked
    right after the holder (n1: n1 and n2 tie, by id) gets one job with the layers it
    lacks; the scheduler counts n1 as a holder afterwards; later passes start nothing
    (n1 holds it, n2 is not among the 2 likely nodes, and the retry window holds)."""
    driver, agents, p = await _setup()
    try:
        assert await p.pass_once() == []
        await _creates(driver, 1)
        assert await p.pass_once() == []  # one create is not popular
        await _creates(driver, 2)
        jobs = await p.pass_once()
        assert [(j.node, j.image) for j in jobs] == [("n1", "team/pop")]
        await asyncio.gather(*p._tasks)
        digest = driver.sched.images["team/pop"].layers[0][0]
        assert agents["n1"].prefetched == [("team/pop", [digest])] and not agents["n2"].prefetched
        assert digest in driver.sched.cluster.nodes["n1"].layers
        assert p.stats["done"] == 1 and p.stats["bytes"] == 1 << 20 and p.busy == {}
        assert await p.pass_once() == []
    finally:
        await driver.close()


async def test_failed_prefetch_is_not_retried_within_the_window() -> None:
    """A node whose prefetch failed is counted (stats, recent) and not asked again for the
    same image until image_prefetch_retry_s passed: no loop against a broken source."""
    driver, agents, p = await _setup(fail=("n1",))
    try:
        await _creates(driver, 2)
        assert [j.node for j in await p.pass_once()] == ["n1"]
        await asyncio.gather(*p._tasks)
        assert p.stats["failed"] == 1 and "registry down" in p.results[-1]["error"]
        assert await p.pass_once() == []  # n1 tried recently; n2 is not among the 2 likely nodes
        assert len(agents["n1"].prefetched) == 1
        p.tried = {k: t - p.s.image_prefetch_retry_s for k, t in p.tried.items()}  # the window passed
        assert [j.node for j in await p.pass_once()] == ["n1"]
        await asyncio.gather(*p._tasks)
    finally:
        await driver.close()


async def test_refresh_keeps_layers_a_create_added_while_it_read_the_indexes() -> None:
    """The layer view follows the nodes' real indexes: a layer the scheduler believed a node
    held and its index no longer shows stops counting; but a create that lands while the
    indexes are being read (its image's layers added by the driver) is not undone by an
    index read before it. (The full apply used to drop them until the next pass.)"""
    driver, agents, p = await _setup()
    try:
        sched = driver.sched
        node = sched.cluster.nodes["n1"]
        sched.layers_changed("n1", ["sha256:" + "e" * 64])  # believed, but n1 never had it
        reading, go = asyncio.Event(), asyncio.Event()
        real = agents["n1"].layer_index

        async def slow_index() -> Any:
            index = await real()
            reading.set()
            await go.wait()
            return index

        agents["n1"].layer_index = slow_index  # type: ignore[method-assign]
        task = asyncio.create_task(p.refresh())
        await reading.wait()
        landed = ["sha256:" + "c" * 64]
        sched.layers_changed("n1", landed)  # a create on n1 finished meanwhile
        go.set()
        await task
        assert landed[0] in node.layers
        assert "sha256:" + "e" * 64 not in node.layers
        assert "n1" in sched.cluster.layer_index[landed[0]].pos  # placement's index agrees
    finally:
        await driver.close()
