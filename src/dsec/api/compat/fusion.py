"""SandboxFusion compatibility: ``POST /run_code`` and ``GET /v1/ping`` with SandboxFusion's
request and response schema, for the unmodified ``sandbox-fusion`` client and verl's
``verl.utils.reward_score.sandbox_fusion`` code reward.

These clients send no auth header, so the credential is in the URL: each tenant has a
fusion key derived from its token hash (``fusion_key``), and its endpoint is
``<server>/fusion/<key>`` (``dsec serve`` writes the local tenant's as ``fusion_url`` in
``server.json``; any tenant gets its own from ``GET /v1/fusion``). Re-issuing a token
changes the key. Un-keyed ``/fusion/run_code`` answers only when an operator names a
tenant in ``DSEC_FUSION_ANONYMOUS_TENANT`` (off by default).

Each call runs in a sandbox of its own from a pool of reset-able sandboxes per (tenant,
language image, memory) (``fusion_pool``): code and ``files`` are written under
``/work``, the program is compiled (cpp) and run with ``stdin``, ``fetch_files`` are read
back, and the sandbox is reset before anyone else gets it. Bad input (unknown language,
``..`` in file names, oversized bodies, invalid base64) is answered in the client's own
schema: ``status: SandboxError`` with a message naming what was wrong.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import inspect
import io
import logging
import posixpath
import tarfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec.api.compat.fusion_pool import FusionPools
from dsec.api.deps import Ctx
from dsec.api.services import Services
from dsec.errors import DSecError, NotFound
from dsec.models import ExecRequest, ExecResult
from dsec.state.store import TenantRecord

log = logging.getLogger("dsec.fusion")

PREFIX = "/fusion"
WORKDIR = "/work"
KEY_REFRESH_S = 1.0
"""A miss on an unknown fusion key re-reads the tenant list at most this often."""
TENANT_CACHE_S = 2.0
"""A verified key -> tenant answer is reused this long (no state read per call)."""


async def _state(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a StateStore method whether it is sync (SQLite) or async (the async store)."""
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


# --- schema (SandboxFusion's, field names kept as they are) ------------------------------


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str
    language: str
    compile_timeout: float = 10
    run_timeout: float = 10
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    memory_limit_MB: int = -1  # SandboxFusion's field name


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class Language:
    source: str
    compile: tuple[str, ...] | None
    run: tuple[str, ...]


LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", None, ("python3", "main.py")),
    "bash": Language("main.sh", None, ("bash", "main.sh")),
    "cpp": Language("main.cpp", ("g++", "-std=c++17", "-O2", "-o", "main", "main.cpp"), ("./main",)),
    "nodejs": Language("main.js", None, ("node", "main.js")),
    "go": Language("main.go", ("go", "build", "-o", "main", "main.go"), ("./main",)),
    "java": Language("Main.java", ("javac", "Main.java"), ("java", "Main")),
}


class FusionInputError(ValueError):
    """Bad request content: answered as SandboxError with this message."""


# --- pure decisions --------------------------------------------------------------------


def fusion_key(token_hash: str) -> str:
    """The per-tenant URL credential: derived from the stored token hash (so the server
    never needs the token) and not the hash itself (which never leaves the state store)."""
    return hashlib.sha256(b"dsec-fusion\0" + token_hash.encode()).hexdigest()[:40]


def fusion_url(base_url: str, token_hash: str) -> str:
    return f"{base_url.rstrip('/')}{PREFIX}/{fusion_key(token_hash)}"


def supported_languages(images: dict[str, str]) -> list[str]:
    return [name for name in LANGUAGES if name in images]


def sandbox_path(name: str) -> str:
    """Where a ``files`` / ``fetch_files`` name lives in the sandbox: relative names under
    the work dir, absolute ones as given; ``..`` anywhere is refused."""
    if not name or "\0" in name or len(name) > 4096:
        raise FusionInputError(f"file name {name[:100]!r} is empty, too long or contains NUL")
    if ".." in name.split("/"):
        raise FusionInputError(f"file name {name!r} contains '..'; use a path inside the working directory")
    full = posixpath.normpath(name if name.startswith("/") else posixpath.join(WORKDIR, name))
    if full == "/":
        raise FusionInputError(f"file name {name!r} names the root directory")
    return full


def build_upload(req: RunCodeRequest, lang: Language) -> bytes:
    """One tar (extracted at /) with the source file and the request's ``files``."""
    entries: dict[str, bytes] = {}
    for name, content in req.files.items():
        if content is None:
            continue
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise FusionInputError(f"files[{name!r}] is not valid base64") from None
        entries[sandbox_path(name)] = data
    entries[f"{WORKDIR}/{lang.source}"] = req.code.encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for path, data in entries.items():
            ti = tarfile.TarInfo(path.lstrip("/"))
            ti.size, ti.mode, ti.mtime = len(data), 0o644, int(time.time())
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def clamp_timeout(value: float, default: float, ceiling: float) -> float:
    if value is None or value <= 0:
        return default
    return min(float(value), ceiling)


def memory_mb(requested: int, default: int) -> int:
    return default if requested is None or requested <= 0 else max(16, int(requested))


def command_result(res: ExecResult, limit: int) -> CommandRunResult:
    if res.timed_out:
        status: Literal["Finished", "Error", "TimeLimitExceeded"] = "TimeLimitExceeded"
    else:
        status = "Finished"
    stdout, stderr = res.stdout, res.stderr
    if len(stdout) > limit or len(stderr) > limit or res.truncated:
        stdout, stderr = stdout[:limit], stderr[:limit] + f"\n[dsec: output truncated at {limit} bytes]"
    return CommandRunResult(status=status, execution_time=round(res.duration, 6),
                            return_code=None if res.timed_out else res.exit_code, stdout=stdout, stderr=stderr)


def overall(compile_result: CommandRunResult | None, run_result: CommandRunResult | None
            ) -> tuple[Literal["Success", "Failed"], str]:
    if compile_result is not None and (compile_result.status != "Finished" or compile_result.return_code != 0):
        return "Failed", "compile error" if compile_result.status == "Finished" else "compile timeout"
    assert run_result is not None
    if run_result.status == "TimeLimitExceeded":
        return "Failed", "run timeout"
    if run_result.return_code != 0:
        return "Failed", f"exited with code {run_result.return_code}"
    return "Success", ""


def sandbox_error(message: str) -> RunCodeResponse:
    return RunCodeResponse(status="SandboxError", message=message)


# --- the service ---------------------------------------------------------------------


class FusionService:
    def __init__(self, services: Services) -> None:
        self.svc = services
        self.settings = services.settings
        self.pools = FusionPools(services)
        self._keys: dict[str, str] = {}  # fusion key -> tenant name
        self._keys_read = -1e9
        self._keys_lock = asyncio.Lock()
        self._verified: dict[str | None, tuple[TenantRecord, float]] = {}
        self._builds: dict[str, asyncio.Task[None]] = {}
        self._build_log: dict[str, str] = {}

    # auth
    async def tenant_for_key(self, key: str | None) -> TenantRecord | None:
        """The tenant a fusion key (None: the anonymous tenant, if configured) stands for.
        Verified records are trusted for TENANT_CACHE_S (a token re-issue or removal takes
        effect within that)."""
        now = time.monotonic()
        hit = self._verified.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        if key is None:
            name = self.settings.fusion_anonymous_tenant
            rec = await _state(self.svc.state.get_tenant, name) if name else None
        else:
            name = self._keys.get(key)
            if name is None:
                # One re-read at a time; callers that queued behind it see its result (a
                # burst of first calls must not be refused while the first one reads).
                async with self._keys_lock:
                    name = self._keys.get(key)
                    if name is None and time.monotonic() - self._keys_read > KEY_REFRESH_S:
                        keys = {fusion_key(t.token_hash): t.name for t in await _state(self.svc.state.list_tenants)}
                        self._keys, self._keys_read = keys, time.monotonic()
                        name = keys.get(key)
            rec = await _state(self.svc.state.get_tenant, name) if name is not None else None
            if rec is not None and fusion_key(rec.token_hash) != key:  # token re-issued / tenant removed
                self._keys.pop(key, None)
                rec = None
        if rec is not None:
            if len(self._verified) > 4096:
                self._verified.clear()
            self._verified[key] = (rec, now + TENANT_CACHE_S)
        return rec

    # run_code
    async def run_code(self, tenant: TenantRecord, req: RunCodeRequest) -> RunCodeResponse:
        s = self.settings
        langs = supported_languages(s.fusion_images)
        lang = LANGUAGES.get(req.language) if req.language in langs else None
        if lang is None:
            return sandbox_error(f"unsupported language {req.language!r}; this server runs: {', '.join(langs)} "
                                 "(an operator maps more with DSEC_FUSION_IMAGES)")
        try:
            upload = build_upload(req, lang)
            fetch = [(name, sandbox_path(name)) for name in req.fetch_files]
        except FusionInputError as e:
            return sandbox_error(str(e))
        image = s.fusion_images[req.language]
        compile_t = clamp_timeout(req.compile_timeout, 10.0, s.fusion_max_timeout_s)
        run_t = clamp_timeout(req.run_timeout, 10.0, s.fusion_max_timeout_s)
        mem = memory_mb(req.memory_limit_MB, s.fusion_memory_mb)
        try:
            async with self.pools.sandbox(tenant, image, mem) as sid:
                return await self._run_in(tenant, sid, lang, upload, fetch, req.stdin, compile_t, run_t)
        except NotFound as e:
            if e.details.get("image") or "image" in e.message:
                return sandbox_error(self._image_missing(image, e))
            return sandbox_error(e.message)
        except DSecError as e:
            return sandbox_error(f"{e.code}: {e.message}")

    async def _run_in(self, tenant: TenantRecord, sid: str, lang: Language, upload: bytes,
                      fetch: list[tuple[str, str]], stdin: str | None, compile_t: float,
                      run_t: float) -> RunCodeResponse:
        sb, limit = self.svc.sandboxes, self.settings.fusion_max_output_bytes
        await sb.upload_tar(tenant, sid, "/", upload)
        compile_result = None
        if lang.compile is not None:
            res = await sb.exec(tenant, sid, ExecRequest(cmd=list(lang.compile), timeout=compile_t, cwd=WORKDIR))
            compile_result = command_result(res, limit)
            if compile_result.status != "Finished" or compile_result.return_code != 0:
                status, msg = overall(compile_result, None)
                return RunCodeResponse(status=status, message=msg, compile_result=compile_result,
                                       executor_pod_name=sid)
        res = await sb.exec(tenant, sid, ExecRequest(cmd=list(lang.run), timeout=run_t, cwd=WORKDIR,
                                                     stdin=stdin))
        run_result = command_result(res, limit)
        files: dict[str, str] = {}
        for name, path in fetch:
            try:
                files[name] = base64.b64encode(await sb.read_file(tenant, sid, path)).decode()
            except DSecError:
                continue  # like SandboxFusion: a file the program did not make is left out
        status, msg = overall(compile_result, run_result)
        return RunCodeResponse(status=status, message=msg, compile_result=compile_result, run_result=run_result,
                               executor_pod_name=sid, files=files)

    def _image_missing(self, image: str, err: DSecError) -> str:
        """A stock image not built yet is built now, in the background (first use of cpp)."""
        from dsec.images.stock import LAZY_STOCK, STOCK

        name = image.split(":")[0]
        store = getattr(self.svc.node, "images", None)
        if (name not in STOCK and name not in LAZY_STOCK) or store is None:
            return f"{err.message} (build or import image {image!r} on the server)"
        task = self._builds.get(name)
        if task is None or (task.done() and task.exception() is not None):
            from dsec.images.stock import ensure_stock

            def build() -> None:
                ensure_stock(store, only=[name], log=lambda m: self._build_log.__setitem__(name, m))

            self._build_log[name] = "starting"
            self._builds[name] = task = asyncio.get_running_loop().create_task(asyncio.to_thread(build))
        if task.done() and task.exception() is not None:
            return f"building image {image!r} failed: {task.exception()}"
        return (f"image {image!r} is being built on first use (a few minutes, once); retry later. "
                f"progress: {self._build_log.get(name, '')}")


# --- HTTP ------------------------------------------------------------------------------


def _json(model: BaseModel, status: int = 200, close: bool = False) -> Response:
    headers = {"connection": "close"} if close else None
    return Response(model.model_dump_json(), status_code=status, media_type="application/json", headers=headers)


async def _read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes ``limit`` (the rest is not read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def fusion_router(fusion: FusionService) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def keyed(fn: Callable[[TenantRecord, Request], Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            key = request.path_params.get("key")
            tenant = await fusion.tenant_for_key(key)
            if tenant is None:
                what = "unknown fusion key" if key else "anonymous run_code is off (DSEC_FUSION_ANONYMOUS_TENANT)"
                return JSONResponse({"code": "unauthorized", "message": f"{what}: use the fusion_url from "
                                     "server.json or GET /v1/fusion"}, status_code=401,
                                    headers={"connection": "close"})
            return await fn(tenant, request)
        return handler

    async def ping(_: TenantRecord, __: Request) -> Response:
        return JSONResponse("pong")

    async def run_code(tenant: TenantRecord, request: Request) -> Response:
        limit = fusion.settings.fusion_max_request_bytes
        raw = await _read_limited(request, limit)
        if raw is None:
            return _json(sandbox_error(f"request body exceeds {limit} bytes (code + stdin + files; "
                                       "DSEC_FUSION_MAX_REQUEST_BYTES)"), close=True)
        try:
            req = RunCodeRequest.model_validate_json(raw)
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(str(p) for p in x['loc'])}: {x['msg']}" for x in e.errors()[:5])
            return _json(sandbox_error(f"invalid run_code request: {errs}"))
        t0 = time.perf_counter()
        resp = await fusion.run_code(tenant, req)
        log.debug("run_code %s %s in %.1f ms", req.language, resp.status, (time.perf_counter() - t0) * 1000)
        return _json(resp)

    for prefix in (f"{PREFIX}/{{key}}", PREFIX):
        router.add_api_route(f"{prefix}/v1/ping", keyed(ping), methods=["GET"])
        router.add_api_route(f"{prefix}/run_code", keyed(run_code), methods=["POST"])
    return router


def info_router(fusion: FusionService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["compat"])

    @router.get("/fusion", summary="This tenant's SandboxFusion endpoint (no auth header needed there)")
    async def info(ctx: Ctx, request: Request) -> dict[str, Any]:
        base = str(request.base_url).rstrip("/")
        return {"fusion_url": fusion_url(base, ctx.tenant.token_hash),
                "languages": supported_languages(fusion.settings.fusion_images), "pools": fusion.pools.stats()}

    return router


def install_fusion(app: FastAPI, services: Services) -> FusionService:
    """Register ``/fusion/<key>/run_code``, ``/fusion/<key>/v1/ping`` and ``GET /v1/fusion``."""
    fusion = FusionService(services)
    app.include_router(fusion_router(fusion))
    app.include_router(info_router(fusion))
    return fusion


def server_json_entry(base_url: str, token_hash: str) -> dict[str, str]:
    """``fusion_url`` for server.json (the local tenant's)."""
    return {"fusion_url": fusion_url(base_url, token_hash)}


__all__ = ["FusionService", "RunCodeRequest", "RunCodeResponse", "fusion_url", "install_fusion"]
