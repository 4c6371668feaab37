"""Live clones: ``POST /v1/sandboxes/{id}/clone`` -> n new sandboxes whose filesystems are
copy-on-write copies of the sandbox's at that instant (``dsec.node.clones``).

Each clone is an ordinary create of the parent's spec (same image, limits, env, labels,
network allow-list, a fresh TTL) through ``SandboxService.create``: tenant quotas, run
quotas, ownership, audit and the scheduler's queue apply to every one. All n or none: if
one create fails, the others are killed and the error is returned.

On a cluster (``dsec serve --cluster``) the parent's node is not in the server's process:
its files go through a checkpoint captured on that node and restored once per clone,
wherever the scheduler places it (slower than the copy-on-write path, same files).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from dsec.api.deps import Ctx, SandboxId
from dsec.errors import Conflict, InvalidArgument, NotFound
from dsec.models import SandboxInfo, SandboxSpec
from dsec.models.sandbox import SandboxState, without_reserved_labels
from dsec.state.store import TenantRecord

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])

_LIVE = (SandboxState.idle, SandboxState.running, SandboxState.ready)


class CloneRequest(BaseModel):
    n: int = Field(1, description="How many clones (1..clone_max)")


def clone_spec(spec: SandboxSpec, info: SandboxInfo) -> SandboxSpec:
    """The parent's request (same image, limits, env: a warm pool of that spec serves its
    clones) with its isolation as resolved, its allow-list and labels as they are now, and
    no request id (each clone is a new create)."""
    return spec.model_copy(update={"request_id": None, "isolation": info.isolation, "network": info.network,
                                   "labels": without_reserved_labels(info.labels)})


async def clone_sandbox(svc: object, tenant: TenantRecord, sandbox_id: str, n: int,
                        checkpoints: Any = None) -> list[SandboxInfo]:
    from dsec.api.service import SandboxService

    assert isinstance(svc, SandboxService)
    limit = svc.settings.clone_max
    if not 1 <= n <= limit:
        raise InvalidArgument(f"n={n}: a clone call makes 1 to {limit} sandboxes (setting clone_max)", field="n",
                              limit=limit)
    await svc._owned(tenant, sandbox_id)  # 404 for an unknown or another tenant's sandbox
    manager = getattr(svc.node, "manager", None)
    if manager is None:  # a cluster: the files travel through the shared checkpoint store
        if checkpoints is None:
            raise InvalidArgument("this server cannot clone sandboxes: it has neither a local node nor a "
                                  "checkpoint store", field="sandbox_id")
        return await _clone_through_checkpoint(svc, checkpoints, tenant, sandbox_id, n)
    try:
        rec = manager.get_record(sandbox_id)
    except NotFound:
        raise NotFound(f"sandbox {sandbox_id} not found: it never existed, was killed or expired, or belongs to "
                       "another tenant; list yours with `dsec ps`", sandbox_id=sandbox_id) from None
    if rec.info.state not in _LIVE:
        raise Conflict(f"sandbox {sandbox_id} is {rec.info.state.value}: only a live sandbox can be cloned",
                       sandbox_id=sandbox_id, state=rec.info.state.value)
    spec = clone_spec(rec.spec, rec.info)
    t0 = time.perf_counter()
    lowers, frozen = await manager.freeze_for_clone(sandbox_id)
    node = svc.node

    async def make(spec: SandboxSpec, sid: str, owner: str) -> SandboxInfo:
        return await node.create(spec, sandbox_id=sid, tenant=owner,  # type: ignore[call-arg]
                                 extra_lower_dirs=lowers)

    async def one() -> SandboxInfo:
        if rec.info.isolation != "container":  # gVisor: a cold create on the frozen layer
            return await svc.create(tenant, spec, creator=make)
        # Container tier: any sandbox of the spec (a warm pool member when one is ready: a
        # hand-over takes milliseconds), then its root is swapped in place for one over the
        # frozen layer.
        info = await svc.create(tenant, spec)
        try:
            await manager.reroot(info.id, lowers)
        except BaseException:
            await svc.kill(tenant, info.id)
            raise
        return info

    try:
        results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    finally:
        manager.unpin_layer(lowers[0])
    made = [r for r in results if isinstance(r, SandboxInfo)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # all or none: no half of a clone call is left behind
        await asyncio.gather(*(svc.kill(tenant, i.id) for i in made), return_exceptions=True)
        raise failed[0]
    svc.audit.record(sandbox_id, tenant.name, "clone", clones=[i.id for i in made], mode=frozen.mode,
                     why_copied=frozen.reason or None, paused_ms=round(frozen.paused_ms, 3), took_ms=round((time.perf_counter() - t0) * 1000, 3))
    return made


@router.post("/{sandbox_id}/clone", response_model=list[SandboxInfo], status_code=201,
             summary="n new sandboxes with copy-on-write copies of this one's files as they are now")
async def clone(sandbox_id: SandboxId, req: CloneRequest, ctx: Ctx, request: Request) -> list[SandboxInfo]:
    return await clone_sandbox(ctx.svc.sandboxes, ctx.tenant, sandbox_id, req.n,
                               getattr(request.app.state, "checkpoints", None))


async def _clone_through_checkpoint(svc: Any, checkpoints: Any, tenant: TenantRecord, sandbox_id: str,
                                    n: int) -> list[SandboxInfo]:
    """Clones where the parent's node is not in this process (``dsec serve --cluster``): a
    checkpoint captured on the parent's node, restored ``n`` times wherever the scheduler
    places each clone (same files, byte for byte; admitted and placed like any create).
    The checkpoint stays, listed with the tenant's others: each clone is "restored from"
    it, and a later checkpoint of a clone stacks on it."""
    t0 = time.perf_counter()
    ck = await checkpoints.checkpoint(tenant.uid, sandbox_id)
    live = await svc.node.get(sandbox_id)

    async def one() -> SandboxInfo:
        spec, create = await checkpoints.prepare_restore(tenant.uid, ck.id)
        try:
            return await svc.create(tenant, clone_spec(spec, live), creator=create)  # type: ignore[no-any-return]
        finally:
            create.release()

    results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    made = [r for r in results if isinstance(r, SandboxInfo)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:  # all or none, as on one machine
        await asyncio.gather(*(svc.kill(tenant, i.id) for i in made), return_exceptions=True)
        raise failed[0]
    svc.audit.record(sandbox_id, tenant.name, "clone", clones=[i.id for i in made], mode="checkpoint",
                     checkpoint_id=ck.id, took_ms=round((time.perf_counter() - t0) * 1000, 3))
    return made
