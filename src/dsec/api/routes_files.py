"""File routes: raw bytes in and out (no multipart, no base64 overhead), tar for trees."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from dsec.api.deps import RAW_BODY, Ctx, FilePath, SandboxId, read_body_limited
from dsec.models import FileEntry

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["files"])
_OCTET = {200: {"content": {"application/octet-stream": {}}}}


@router.get("/files", summary="Read a file", response_class=Response, responses=_OCTET)
async def read_file(sandbox_id: SandboxId, path: FilePath, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    data = await svc.sandboxes.read_file(t, sandbox_id, path)
    return Response(content=data, media_type="application/octet-stream")


@router.put("/files", status_code=204, summary="Write a file (body = raw bytes; parents are created)",
            openapi_extra=RAW_BODY)
async def write_file(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx,
                     mode: Annotated[int, Query(ge=0, le=0o7777, description="Permission bits")] = 0o644
                     ) -> Response:
    svc, t = ctx.svc, ctx.tenant
    data = await read_body_limited(request, svc.settings.max_upload_bytes)
    await svc.sandboxes.write_file(t, sandbox_id, path, data, mode)
    return Response(status_code=204)


@router.get("/files/list", response_model=list[FileEntry], summary="List a directory")
async def list_files(sandbox_id: SandboxId, path: FilePath, ctx: Ctx) -> list[FileEntry]:
    svc, t = ctx.svc, ctx.tenant
    return await svc.sandboxes.list_files(t, sandbox_id, path)


@router.delete("/files", status_code=204, summary="Remove a file or (recursive=true) a tree")
async def remove_file(sandbox_id: SandboxId, path: FilePath, ctx: Ctx,
                      recursive: bool = False) -> Response:
    svc, t = ctx.svc, ctx.tenant
    await svc.sandboxes.remove_file(t, sandbox_id, path, recursive)
    return Response(status_code=204)


@router.put("/tar", status_code=204, summary="Upload a tar archive, unpacked under path",
            openapi_extra=RAW_BODY)
async def upload_tar(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    data = await read_body_limited(request, svc.settings.max_upload_bytes)
    await svc.sandboxes.upload_tar(t, sandbox_id, path, data)
    return Response(status_code=204)


@router.get("/tar", summary="Download path as a tar archive", response_class=Response, responses=_OCTET)
async def download_tar(sandbox_id: SandboxId, path: FilePath, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    data = await svc.sandboxes.download_tar(t, sandbox_id, path)
    return Response(content=data, media_type="application/x-tar")
