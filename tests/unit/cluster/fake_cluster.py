"""Two fake nodes ("a", "b") sharing one fake checkpoint store, behind the real cluster
router and the real scheduler driver: the setup the drain and lost-node tests share."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from dsec.cluster.router import ClusterRouter
from dsec.config import Settings
from dsec.control.driver import SchedulerDriver
from dsec.control.scheduler import Scheduler
from dsec.testing import FakeNodeAgent
from dsec.testing.fake_node import FakeCheckpointStore


@contextlib.asynccontextmanager
async def two_fake_nodes(
        s: Settings) -> AsyncIterator[tuple[FakeCheckpointStore, FakeNodeAgent, FakeNodeAgent, ClusterRouter,
                                            SchedulerDriver]]:
    """(store, a, b, router, driver), started; driver and router closed on the way out."""
    store = FakeCheckpointStore()
    a, b = FakeNodeAgent(s, node_id="a", checkpoints=store), FakeNodeAgent(s, node_id="b", checkpoints=store)
    router = ClusterRouter({"a": a, "b": b})
    await router.start()
    driver = SchedulerDriver(Scheduler(s), router.agents, s)
    await driver.start()
    try:
        yield store, a, b, router, driver
    finally:
        await driver.close()
        await router.close()
