"""E2B SDK compatibility: the unmodified ``e2b`` 2.x package (sync and async) runs against
``dsec serve`` with ``E2B_API_URL=<url>/e2b`` and ``E2B_SANDBOX_URL=<url>/e2b/envd`` (both
written to ``server.json`` as ``e2b_api_url`` / ``e2b_sandbox_url``) and ``E2B_API_KEY`` =
a DSec tenant token.

Two front ends, both thin: every operation goes through ``SandboxService`` exactly like
the native routes (tenancy, image allow-lists, quotas, audit, metrics):

- the E2B control-plane REST API under ``/e2b`` (create, connect, list, get, kill,
  set_timeout), authenticated by ``X-API-Key`` = a tenant token;
- envd (the in-sandbox agent E2B talks to) under ``/e2b/envd``: ``/health``, ``/files``
  and the Connect-RPC process and filesystem services. With ``E2B_SANDBOX_URL`` set the
  SDK sends every sandbox request to that one URL and names the sandbox in the
  ``E2b-Sandbox-Id`` header; ``X-Access-Token`` carries the per-sandbox envd token the
  create/connect answer handed out (``e2b_wire.envd_token``).

Both authenticate before reading a byte of the body, and read bodies with a bound. A
sandbox of another tenant is 404 (REST) / "was not found" (envd), like a missing one.
Commands: each ``commands.run`` is one streamed exec; as in E2B a command outlives its
stream (a disconnected client can ``commands.connect`` again, ``commands.kill`` it) and
ends at its exit, its timeout (enforced: the command is killed), a kill, or its sandbox's
end. PTY, stdin streaming and directory watches answer ``unimplemented``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import re
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from dsec.api.compat import e2b_wire as w
from dsec.api.deps import ID_PATTERN, read_body_limited
from dsec.api.errors import validation_error
from dsec.api.services import Services
from dsec.errors import DSecError, InvalidArgument, NotFound, Unauthorized
from dsec.models import ExecEvent, ExecRequest, SandboxInfo, SandboxSpec
from dsec.models.sandbox import SandboxState
from dsec.state.store import TenantRecord

API_PREFIX = "/e2b"
ENVD_PREFIX = "/e2b/envd"
MAX_JSON_BODY = 1 << 20
KEEPALIVE_S = 50.0
"""Default seconds between keepalive events on a quiet command stream (the SDK asks with
``Keepalive-Ping-Interval``)."""
ATTACH_GRACE_S = 10.0
"""A command whose response stream has not started this long after it was answered is
treated as detached (its client vanished before the body began)."""
TOKEN_CACHE_S = 30.0
"""How long a verified envd token is trusted without re-reading its tenant record."""
MAX_LIST_ENTRIES = 10_000
"""``files.list(depth>1)`` stops with an error past this many entries."""

_ID = re.compile(ID_PATTERN)
_DEAD = {SandboxState.stopping, SandboxState.stopped, SandboxState.destroyed, SandboxState.failed}
_STREAM_END = object()


def e2b_urls(base_url: str) -> dict[str, str]:
    """The ``server.json`` entries the E2B SDK is pointed at (``E2B_API_URL``,
    ``E2B_SANDBOX_URL``)."""
    return {"e2b_api_url": base_url + API_PREFIX, "e2b_sandbox_url": base_url + ENVD_PREFIX}


async def _tenant_from_api_key(svc: Services, request: Request) -> TenantRecord:
    key = request.headers.get("x-api-key")
    if not key:
        auth = request.headers.get("authorization")
        if auth:
            return await svc.auth.authenticate(auth)
        raise Unauthorized("missing X-API-Key: set E2B_API_KEY to a DSec tenant token "
                           "(`dsec tenant add NAME`, or DSEC_HOME/token on the embedded server)")
    return await svc.auth.authenticate("Bearer " + key)


def _http_error_response(err: DSecError, retry_after: float) -> JSONResponse:
    status, body = w.http_error(err)
    headers = {}
    if status in (429, 503):
        headers["Retry-After"] = str(max(1, int(float(err.details.get("retry_after", retry_after)) + 0.999)))
    return JSONResponse(body, status_code=status, headers=headers)


def _validated(model: Any, raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise validation_error(list(e.errors())) from None


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidArgument(f"path {path!r} must be absolute (DSec has no per-user home directory); "
                              "write e.g. /root/" + path.lstrip("./"), field="path", path=path)
    return path


# --- control plane (REST) ---------------------------------------------------------------

def rest_router() -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, include_in_schema=False)

    def endpoint(fn: Callable[[Services, TenantRecord, Request], Awaitable[Response]]
                 ) -> Callable[[Request], Awaitable[Response]]:
        """Authenticate first (before any body is read), map DSec errors to E2B's shape."""

        async def handler(request: Request) -> Response:
            svc: Services = request.app.state.services
            try:
                return await fn(svc, await _tenant_from_api_key(svc, request), request)
            except DSecError as e:
                return _http_error_response(e, svc.settings.api_retry_after_s)
        handler.__name__ = fn.__name__
        return handler

    def sandbox_id(request: Request) -> str:
        sid = request.path_params["sandbox_id"]
        if not _ID.match(sid):
            raise NotFound(f"sandbox {sid!r} not found", sandbox_id=sid)
        return sid

    async def live(svc: Services, tenant: TenantRecord, sid: str) -> SandboxInfo:
        info = await svc.sandboxes.get(tenant, sid)
        if info.state in _DEAD:
            raise NotFound(f"sandbox {sid} not found: it was killed or expired", sandbox_id=sid)
        return info

    async def create(svc: Services, tenant: TenantRecord, request: Request) -> Response:
        body: w.NewSandbox = _validated(w.NewSandbox, await read_body_limited(request, MAX_JSON_BODY))
        if bad := w.unsupported_create_fields(body):
            raise InvalidArgument(f"not supported by DSec: {', '.join(bad)}", fields=bad)
        try:
            spec = SandboxSpec(image=body.templateID, timeout=body.timeout, labels=body.metadata or {},
                               env=body.envVars or {}, request_id=request.headers.get("idempotency-key"))
        except ValidationError as e:
            raise validation_error(list(e.errors())) from None
        info = await svc.sandboxes.create(tenant, spec)
        token = w.envd_token(tenant.name, tenant.token_hash, info.id)
        return JSONResponse(w.created_json(info, token), status_code=201)

    async def connect(svc: Services, tenant: TenantRecord, request: Request) -> Response:
        sid = sandbox_id(request)
        body: w.ConnectBody = _validated(w.ConnectBody, await read_body_limited(request, MAX_JSON_BODY))
        info = await live(svc, tenant, sid)
        # E2B: a running sandbox's timeout only ever grows on connect.
        if body.timeout and time.time() + body.timeout > (info.expires_at or 0.0):
            info = await svc.sandboxes.set_timeout(tenant, sid, float(body.timeout))
        return JSONResponse(w.created_json(info, w.envd_token(tenant.name, tenant.token_hash, sid)))

    async def list_(svc: Services, tenant: TenantRecord, request: Request) -> Response:
        q = request.query_params
        states = {s for s in (q.get("state") or "running").split(",") if s}
        labels = w.parse_metadata_query(q.get("metadata"))
        limit = q.get("limit")
        if limit is not None and (not limit.isdigit() or not 1 <= int(limit) <= 10_000):
            raise InvalidArgument(f"limit must be an integer in 1..10000, got {limit!r}", field="limit")
        infos = [] if "running" not in states else await svc.sandboxes.list(tenant, labels)
        out = [w.detail_json(i) for i in sorted(infos, key=lambda i: i.created_at) if i.state not in _DEAD]
        if q.get("order") == "desc":
            out.reverse()
        return JSONResponse(out[:int(limit)] if limit else out)

    async def get(svc: Services, tenant: TenantRecord, request: Request) -> Response:
        sid = sandbox_id(request)
        info = await live(svc, tenant, sid)
        return JSONResponse({**w.detail_json(info),
                             "envdAccessToken": w.envd_token(tenant.name, tenant.token_hash, sid)})

    async def kill(svc: Services, tenant: TenantRecord, request: Request) -> Response:
        sid = sandbox_id(request)
        await live(svc, tenant, sid)
        await svc.sandboxes.kill(tenant, sid)
        ckpts = getattr(request.app.state, "checkpoints", None)
        if ckpts is not None:  # as the native DELETE: a restored sandbox's base record goes too
            await ckpts.forget_sandbox(sid)
        return Response(status_code=204)

    async def set_timeout(svc: Services, tenant: TenantRecord, request: Request) -> Response:
        sid = sandbox_id(request)
        body: w.TimeoutBody = _validated(w.TimeoutBody, await read_body_limited(request, MAX_JSON_BODY))
        if body.timeout == 0:
            raise InvalidArgument("timeout must be at least 1 second", field="timeout")
        await live(svc, tenant, sid)
        await svc.sandboxes.set_timeout(tenant, sid, float(body.timeout))
        return Response(status_code=204)

    for path, method, fn in [("/v2/sandboxes", "POST", create), ("/sandboxes", "POST", create),
                             ("/v2/sandboxes", "GET", list_), ("/sandboxes", "GET", list_),
                             ("/sandboxes/{sandbox_id}", "GET", get), ("/sandboxes/{sandbox_id}", "DELETE", kill),
                             ("/sandboxes/{sandbox_id}/timeout", "POST", set_timeout),
                             ("/v2/sandboxes/{sandbox_id}/connect", "POST", connect),
                             ("/sandboxes/{sandbox_id}/connect", "POST", connect)]:
        router.add_api_route(path, endpoint(fn), methods=[method])
    return router


# --- envd: processes --------------------------------------------------------------------

@dataclass(eq=False)
class _Command:
    """One E2B command: a streamed exec through the service, pumped into a bounded queue
    (backpressure on output floods), so that it outlives its stream as in E2B: when the
    client goes away the output is drained and the command runs on until it exits, times
    out, is killed (``SendSignal``) or its sandbox ends; ``Connect`` re-attaches to it."""

    pid: int
    tenant: str
    sandbox_id: str
    config: w.ProcessConfig
    queue: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(maxsize=64))
    task: asyncio.Task[None] | None = None
    signal: int | None = None
    attached: bool = False
    started: bool = False  # the attached client's stream body has begun
    attachments: int = 0
    drainer: asyncio.Task[None] | None = None


async def _pump(events: AsyncIterator[ExecEvent], queue: asyncio.Queue[Any]) -> None:
    try:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for ev in events:
                await queue.put(ev)
    except DSecError as e:
        await queue.put(e)
    finally:
        # Also after a cancel (kill): the reader must learn the stream ended.
        await queue.put(_STREAM_END)


class EnvdService:
    """envd over Connect + HTTP, backed by ``SandboxService``."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc
        self._tokens: dict[tuple[str, str], tuple[TenantRecord, float]] = {}
        self._commands: dict[tuple[str, int], _Command] = {}
        self._pids = itertools.count(1000)

    # --- auth -----------------------------------------------------------------------------
    async def authenticate(self, request: Request) -> tuple[TenantRecord, str]:
        """(tenant, sandbox id) from ``E2b-Sandbox-Id`` + ``X-Access-Token``; nothing of
        the body is read before this passes."""
        sid = request.headers.get("e2b-sandbox-id") or ""
        if not _ID.match(sid):
            raise InvalidArgument("missing or malformed E2b-Sandbox-Id header", field="E2b-Sandbox-Id")
        token = request.headers.get("x-access-token")
        if not token:
            raise Unauthorized("missing X-Access-Token: use the envdAccessToken of the create/connect answer")
        now = time.monotonic()
        hit = self._tokens.get((sid, token))
        if hit is not None and hit[1] > now:
            return hit[0], sid
        name = w.envd_token_tenant(token)
        rec = await self.svc.state.get_tenant(name) if name else None
        if rec is None or not w.envd_token_valid(token, rec.name, rec.token_hash, sid):
            raise Unauthorized(f"invalid envd access token for sandbox {sid}")
        if len(self._tokens) > 100_000:
            self._tokens.clear()
        self._tokens[(sid, token)] = (rec, now + TOKEN_CACHE_S)
        return rec, sid

    # --- HTTP endpoints ---------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        try:
            tenant, sid = await self.authenticate(request)
            info = await self.svc.sandboxes.get(tenant, sid)
            if info.state in _DEAD:
                raise NotFound(f"sandbox {sid} is {info.state.value}", sandbox_id=sid)
        except DSecError as e:
            return self._http_error(e, request)
        return Response(status_code=204)

    def _http_error(self, err: DSecError, request: Request) -> Response:
        if w.is_sandbox_missing(err):  # what E2B's proxy answers for a dead sandbox
            sid = request.headers.get("e2b-sandbox-id", "")
            return JSONResponse({"code": 502, "message": w.sandbox_gone_message(sid)}, status_code=502)
        return _http_error_response(err, self.svc.settings.api_retry_after_s)

    async def read_file(self, request: Request) -> Response:
        try:
            tenant, sid = await self.authenticate(request)
            path = _absolute(request.query_params.get("path") or "")
            data = await self.svc.sandboxes.read_file(tenant, sid, path)
        except DSecError as e:
            return self._http_error(e, request)
        return Response(data, media_type="application/octet-stream")

    async def write_files(self, request: Request) -> Response:
        try:
            tenant, sid = await self.authenticate(request)
            if request.headers.get("content-encoding", "identity") != "identity":
                raise InvalidArgument("compressed uploads are not supported: write without gzip",
                                      field="Content-Encoding")
            ctype = request.headers.get("content-type", "")
            limit = self.svc.settings.max_upload_bytes
            query_path = request.query_params.get("path")
            if not ctype.startswith("multipart/form-data") and not query_path:
                raise InvalidArgument("missing ?path= for an octet-stream upload", field="path")
            # The body is buffered (up to max_upload_bytes): hold one of the tenant's upload
            # slots while it is, as the native upload routes do (issue 18 #5), so a tenant's
            # many stalled uploads cannot pile the server's memory up.
            async with request.app.state.file_gate.upload(tenant.name):
                if ctype.startswith("multipart/form-data"):
                    # Multipart framing adds a few hundred bytes per file on top of the data.
                    body = await read_body_limited(request, limit + 64 * 1024)
                    files = w.parse_multipart(body, ctype)
                    if len(files) == 1 and query_path:
                        files = [(query_path, files[0][1])]
                else:
                    files = [(str(query_path), await read_body_limited(request, limit))]
                out = []
                for path, data in files:
                    await self.svc.sandboxes.write_file(tenant, sid, _absolute(path), data, 0o644)
                    out.append(w.write_info(path))
        except DSecError as e:
            return self._http_error(e, request)
        return JSONResponse(out)

    # --- Connect RPC ------------------------------------------------------------------------
    async def rpc(self, request: Request) -> Response:
        method = f"{request.path_params['service']}/{request.path_params['method']}"
        stream = _STREAMS.get(method)
        unary = _UNARY.get(method)
        sid = ""
        in_stream = False  # errors before the body is read answer with an HTTP status, even for streams
        try:
            tenant, sid = await self.authenticate(request)
            ctype = request.headers.get("content-type", "").split(";")[0].strip()
            want = "application/connect+json" if stream else "application/json"
            if (stream or unary) and ctype != want:
                return JSONResponse({"code": "unimplemented",
                                     "message": f"content type {ctype!r} not supported here: only {want} "
                                                "(the JSON codec the E2B SDK uses)"}, status_code=415)
            if stream is None and unary is None:
                raise _Unimplemented(f"{method} is not supported by DSec's envd")
            body = await read_body_limited(request, w.MAX_RPC_BODY)
            in_stream = stream is not None
            if stream is not None:
                msgs = w.parse_envelopes(body)
                if len(msgs) != 1:
                    raise InvalidArgument(f"{method} takes exactly one request message, got {len(msgs)}")
                return await stream(self, request, tenant, sid, msgs[0])
            assert unary is not None
            out = await unary(self, tenant, sid, body)
        except _Unimplemented as e:
            return self._connect_error("unimplemented", str(e), in_stream)
        except DSecError as e:
            return self._connect_error(*w.connect_error(e, sid), streaming=in_stream)
        return Response(json.dumps(out, separators=(",", ":")), media_type="application/json")

    @staticmethod
    def _connect_error(code: str, message: str, streaming: bool) -> Response:
        if streaming:  # a streamed call always answers 200 and ends with the error frame
            return Response(w.end_stream((code, message)), media_type="application/connect+json")
        return JSONResponse({"code": code, "message": message}, status_code=w.CONNECT_HTTP[code])

    # process.Process/Start
    async def start(self, request: Request, tenant: TenantRecord, sid: str, raw: bytes) -> Response:
        req: w.StartRequest = _validated(w.StartRequest, raw)
        if req.pty is not None:
            raise _Unimplemented("PTY sessions are not supported by DSec")
        if req.stdin:
            raise _Unimplemented("commands with stdin=True are not supported by DSec (no stdin streaming)")
        timeout = w.command_timeout(w.parse_timeout_ms(request.headers.get("connect-timeout-ms")))
        try:
            ereq = ExecRequest(cmd=w.command_argv(req.process), env=req.process.envs or None,
                               cwd=req.process.cwd or None, timeout=timeout)
        except ValidationError as e:
            raise validation_error(list(e.errors())) from None
        events = await self.svc.sandboxes.exec_stream(tenant, sid, ereq)  # ownership checked here
        cmd = _Command(next(self._pids), tenant.name, sid, req.process)
        cmd.task = asyncio.create_task(_pump(events, cmd.queue), name=f"e2b-cmd-{sid}-{cmd.pid}")
        self._commands[(sid, cmd.pid)] = cmd
        return self._attach(cmd, request)

    def _attach(self, cmd: _Command, request: Request) -> StreamingResponse:
        cmd.attached, cmd.started = True, False
        cmd.attachments += 1
        # A client that vanishes before the response body starts never runs the stream's
        # cleanup: if it has not started by then, the command is detached.
        asyncio.get_running_loop().call_later(ATTACH_GRACE_S, self._detach_if_unstarted, cmd, cmd.attachments)
        interval = _keepalive_interval(request.headers.get("keepalive-ping-interval"))
        return StreamingResponse(self._command_stream(cmd, interval), media_type="application/connect+json")

    def _detach_if_unstarted(self, cmd: _Command, attachment: int) -> None:
        if cmd.attachments == attachment and cmd.attached and not cmd.started:
            cmd.attached = False
            cmd.drainer = asyncio.create_task(self._drain(cmd), name=f"e2b-drain-{cmd.pid}")

    async def _command_stream(self, cmd: _Command, keepalive: float) -> AsyncIterator[bytes]:
        if not cmd.attached:  # detached already (see _attach): another client owns it now
            yield w.end_stream(("unavailable", f"command {cmd.pid} was detached before its stream started"))
            return
        cmd.started = True
        finished = False
        try:
            yield w.envelope(w.start_event(cmd.pid))
            while True:
                try:
                    item = cmd.queue.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        item = await asyncio.wait_for(cmd.queue.get(), keepalive)
                    except TimeoutError:
                        yield w.envelope(w.keepalive_event())
                        continue
                if item is _STREAM_END:
                    finished = True
                    break
                if isinstance(item, DSecError):
                    finished = True
                    yield w.end_stream(w.connect_error(item, cmd.sandbox_id))
                    return
                ev: ExecEvent = item
                if ev.kind != "exit":
                    if ev.data:
                        yield w.envelope(w.data_event(ev.kind, ev.data))
                    continue
                finished = True
                res = ev.result
                if res is not None and res.timed_out:
                    yield w.end_stream(("deadline_exceeded",
                                        f"command timed out after {res.duration:.1f}s (its timeout) and was killed"))
                    return
                yield w.envelope(w.end_event(res.exit_code if res is not None else -1))
                yield w.end_stream()
                return
            if cmd.signal is not None:  # killed through SendSignal
                yield w.envelope(w.end_event(-1, signal=cmd.signal))
                yield w.end_stream()
            else:
                yield w.end_stream(("unavailable", "the command stream ended without an exit status"))
        finally:
            cmd.attached = False
            if finished:
                self._commands.pop((cmd.sandbox_id, cmd.pid), None)
            else:  # the client went away (disconnect, its deadline): the command runs on
                cmd.drainer = asyncio.create_task(self._drain(cmd), name=f"e2b-drain-{cmd.pid}")

    async def _drain(self, cmd: _Command) -> None:
        """Discard a detached command's output until it ends (keeps its pipes flowing)."""
        while (await cmd.queue.get()) is not _STREAM_END:
            pass
        self._commands.pop((cmd.sandbox_id, cmd.pid), None)

    # process.Process/Connect
    async def connect(self, request: Request, tenant: TenantRecord, sid: str, raw: bytes) -> Response:
        req: w.ConnectRequest = _validated(w.ConnectRequest, raw)
        pid = req.process.pid
        if pid is None:
            raise InvalidArgument("select the process by pid (tags are not supported)", field="process.pid")
        await self.svc.sandboxes.get(tenant, sid)  # ownership / liveness
        cmd = self._commands.get((sid, pid))
        if cmd is None or cmd.tenant != tenant.name or (cmd.drainer is not None and cmd.drainer.done()):
            raise NotFound(f"no running command with pid {pid} in sandbox {sid}", path=f"pid:{pid}")
        if cmd.attached:
            raise w.AlreadyExists(f"command {pid} already has a client attached; disconnect it first")
        if cmd.drainer is not None:
            cmd.drainer.cancel()  # a cancelled queue.get() loses nothing
            cmd.drainer = None
        return self._attach(cmd, request)

    # process.Process/SendSignal
    async def send_signal(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        req: w.SendSignalRequest = _validated(w.SendSignalRequest, raw)
        sig = w.signal_number(req.signal)
        pid = req.process.pid
        if pid is None:
            raise InvalidArgument("select the process by pid (tags are not supported)", field="process.pid")
        await self.svc.sandboxes.get(tenant, sid)  # ownership / liveness
        cmd = self._commands.get((sid, pid))
        if cmd is None or cmd.tenant != tenant.name:
            raise NotFound(f"no running command with pid {pid} in sandbox {sid}", path=f"pid:{pid}")
        if cmd.signal is None:
            cmd.signal = sig
            assert cmd.task is not None
            cmd.task.cancel()  # closes the exec stream: the agent kills the whole process tree
            self.svc.sandboxes.audit.record(sid, tenant.name, "signal", pid=cmd.pid, signal=sig, via="e2b")
        return {}

    # process.Process/List
    async def list_processes(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        await self.svc.sandboxes.get(tenant, sid)
        procs = [{"pid": c.pid, "config": {"cmd": c.config.cmd, "args": c.config.args, "envs": c.config.envs,
                                           **({"cwd": c.config.cwd} if c.config.cwd else {})}}
                 for (s, _), c in list(self._commands.items()) if s == sid and c.tenant == tenant.name]
        return {"processes": procs}

    # --- filesystem.Filesystem ------------------------------------------------------------
    async def _stat(self, tenant: TenantRecord, sid: str, path: str) -> dict[str, Any]:
        parent, name = w.split_path(_absolute(path))
        if not name:
            return {"name": "/", "path": "/", "type": "FILE_TYPE_DIRECTORY", "size": "0", "mode": 0o755,
                    "permissions": "drwxr-xr-x", "owner": "root", "group": "root"}
        for e in await self.svc.sandboxes.list_files(tenant, sid, parent):
            if e.name == name:
                return w.entry_info(e)
        raise NotFound(f"no such file or directory in the sandbox: {path}", path=path)

    async def stat(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        req: w.PathRequest = _validated(w.PathRequest, raw)
        return {"entry": await self._stat(tenant, sid, req.path)}

    async def list_dir(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        req: w.ListDirRequest = _validated(w.ListDirRequest, raw)
        out: list[dict[str, Any]] = []
        level = [_absolute(req.path)]
        for _ in range(max(req.depth, 1)):
            nxt: list[str] = []
            for d in level:
                for e in await self.svc.sandboxes.list_files(tenant, sid, d):
                    out.append(w.entry_info(e))
                    if e.type == "dir":
                        nxt.append(e.path)
                    if len(out) > MAX_LIST_ENTRIES:
                        raise InvalidArgument(f"listing {req.path} at depth {req.depth} exceeds "
                                              f"{MAX_LIST_ENTRIES} entries; list with a smaller depth")
            level = nxt
        return {"entries": out}

    async def make_dir(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        req: w.PathRequest = _validated(w.PathRequest, raw)
        path = _absolute(req.path)
        try:
            await self._stat(tenant, sid, path)
        except NotFound as e:
            if w.is_sandbox_missing(e):
                raise
        else:
            raise w.AlreadyExists(f"{path} already exists", path=path)
        # A one-directory tar through the service's upload path: parents are made, the
        # walk is confined to the sandbox root, and the write is audited.
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            ti = tarfile.TarInfo(path.strip("/"))
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, int(time.time())
            tf.addfile(ti)
        await self.svc.sandboxes.upload_tar(tenant, sid, "/", buf.getvalue())
        return {"entry": await self._stat(tenant, sid, path)}

    async def remove(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        req: w.PathRequest = _validated(w.PathRequest, raw)
        await self.svc.sandboxes.remove_file(tenant, sid, _absolute(req.path), True)
        return {}

    async def move(self, tenant: TenantRecord, sid: str, raw: bytes) -> dict[str, Any]:
        req: w.MoveRequest = _validated(w.MoveRequest, raw)
        src, dst = _absolute(req.source), _absolute(req.destination)
        await self._stat(tenant, sid, src)  # a missing source is not_found, as in envd
        # DSec's file API has no rename: mv inside the sandbox (audited as an exec).
        res = await self.svc.sandboxes.exec(tenant, sid, ExecRequest(cmd=["mv", "-f", "--", src, dst], timeout=60))
        if res.exit_code != 0:
            raise InvalidArgument(f"rename {src} -> {dst} failed: {res.stderr.strip() or res.exit_code}",
                                  path=dst)
        return {"entry": await self._stat(tenant, sid, dst)}


class _Unimplemented(Exception):
    pass


def _keepalive_interval(value: str | None) -> float:
    if value and value.isdigit():
        return float(min(max(int(value), 1), 300))
    return KEEPALIVE_S


_StreamHandler = Callable[[EnvdService, Request, TenantRecord, str, bytes], Awaitable[Response]]
_UnaryHandler = Callable[[EnvdService, TenantRecord, str, bytes], Awaitable[dict[str, Any]]]

_STREAMS: dict[str, _StreamHandler] = {"process.Process/Start": EnvdService.start,
                                        "process.Process/Connect": EnvdService.connect}
_UNARY: dict[str, _UnaryHandler] = {
    "process.Process/SendSignal": EnvdService.send_signal,
    "process.Process/List": EnvdService.list_processes,
    "filesystem.Filesystem/Stat": EnvdService.stat,
    "filesystem.Filesystem/ListDir": EnvdService.list_dir,
    "filesystem.Filesystem/MakeDir": EnvdService.make_dir,
    "filesystem.Filesystem/Remove": EnvdService.remove,
    "filesystem.Filesystem/Move": EnvdService.move,
}


def envd_router(envd: EnvdService) -> APIRouter:
    router = APIRouter(prefix=ENVD_PREFIX, include_in_schema=False)
    router.add_api_route("/health", envd.health, methods=["GET"])
    router.add_api_route("/files", envd.read_file, methods=["GET"])
    router.add_api_route("/files", envd.write_files, methods=["POST"])
    router.add_api_route("/{service}/{method}", envd.rpc, methods=["POST"])
    return router


def install_e2b(app: FastAPI, services: Services) -> EnvdService:
    """Register the E2B REST and envd front ends on ``app``."""
    envd = EnvdService(services)
    app.include_router(rest_router())
    app.include_router(envd_router(envd))
    return envd
