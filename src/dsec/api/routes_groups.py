"""Group admission: ``POST /v1/groups`` -> n sandboxes of one spec, all or none (``dsec.api.groups``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from dsec.api.deps import Ctx
from dsec.api.groups import GroupAdmission, GroupRequest, GroupResult, QueuedGroup

router = APIRouter(prefix="/v1/groups", tags=["sandboxes"])


def admission(request: Request) -> GroupAdmission:
    adm = getattr(request.app.state, "groups", None)
    if adm is None:
        adm = request.app.state.groups = GroupAdmission(request.app.state.services.sandboxes)
    return adm  # type: ignore[no-any-return]


@router.post("", response_model=GroupResult, status_code=201,
             summary="Create n sandboxes of one spec as a gang: all admitted within the deadline, or none (429)")
async def create_group(req: GroupRequest, request: Request, ctx: Ctx) -> GroupResult:
    return await admission(request).create(ctx.tenant, req.spec, req.n, req.wait_s)


@router.get("", response_model=list[QueuedGroup], summary="Own groups waiting for room: position and ETA")
async def queued(request: Request, ctx: Ctx) -> list[QueuedGroup]:
    return admission(request).queued(ctx.tenant)
