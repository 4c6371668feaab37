"""``dsec node drain ID [--migrate]`` (``POST /v1/nodes/{id}/drain``): take a node out of
placement; with ``migrate``, move its running sandboxes elsewhere. ``dsec node undrain ID``
(``POST /v1/nodes/{id}/undrain``): a draining node takes placements again.

Drain: the node becomes ``draining`` (dsec.cluster.membership) and unhealthy for the
scheduler: no new sandbox or warm hand-over goes there; its sandboxes keep running until
they end. Migrate, per sandbox: checkpoint on the node (``NodeAgent.checkpoint``, unit
into the shared store), destroy it there, restore it through the scheduler under the
SAME sandbox id on another node (the restore is queued and accounted like any create).
Clients see the id briefly answer NotFound while it moves; files come back byte for
byte, processes do not (a checkpoint is the filesystem), and its TTL starts again.
Unclaimed warm-pool members there are destroyed (pools are rebuilt from demand).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, Field

from dsec import errors
from dsec.cluster.membership import NodeState
from dsec.control.convert import POOL_LABEL
from dsec.models import SandboxSpec
from dsec.node.api import RestoreSource

log = logging.getLogger("dsec.cluster")


class Migrated(BaseModel):
    sandbox_id: str
    from_node: str
    to_node: str
    checkpoint_id: str


class DrainResult(BaseModel):
    node: str
    state: str
    previous: str = Field(..., description="State before the drain")
    migrated: list[Migrated] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict, description="sandbox id -> why it could not move (it "
                                   "stays on the draining node)")
    pool_destroyed: int = 0


def check_drainable(node_id: str, nodes: dict[str, NodeState]) -> None:
    """Pure: NotFound for an unknown node, Conflict for a lost one (nothing answers there
    to checkpoint or to stop; its sandboxes were already given up)."""
    if node_id not in nodes:
        raise errors.NotFound(f"node {node_id!r} is not a node of this cluster (nodes: "
                              f"{', '.join(sorted(nodes)) or 'none'})", node=node_id)
    if nodes[node_id] is NodeState.lost:
        raise errors.Conflict(f"node {node_id} is lost: it cannot be drained (its sandboxes were given up and "
                              "answer 410); it rejoins as ready when it answers again", node=node_id,
                              state=NodeState.lost.value)


class UndrainResult(BaseModel):
    node: str
    state: str
    previous: str = Field(..., description="State before the undrain")


def check_undrainable(node_id: str, nodes: dict[str, NodeState]) -> None:
    """Pure: NotFound for an unknown node; Conflict unless it is draining or ready (a lost
    node becomes ready only by answering heartbeats again, after it reconciled)."""
    if node_id not in nodes:
        raise errors.NotFound(f"node {node_id!r} is not a node of this cluster (nodes: "
                              f"{', '.join(sorted(nodes)) or 'none'})", node=node_id)
    if nodes[node_id] is NodeState.lost:
        raise errors.Conflict(f"node {node_id} is lost, not draining: it becomes ready by itself when it answers "
                              "heartbeats again (after destroying what was given up)", node=node_id,
                              state=NodeState.lost.value)


def undrain(router: Any, driver: Any | None, node_id: str) -> UndrainResult:
    """draining -> ready (the transition table's "drain cancelled"): placements and warm
    hand-overs go there again. Undraining a ready node changes nothing (idempotent)."""
    check_undrainable(node_id, router.states)
    previous = router.set_state(node_id, NodeState.ready)
    if driver is not None and node_id in driver.sched.cluster.nodes:
        driver.sched.set_node_health(node_id, True)
        driver._wake.set()  # requests queued for lack of room may fit there now
    log.info("node %s undrained (%s -> ready)", node_id, previous.value)
    return UndrainResult(node=node_id, state=NodeState.ready.value, previous=previous.value)


async def drain(router: Any, driver: Any | None, checkpoints: Any | None, node_id: str, *, migrate: bool,
                tenant_uid: Callable[[str], Awaitable[str]]) -> DrainResult:
    check_drainable(node_id, router.states)
    if migrate and (driver is None or checkpoints is None):
        raise errors.InvalidArgument("--migrate needs the scheduler and a checkpoint store on this server",
                                     field="migrate")
    previous = router.set_state(node_id, NodeState.draining)
    if driver is not None and node_id in driver.sched.cluster.nodes:
        driver.sched.set_node_health(node_id, False)  # placement and warm hand-overs skip it
    out = DrainResult(node=node_id, state=NodeState.draining.value, previous=previous.value)
    if not migrate:
        return out
    from dsec.cluster.checkpoints import RestoreCreator

    agent = router.agents[node_id]
    for info in await agent.list():
        if info.labels.get(POOL_LABEL) == "1" and info.state.value == "ready":
            driver.sched.on_released(info.id, driver.clock())  # type: ignore[union-attr]
            await agent.destroy(info.id)
            out.pool_destroyed += 1
            continue
        try:
            uid = await tenant_uid(info.tenant or "")
            ck = await agent.checkpoint(info.id, uid)
            meta = await checkpoints.load(uid, ck.id)  # type: ignore[union-attr]
            # A fresh request id: the original's (or the bare sandbox id the driver keys a
            # create by) would answer with the old, destroyed sandbox.
            spec = SandboxSpec.model_validate(meta.spec).model_copy(update={"request_id": f"migrate-{ck.id}"})
        except errors.DSecError as e:
            out.failed[info.id] = e.message
            continue
        # Released here and not through the driver's reaper path: the sandbox lives on
        # under the same id (no "reaped" audit, the service's record stays).
        driver.sched.on_released(info.id, driver.clock())  # type: ignore[union-attr]
        try:
            await agent.destroy(info.id)
        except errors.NotFound:
            pass
        router.where.pop(info.id, None)
        try:
            new = await driver.create(spec, info.id, info.tenant or "",  # type: ignore[union-attr]
                                      via=RestoreCreator(router, RestoreSource(tenant=uid, checkpoint_id=ck.id)))
        except errors.DSecError as e:
            out.failed[info.id] = f"checkpointed as {ck.id} but not restored: {e.message}"
            log.error("migrating %s off %s: restore of %s failed: %s", info.id, node_id, ck.id, e.message)
            continue
        router.where[new.id] = new.node or ""
        out.migrated.append(Migrated(sandbox_id=new.id, from_node=node_id, to_node=new.node or "",
                                     checkpoint_id=ck.id))
        log.info("migrated %s from %s to %s (checkpoint %s)", new.id, node_id, new.node, ck.id)
    return out
