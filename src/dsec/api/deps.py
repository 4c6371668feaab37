"""FastAPI dependencies: services from ``app.state`` (no globals), tenant from the token."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from dsec.api.services import Services
from dsec.errors import PayloadTooLarge
from dsec.state.store import TenantRecord

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
PATH_PATTERN = r"^/[^\x00]*$"

_bearer = HTTPBearer(auto_error=False, description="Tenant API token (`dsec tenant add NAME`)")


async def services(request: Request) -> Services:
    return request.app.state.services


async def tenant(request: Request,
                 _cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None) -> TenantRecord:
    return request.app.state.services.auth.authenticate(request.headers.get("authorization"))


Svc = Annotated[Services, Depends(services)]
Tenant = Annotated[TenantRecord, Depends(tenant)]
SandboxId = Annotated[str, Path(pattern=ID_PATTERN, description="Sandbox id")]
FilePath = Annotated[str, Query(min_length=1, max_length=4096, pattern=PATH_PATTERN,
                                description="Absolute path inside the sandbox")]


async def read_body_limited(request: Request, limit: int) -> bytes:
    """Read a raw request body, refusing (413) past ``limit`` before buffering it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"upload of {declared} bytes exceeds the limit of {limit} bytes "
                              "(Settings.max_upload_bytes); split it or raise DSEC_MAX_UPLOAD_BYTES",
                              limit=limit)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"upload exceeds the limit of {limit} bytes (Settings.max_upload_bytes)",
                                  limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


RAW_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary"}}}}}
