"""File routes: raw bytes in and out (no multipart, no base64 overhead), tar for trees.

On a local node every route checks ownership before it reads a byte of the request
body, runs its blocking steps on the tenant-limited file threads (``FileGate``) and
streams: uploads go to the sandbox (or, for tar, a host spool file) as they arrive and
downloads leave in 1 MiB pieces, so the server's memory never grows with a file's size
(issue 18 #2, #3, #5). Nodes without a local root (remote agents, test doubles) get the
node protocol's buffered calls, bounded by the same limits.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from dsec.api.deps import RAW_BODY, Ctx, FilePath, RequestContext, SandboxId, read_body_limited
from dsec.api.file_gate import FileGate
from dsec.errors import InvalidArgument, PayloadTooLarge
from dsec.models import FileEntry
from dsec.node.files import CHUNK, LockedIter, OpenFile, SandboxFS

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["files"])
_OCTET = {200: {"content": {"application/octet-stream": {}}}}
NEXT_CURSOR = "x-next-cursor"


async def _owned_fs(ctx: RequestContext, sandbox_id: str) -> SandboxFS | None:
    """Ownership first (404 for anyone else's sandbox), then the sandbox's root on this
    node; None when the node has no local root (its own calls are used then)."""
    await ctx.svc.sandboxes.get(ctx.tenant, sandbox_id)
    manager = getattr(ctx.svc.node, "manager", None)
    if manager is None:
        return None
    manager.live_record(sandbox_id)
    return SandboxFS(str(manager.paths(sandbox_id).rootfs))


def _gate(request: Request) -> FileGate:
    return request.app.state.file_gate


def _check_declared(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"upload of {declared} bytes exceeds the limit of {limit} bytes "
                              "(Settings.max_upload_bytes); split it or raise DSEC_MAX_UPLOAD_BYTES", limit=limit)


async def _body_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body in pieces of about ``CHUNK`` bytes; 413 as soon as it passes ``limit``."""
    buf = bytearray()
    total = 0
    async for piece in request.stream():
        total += len(piece)
        if total > limit:
            raise PayloadTooLarge(f"upload exceeds the limit of {limit} bytes (Settings.max_upload_bytes)",
                                  limit=limit)
        buf += piece
        if len(buf) >= CHUNK:
            yield bytes(buf)
            buf.clear()
    if buf:
        yield bytes(buf)


async def _stream(gate: FileGate, tenant: str, step: Any, close: Any) -> AsyncIterator[bytes]:
    """Pieces from ``step()`` (run on a file thread) until it returns empty/None; ``close``
    runs on a file thread too (it waits for a step still running, see ``OpenFile``)."""
    try:
        while chunk := await gate.run(tenant, step):
            yield chunk
    finally:
        gate.later(close)


def _open_and_read_small(fs: SandboxFS, path: str, limit: int) -> tuple[OpenFile | None, int, bytes]:
    """(None, size, content) for a file of at most CHUNK bytes (one thread hop, the
    common case); (open file, size, b"") for a larger one, to be streamed."""
    f, size = fs.open_read(path, limit)
    if size > CHUNK:
        return f, size, b""
    try:
        return None, size, f.read_all(size)
    finally:
        f.close()


@router.get("/files", summary="Read a file", response_class=Response, responses=_OCTET)
async def read_file(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    fs = await _owned_fs(ctx, sandbox_id)
    if fs is None:
        return Response(content=await svc.sandboxes.read_file(t, sandbox_id, path),
                        media_type="application/octet-stream")
    gate = _gate(request)
    f, size, data = await gate.run(t.name, _open_and_read_small, fs, path, svc.settings.max_upload_bytes)
    if f is None:
        return Response(content=data, media_type="application/octet-stream")
    left = [size]

    def step() -> bytes:  # never more than the size announced in Content-Length
        chunk = f.read(min(CHUNK, left[0])) if left[0] > 0 else b""
        left[0] -= len(chunk)
        return chunk

    return StreamingResponse(_stream(gate, t.name, step, f.close), media_type="application/octet-stream",
                             headers={"content-length": str(size)})


@router.put("/files", status_code=204, summary="Write a file (body = raw bytes; parents are created)",
            openapi_extra=RAW_BODY)
async def write_file(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx,
                     mode: Annotated[int, Query(ge=0, le=0o7777, description="Permission bits")] = 0o644
                     ) -> Response:
    svc, t = ctx.svc, ctx.tenant
    limit = svc.settings.max_upload_bytes
    _check_declared(request, limit)
    fs = await _owned_fs(ctx, sandbox_id)
    gate = _gate(request)
    async with gate.upload(t.name):
        if fs is None:
            data = await read_body_limited(request, limit)
            await svc.sandboxes.write_file(t, sandbox_id, path, data, mode)
            return Response(status_code=204)
        f: OpenFile = await gate.run(t.name, fs.open_write, path, mode)
        digest, size = hashlib.sha256(), 0
        try:
            async for chunk in _body_chunks(request, limit):
                digest.update(chunk)
                size += len(chunk)
                await gate.run(t.name, f.write, chunk)
            await gate.run(t.name, f.finish, mode)
        except BaseException:
            gate.later(f.abandon)
            raise
    svc.audit.record(sandbox_id, t.name, "file_write", path=path, size=size, mode=oct(mode),
                     sha256=digest.hexdigest())
    return Response(status_code=204)


def _encode_cursor(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode("utf-8", "surrogateescape")).decode().rstrip("=")


def _decode_cursor(cursor: str) -> str:
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        return raw.decode("utf-8", "surrogateescape")
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"cursor {cursor!r} is not one this server issued: pass the "
                              f"{NEXT_CURSOR} header of the previous page unchanged", field="cursor") from None


@router.get("/files/list", response_model=list[FileEntry],
            summary="List a directory, one page (name order); the next page's cursor is in X-Next-Cursor",
            responses={200: {"headers": {"X-Next-Cursor": {
                "description": "Present when more entries follow: pass it as `cursor` for the next page",
                "schema": {"type": "string"}}}}})
async def list_files(sandbox_id: SandboxId, path: FilePath, request: Request, response: Response, ctx: Ctx,
                     limit: Annotated[int | None, Query(ge=1, description="Entries per page (default and "
                                                        "maximum: the server's api_list_max_entries)")] = None,
                     cursor: Annotated[str | None, Query(max_length=8192, description="X-Next-Cursor of the "
                                                         "previous page")] = None) -> list[FileEntry]:
    svc, t = ctx.svc, ctx.tenant
    page = min(limit or svc.settings.api_list_max_entries, svc.settings.api_list_max_entries)
    after = _decode_cursor(cursor) if cursor else None
    fs = await _owned_fs(ctx, sandbox_id)
    if fs is None:
        entries = [e for e in await svc.sandboxes.list_files(t, sandbox_id, path) if after is None or e.name > after]
        nxt = entries[page - 1].name if len(entries) > page else None
        entries = entries[:page]
    else:
        entries, nxt = await _gate(request).run(t.name, fs.list_page, path, page, after)
    if nxt is not None:
        response.headers[NEXT_CURSOR] = _encode_cursor(nxt)
    return entries


@router.delete("/files", status_code=204, summary="Remove a file or (recursive=true) a tree")
async def remove_file(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx,
                      recursive: bool = False) -> Response:
    svc, t = ctx.svc, ctx.tenant
    fs = await _owned_fs(ctx, sandbox_id)
    if fs is None:
        await svc.sandboxes.remove_file(t, sandbox_id, path, recursive)
        return Response(status_code=204)
    await _gate(request).run(t.name, fs.remove, path, recursive)
    svc.audit.record(sandbox_id, t.name, "file_remove", path=path, recursive=recursive)
    return Response(status_code=204)


@router.put("/tar", status_code=204, summary="Upload a tar archive, unpacked under path",
            openapi_extra=RAW_BODY)
async def upload_tar(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    limit = svc.settings.max_upload_bytes
    _check_declared(request, limit)
    fs = await _owned_fs(ctx, sandbox_id)
    gate = _gate(request)
    async with gate.upload(t.name):
        if fs is None:
            await svc.sandboxes.upload_tar(t, sandbox_id, path, await read_body_limited(request, limit))
            return Response(status_code=204)
        # Spooled to a host file (disk, not memory), then unpacked member by member.
        fd, tmp = tempfile.mkstemp(dir=svc.tmp_dir, suffix=".tar")
        spool = os.fdopen(fd, "w+b")
        try:
            digest, size = hashlib.sha256(), 0
            async for chunk in _body_chunks(request, limit):
                digest.update(chunk)
                size += len(chunk)
                await gate.run(t.name, spool.write, chunk)
            await gate.run(t.name, spool.seek, 0)
            await gate.run(t.name, fs.upload_tar_from, path, spool)
        finally:
            gate.later(spool.close)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    svc.audit.record(sandbox_id, t.name, "upload", path=path, size=size, sha256=digest.hexdigest())
    return Response(status_code=204)


@router.get("/tar", summary="Download path as a tar archive", response_class=Response, responses=_OCTET)
async def download_tar(sandbox_id: SandboxId, path: FilePath, request: Request, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    fs = await _owned_fs(ctx, sandbox_id)
    if fs is None:
        return Response(content=await svc.sandboxes.download_tar(t, sandbox_id, path),
                        media_type="application/x-tar")
    gate, limit = _gate(request), svc.settings.max_upload_bytes
    # Sizes are summed from metadata first: a tree over the limit is a clean 413 before
    # the first byte is read or sent (a 1 GiB sparse file used to be buffered whole).
    await gate.run(t.name, fs.tar_size, path, limit)
    it = LockedIter(fs.iter_tar(path, limit))
    return StreamingResponse(_stream(gate, t.name, it.next, it.close), media_type="application/x-tar")
