"""Draining a node (`dsec node drain ID [--migrate]`) over shared fake agents and the
real scheduler driver: placements stop there; with migrate its sandbox moves to another
node under the same id, files intact; bad input is a clear error."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsec import errors
from dsec.cluster.membership import NodeState


class _Loader:
    """The checkpoint store's ``load`` over the fakes' shared store (meta.spec)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def load(self, tenant: str, checkpoint_id: str) -> Any:
        unit = self.store.units[(tenant, checkpoint_id)]
        return SimpleNamespace(spec=unit.spec.model_dump())


async def _uid(name: str) -> str:
    return "uid-" + name


async def test_drain_stops_placement_and_migrates_with_the_same_id(tmp_path: Path) -> None:
    """Drain without migrate: state draining, new creates never land there, its sandbox
    stays. Drain again with migrate: the sandbox is checkpointed, destroyed there and
    restored on the other node under the same id with its file; the draining node is
    empty. Unknown node -> NotFound naming it; a lost node -> Conflict."""
    from fake_cluster import two_fake_nodes

    from dsec.cluster.drain import drain
    from dsec.config import Settings
    from dsec.models import SandboxSpec

    s = Settings(home=tmp_path, batch_window_s=0.01, retry_backoff_s=0.01)
    shape = {"image": "busybox", "cpu": 1, "memory": "1G", "disk": "1G"}
    async with two_fake_nodes(s) as (store, a, b, router, driver):
        first = await driver.create(SandboxSpec(**shape), "sb-1", "t")  # type: ignore[arg-type]
        src = {"a": a, "b": b}[first.node]
        other = b if src is a else a
        router.where[first.id] = src.node_id
        await router.write_file(first.id, "/work/state", b"step 7")

        res = await drain(router, driver, _Loader(store), src.node_id, migrate=False, tenant_uid=_uid)
        assert (res.previous, res.state, res.migrated) == ("ready", "draining", [])
        assert router.states[src.node_id] is NodeState.draining and first.id in src.sandboxes
        for i in range(4):
            info = await driver.create(SandboxSpec(**shape), f"sb-new-{i}", "t")  # type: ignore[arg-type]
            assert info.node == other.node_id

        res = await drain(router, driver, _Loader(store), src.node_id, migrate=True, tenant_uid=_uid)
        assert [(m.sandbox_id, m.from_node, m.to_node) for m in res.migrated] == [
            (first.id, src.node_id, other.node_id)], res
        assert first.id not in src.sandboxes and first.id in other.sandboxes
        assert await router.read_file(first.id, "/work/state") == b"step 7"
        assert driver.sched.running[first.id].node_id == other.node_id

        with pytest.raises(errors.NotFound) as nf:
            await drain(router, driver, _Loader(store), "zz", migrate=False, tenant_uid=_uid)
        assert "zz" in nf.value.message
        router.set_state(other.node_id, NodeState.lost)
        with pytest.raises(errors.Conflict) as cf:
            await drain(router, driver, _Loader(store), other.node_id, migrate=True, tenant_uid=_uid)
        assert "lost" in cf.value.message and other.node_id in cf.value.message


async def test_undrain_makes_a_draining_node_placeable_again(tmp_path: Path) -> None:
    """`dsec node undrain`: draining -> ready per the transition table; the scheduler places
    on it again (with the other node drained, a create lands there); undraining a ready node is a no-op;
    an unknown node is NotFound naming it, a lost node a Conflict (it rejoins by itself)."""
    from fake_cluster import two_fake_nodes

    from dsec.cluster.drain import drain, undrain
    from dsec.config import Settings
    from dsec.models import SandboxSpec

    s = Settings(home=tmp_path, batch_window_s=0.01, retry_backoff_s=0.01)
    shape = {"image": "busybox", "cpu": 1, "memory": "1G", "disk": "1G"}
    async with two_fake_nodes(s) as (_store, _a, _b, router, driver):
        await drain(router, driver, None, "a", migrate=False, tenant_uid=_uid)
        for i in range(2):
            assert (await driver.create(SandboxSpec(**shape), f"sb-d{i}", "t")).node == "b"  # type: ignore[arg-type]
        res = undrain(router, driver, "a")
        assert (res.previous, res.state) == ("draining", "ready") and router.states["a"] is NodeState.ready
        await drain(router, driver, None, "b", migrate=False, tenant_uid=_uid)  # only a can take it now
        assert (await driver.create(SandboxSpec(**shape), "sb-u", "t")).node == "a"  # type: ignore[arg-type]
        assert undrain(router, driver, "a").previous == "ready"  # idempotent
        with pytest.raises(errors.NotFound) as nf:
            undrain(router, driver, "zz")
        assert "zz" in nf.value.message
        router.set_state("b", NodeState.lost)
        with pytest.raises(errors.Conflict) as cf:
            undrain(router, driver, "b")
        assert "lost" in cf.value.message and "b" in cf.value.message
