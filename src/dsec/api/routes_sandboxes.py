"""Sandbox lifecycle and exec routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from dsec.api.deps import Ctx, SandboxId
from dsec.errors import DSecError, InvalidArgument
from dsec.models import BackgroundProcess, ExecEvent, ExecRequest, ExecResult, SandboxInfo, SandboxSpec
from dsec.models.api import (
    AuditEntry,
    BulkKillRequest,
    BulkKillResult,
    ErrorLine,
    NetworkRequest,
    SignalRequest,
    TimeoutRequest,
)
from dsec.models.sandbox import parse_labels

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


def parse_label_filter(items: list[str]) -> dict[str, str]:
    return parse_labels(items, "label filter")


@router.post("", response_model=SandboxInfo, status_code=201, summary="Create a sandbox (idempotent by request_id)")
async def create(spec: SandboxSpec, ctx: Ctx) -> SandboxInfo:
    svc, t = ctx.svc, ctx.tenant
    return await svc.sandboxes.create(t, spec)


@router.get("", response_model=list[SandboxInfo], summary="List own sandboxes, filtered by labels")
async def list_(ctx: Ctx,
                label: Annotated[list[str], Query(max_length=64, description="key=value, repeatable")] = []
                ) -> list[SandboxInfo]:
    svc, t = ctx.svc, ctx.tenant
    return await svc.sandboxes.list(t, parse_label_filter(label))


@router.post("/kill", response_model=BulkKillResult, summary="Kill every own sandbox matching all labels")
async def bulk_kill(req: BulkKillRequest, ctx: Ctx) -> BulkKillResult:
    svc, t = ctx.svc, ctx.tenant
    return BulkKillResult(killed=await svc.sandboxes.kill_by_labels(t, req.labels))


@router.get("/{sandbox_id}", response_model=SandboxInfo)
async def get(sandbox_id: SandboxId, ctx: Ctx) -> Response:
    info = await ctx.svc.sandboxes.get(ctx.tenant, sandbox_id)
    return Response(info.model_dump_json(), media_type="application/json")  # skip re-validation: hot path


@router.delete("/{sandbox_id}", status_code=204, summary="Kill a sandbox (nothing is left behind)")
async def kill(sandbox_id: SandboxId, ctx: Ctx, request: Request) -> Response:
    svc, t = ctx.svc, ctx.tenant
    await svc.sandboxes.kill(t, sandbox_id)
    ckpts = request.app.state.checkpoints
    if ckpts is not None:  # a restored sandbox's base record is no longer needed
        await ckpts.forget_sandbox(sandbox_id)
    return Response(status_code=204)


@router.put("/{sandbox_id}/network", response_model=SandboxInfo,
            summary="Replace the egress allow-list of a live sandbox (host-side, immediate)")
async def update_network(sandbox_id: SandboxId, req: NetworkRequest, ctx: Ctx) -> SandboxInfo:
    svc, t = ctx.svc, ctx.tenant
    return await svc.sandboxes.update_network(t, sandbox_id, req.allow)


@router.put("/{sandbox_id}/timeout", response_model=SandboxInfo, summary="Set the wall timeout from now")
async def set_timeout(sandbox_id: SandboxId, req: TimeoutRequest, ctx: Ctx) -> SandboxInfo:
    svc, t = ctx.svc, ctx.tenant
    return await svc.sandboxes.set_timeout(t, sandbox_id, req.timeout)


@router.post("/{sandbox_id}/reset", response_model=SandboxInfo,
             summary="Reset to the image's pristine state: processes killed, files, /dev, IPC, network as created")
async def reset(sandbox_id: SandboxId, ctx: Ctx) -> Response:
    svc, t = ctx.svc.sandboxes, ctx.tenant
    await svc._owned(t, sandbox_id)
    info = await svc.node.reset(sandbox_id)
    svc.audit.record(sandbox_id, t.name, "reset")
    return Response(info.model_dump_json(), media_type="application/json")  # skip re-validation: hot path


@router.post("/{sandbox_id}/exec", response_model=ExecResult, summary="Run a command and wait for it")
async def exec_(sandbox_id: SandboxId, req: ExecRequest, ctx: Ctx) -> Response:
    res = await ctx.svc.sandboxes.exec(ctx.tenant, sandbox_id, req)
    return Response(res.model_dump_json(), media_type="application/json")  # skip re-validation: hot path


def _ndjson(events: AsyncIterator[ExecEvent]) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                yield ev.model_dump_json(exclude_none=True).encode() + b"\n"
        except DSecError as e:  # status already sent: report in-band, the SDK raises it
            yield ErrorLine(error=e.to_dict()).model_dump_json().encode() + b"\n"
    return gen()


@router.post("/{sandbox_id}/exec/stream", summary="Run a command, streaming output as NDJSON ExecEvents",
             responses={200: {"content": {"application/x-ndjson": {}}}})
async def exec_stream(sandbox_id: SandboxId, req: ExecRequest, ctx: Ctx) -> StreamingResponse:
    svc, t = ctx.svc, ctx.tenant
    if req.background:
        raise InvalidArgument("background=true cannot be streamed; use POST /exec", field="background")
    events = await svc.sandboxes.exec_stream(t, sandbox_id, req)
    return StreamingResponse(_ndjson(events), media_type="application/x-ndjson")


@router.get("/{sandbox_id}/processes", response_model=list[BackgroundProcess])
async def processes(sandbox_id: SandboxId, ctx: Ctx) -> list[BackgroundProcess]:
    svc, t = ctx.svc, ctx.tenant
    return await svc.sandboxes.processes(t, sandbox_id)


@router.post("/{sandbox_id}/processes/{pid}/signal", status_code=204)
async def signal(sandbox_id: SandboxId, pid: Annotated[int, Path(ge=1, le=2**22)], req: SignalRequest,
                 ctx: Ctx) -> Response:
    await ctx.svc.sandboxes.kill_process(ctx.tenant, sandbox_id, pid, req.signal)
    return Response(status_code=204)


@router.get("/{sandbox_id}/audit", response_model=list[AuditEntry],
            summary="Audit log (commands, files written); kept after death for the retention period")
async def audit(sandbox_id: SandboxId, ctx: Ctx,
                limit: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> list[AuditEntry]:
    svc, t = ctx.svc, ctx.tenant
    return [AuditEntry(**e) for e in await svc.sandboxes.audit_log(t, sandbox_id, limit)]
