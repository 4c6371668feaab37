"""Sandbox checkpoints on a cluster: capture on the node that holds the sandbox, restore on
whichever node the scheduler picks; the units live in the shared checkpoint store.

The API's checkpoint routes use this in place of ``SandboxCheckpoints`` (which reads a
local node's upper dirs): ``checkpoint`` is ``NodeAgent.checkpoint`` on the sandbox's node;
a restore is a ``RestoreCreator`` — a typed create the scheduler driver runs as
``agent.create(spec, restore=...)`` on the node it placed the request on (the node
verifies and unpacks the checkpoint's layers itself). Listing, loading and deleting are
store operations, the same code as on one machine.

Every node and the API server must open the SAME checkpoint store (S3, or one shared
``DSEC_CHECKPOINT_ROOTS`` directory; ``dsec cluster up`` gives its nodes one).
"""

from __future__ import annotations

import asyncio
from typing import Any

from dsec import errors
from dsec.checkpoints.sandbox_ckpt import _BASES, SandboxCheckpoints
from dsec.config import Settings
from dsec.models import SandboxInfo, SandboxSpec
from dsec.models.checkpoint import CheckpointInfo
from dsec.node.api import NodeAgent, RestoreSource


class RestoreCreator:
    """A create that restores ``restore`` (``dsec.api.service.Creator``'s shape). The
    scheduler driver reads ``restore`` and builds it on the node it chose; called directly
    (no scheduler), the node agent (a router: its least-loaded node) builds it."""

    def __init__(self, node: NodeAgent, restore: RestoreSource) -> None:
        self.node, self.restore = node, restore

    async def __call__(self, spec: SandboxSpec, sandbox_id: str, tenant: str) -> SandboxInfo:
        return await self.node.create(spec, sandbox_id=sandbox_id or None, tenant=tenant, restore=self.restore)

    def release(self) -> None:
        """Nothing is held here (the node unpacks the layers when it builds the sandbox);
        the API calls this for a restore refused before it ran."""


class ClusterCheckpoints:
    """``SandboxCheckpoints``' API over a ``NodeAgent`` (a ``ClusterRouter``)."""

    # Store-only operations: the same code as on one machine (they read self.store).
    load = SandboxCheckpoints.load
    list = SandboxCheckpoints.list
    delete = SandboxCheckpoints.delete

    def __init__(self, settings: Settings, store: Any, node: NodeAgent) -> None:
        self.settings, self.store, self.node = settings, store, node

    async def checkpoint(self, tenant: str, sandbox_id: str) -> CheckpointInfo:
        return await self.node.checkpoint(sandbox_id, tenant)

    async def prepare_restore(self, tenant: str, checkpoint_id: str) -> tuple[SandboxSpec, RestoreCreator]:
        meta = await self.load(tenant, checkpoint_id)  # NotFound / damaged before anything is queued
        return (SandboxSpec.model_validate(meta.spec),
                RestoreCreator(self.node, RestoreSource(tenant=tenant, checkpoint_id=checkpoint_id)))

    async def forget_sandbox(self, sandbox_id: str) -> None:
        """A killed sandbox's base record (written by the node that restored it)."""
        try:
            await asyncio.to_thread(self.store.delete, _BASES + sandbox_id)
        except errors.NotFound:
            pass
