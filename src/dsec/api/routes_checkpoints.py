"""Checkpoints of plain sandboxes: take, list, restore (into a new sandbox), delete.

The storage format and restore mechanics are ``dsec.checkpoints.sandbox_ckpt``'s; this
module adds tenancy (another tenant's sandbox or checkpoint is 404), the dead-sandbox
rule (409) and the audit trail. Restores go through ``SandboxService.create`` so they
count against quotas, honour image allow-lists and are idempotent by ``request_id``.
Checkpoints are keyed by the tenant's immutable uid (``TenantRecord.uid``), never its
name: a tenant re-created under a removed one's name sees none of its checkpoints.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from dsec.api.deps import ID_PATTERN, Ctx, RequestContext, SandboxId
from dsec.models.api import RestoreRequest
from dsec.models.checkpoint import CheckpointInfo
from dsec.checkpoints.sandbox_ckpt import CHECKPOINT_ID_PATTERN, SandboxCheckpoints
from dsec.errors import Conflict, InvalidArgument, NotFound
from dsec.models import SandboxInfo, SandboxSpec
from dsec.models.sandbox import SandboxState, without_reserved_labels

router = APIRouter(tags=["checkpoints"])
CheckpointId = Annotated[str, Path(max_length=64, description="Checkpoint id (ck-...)")]
_LIVE = (SandboxState.idle, SandboxState.running, SandboxState.ready)


def _ckpts(request: Request) -> SandboxCheckpoints:
    ck = getattr(request.app.state, "checkpoints", None)
    if ck is None:
        raise InvalidArgument("this server's node cannot checkpoint sandboxes (it has no local sandbox "
                              "manager); use a server started with `dsec serve`")
    return ck


async def _live_owned(ctx: RequestContext, sandbox_id: str) -> SandboxInfo:
    """The caller's sandbox, live; a dead one of theirs is 409, anyone else's 404."""
    try:
        info = await ctx.svc.sandboxes.get(ctx.tenant, sandbox_id)
    except NotFound:
        if await ctx.svc.state.sandbox_owner(sandbox_id) == ctx.tenant.uid:
            raise Conflict(f"sandbox {sandbox_id} is destroyed; only a live sandbox can be checkpointed "
                           "(checkpoint before killing it)", sandbox_id=sandbox_id, state="destroyed") from None
        raise
    if info.state not in _LIVE:
        raise Conflict(f"sandbox {sandbox_id} is {info.state.value}; only a live sandbox can be checkpointed "
                       "(checkpoint before killing it)", sandbox_id=sandbox_id, state=info.state.value)
    return info


@router.post("/v1/sandboxes/{sandbox_id}/checkpoints", response_model=CheckpointInfo, status_code=201,
             summary="Checkpoint a live sandbox's filesystem (restore it with POST /v1/checkpoints/{id}/restore)")
async def checkpoint(sandbox_id: SandboxId, ctx: Ctx, request: Request) -> CheckpointInfo:
    ck = _ckpts(request)
    await _live_owned(ctx, sandbox_id)
    info = await ck.checkpoint(ctx.tenant.uid, sandbox_id)
    ctx.svc.audit.record(sandbox_id, ctx.tenant.name, "checkpoint", checkpoint_id=info.id,
                         fs_digest=info.fs_digest, size=info.size)
    return info


@router.get("/v1/sandboxes/{sandbox_id}/checkpoints", response_model=list[CheckpointInfo],
            summary="Checkpoints taken of one of your sandboxes (also after it died)")
async def sandbox_checkpoints(sandbox_id: SandboxId, ctx: Ctx, request: Request) -> list[CheckpointInfo]:
    return await _ckpts(request).list(ctx.tenant.uid, sandbox_id)


@router.get("/v1/checkpoints", response_model=list[CheckpointInfo], summary="Your checkpoints, oldest first")
async def list_checkpoints(ctx: Ctx, request: Request,
                           sandbox_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None
                           ) -> list[CheckpointInfo]:
    return await _ckpts(request).list(ctx.tenant.uid, sandbox_id)


@router.get("/v1/checkpoints/{checkpoint_id}", response_model=CheckpointInfo)
async def get_checkpoint(checkpoint_id: CheckpointId, ctx: Ctx, request: Request) -> CheckpointInfo:
    from dsec.checkpoints.sandbox_ckpt import info_of
    return info_of(await _ckpts(request).load(ctx.tenant.uid, checkpoint_id))


@router.post("/v1/checkpoints/{checkpoint_id}/restore", response_model=SandboxInfo, status_code=201,
             summary="A NEW sandbox from a checkpoint: same image, resources, env, files (byte for byte)")
async def restore(checkpoint_id: CheckpointId, req: RestoreRequest, ctx: Ctx, request: Request) -> SandboxInfo:
    ck = _ckpts(request)
    spec, create = await ck.prepare_restore(ctx.tenant.uid, checkpoint_id)
    fields = spec.model_dump(exclude_none=True)
    fields["labels"] = without_reserved_labels(spec.labels)
    for k in ("labels", "timeout", "request_id"):
        if getattr(req, k) is not None:
            fields[k] = getattr(req, k)
    try:
        info = await ctx.svc.sandboxes.create(ctx.tenant, SandboxSpec.model_validate(fields), creator=create)
    finally:
        create.release()  # refused before it ran (quota, 429): its unpacked layers may go
    ctx.svc.audit.record(info.id, ctx.tenant.name, "restore", checkpoint_id=checkpoint_id)
    return info


@router.delete("/v1/checkpoints/{checkpoint_id}", status_code=204,
               summary="Delete a checkpoint (sandboxes restored from it keep running)")
async def delete_checkpoint(checkpoint_id: CheckpointId, ctx: Ctx, request: Request) -> Response:
    await _ckpts(request).delete(ctx.tenant.uid, checkpoint_id)
    return Response(status_code=204)


__all__ = ["CHECKPOINT_ID_PATTERN", "router"]
