"""A pure-ASGI fast path for the requests an RL trainer sends thousands of times a
second: ``POST /v1/sandboxes/{sandbox_id}/exec``, ``POST /v1/sandboxes`` (a create,
most often a warm-pool hand-over whose budget is a few ms; issue 15) and
``DELETE /v1/sandboxes/{sandbox_id}`` (the end of every short episode), plus
``GET /health``, which probes must get through even when the server is busy.

Why: profiling a trivial exec (py-spy on ``dsec serve``) showed FastAPI's generic
machinery — five framework middlewares, the route scan, dependency solving, body
validation through ``ModelField`` — costing about as much as the node's own exec work.
This path does the same things directly: token -> tenant, path pattern, body validated
by the same pydantic model, ``SandboxService.exec``, one JSON write. The FastAPI routes
stay registered (OpenAPI, docs, and every other request) and define the contract: this
path must answer exactly what they would, which ``tests/unit/api`` checks side by side.

Errors use the same ``dsec.api.errors`` mapping; anything unexpected is logged and
answered 500 JSON exactly like the app's catch-all handler (this path runs in front of
FastAPI's middleware stack, see ``dsec.api.app.DSecApp``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

from pydantic import ValidationError

from dsec import __version__
from dsec.api.deps import ID_PATTERN
from dsec.api.errors import error_response, validation_error
from dsec.api.guard import TENANT_KEY
from dsec.api.services import Services
from dsec.errors import DSecError, PayloadTooLarge
from dsec.models import ExecRequest, ExecResult, SandboxSpec
from dsec.models.api import Health

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("dsec.api")

_EXEC = re.compile(r"^/v1/sandboxes/([^/]+)/exec$")
_ONE = re.compile(r"^/v1/sandboxes/([^/]+)$")
_ID = re.compile(ID_PATTERN)
_JSON = [(b"content-type", b"application/json")]


class _Route:
    """What RequestMetrics reads from ``scope["route"]`` (the route template label)."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


_EXEC_ROUTE = _Route("/v1/sandboxes/{sandbox_id}/exec")
_CREATE_ROUTE = _Route("/v1/sandboxes")
_KILL_ROUTE = _Route("/v1/sandboxes/{sandbox_id}")
_HEALTH_ROUTE = _Route("/health")


async def _reply(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class HotPath:
    def __init__(self, app: ASGIApp, services: Services, app_state: Any = None) -> None:
        self.app = app
        self.svc = services
        self.app_state = app_state  # the FastAPI app's state (its checkpoints, for a kill)
        self._slots = asyncio.Semaphore(services.settings.api_exec_slots)
        self._hold = services.settings.api_exec_slot_hold_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method, path = scope["method"], scope["path"]
            if method == "POST":
                m = _EXEC.match(path)
                if m is not None:
                    scope["route"] = _EXEC_ROUTE
                    await self._exec(m.group(1), scope, receive, send)
                    return
                if path == "/v1/sandboxes":
                    scope["route"] = _CREATE_ROUTE
                    await self._create(scope, receive, send)
                    return
            elif method == "DELETE":
                m = _ONE.match(path)
                if m is not None:
                    scope["route"] = _KILL_ROUTE
                    await self._kill(m.group(1), scope, receive, send)
                    return
            elif method == "GET" and path == "/health":
                scope["route"] = _HEALTH_ROUTE
                await self._health(send)
                return
        await self.app(scope, receive, send)

    async def _health(self, send: Send) -> None:
        svc = self.svc
        body = Health(status="ok", version=__version__, node=getattr(svc.node, "node_id", None),
                      uptime_s=round(time.time() - svc.started_at, 3))
        await _reply(send, 200, body.model_dump_json().encode())

    async def _exec(self, sandbox_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        svc = self.svc
        try:
            tenant = await _tenant(svc, scope)
            body = await _body(receive, svc.settings.max_upload_bytes)
            if not _ID.match(sandbox_id):
                raise validation_error([{"loc": ("path", "sandbox_id"),
                                         "msg": f"String should match pattern '{ID_PATTERN}'"}])
            try:
                req = ExecRequest.model_validate_json(body)
            except ValidationError as e:
                raise _body_error(e) from None
            res = await self._slotted(svc.sandboxes.exec(tenant, sandbox_id, req))
        except Exception as err:  # noqa: BLE001 - answered as the app's handlers would (this path is in front of them)
            await self._fail(err, scope, receive, send)
            return
        await _reply(send, 200, res.model_dump_json().encode())


    async def _kill(self, sandbox_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        """``DELETE /v1/sandboxes/{id}`` exactly as the FastAPI route answers it (204, no
        body): an RL episode ends with one, as often as it starts (issue 15)."""
        svc = self.svc
        try:
            tenant = await _tenant(svc, scope)
            await _body(receive, svc.settings.api_max_json_bytes)
            if not _ID.match(sandbox_id):
                raise validation_error([{"loc": ("path", "sandbox_id"),
                                         "msg": f"String should match pattern '{ID_PATTERN}'"}])
            await svc.sandboxes.kill(tenant, sandbox_id)
            ckpts = getattr(self.app_state, "checkpoints", None)
            if ckpts is not None:  # a restored sandbox's base record is no longer needed
                await ckpts.forget_sandbox(sandbox_id)
        except Exception as err:  # noqa: BLE001 - answered as the app's handlers would (this path is in front of them)
            await self._fail(err, scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/sandboxes`` exactly as the FastAPI route answers it (201 + SandboxInfo)."""
        svc = self.svc
        try:
            tenant = await _tenant(svc, scope)
            body = await _body(receive, svc.settings.api_max_json_bytes)
            try:
                spec = SandboxSpec.model_validate_json(body)
            except ValidationError as e:
                raise _body_error(e) from None
            info = await svc.sandboxes.create(tenant, spec)
        except Exception as err:  # noqa: BLE001 - answered as the app's handlers would (this path is in front of them)
            await self._fail(err, scope, receive, send)
            return
        await _reply(send, 201, info.model_dump_json().encode())

    async def _fail(self, err: Exception, scope: Scope, receive: Receive, send: Send) -> None:
        """What the app answers for an error: a DSecError as its JSON, anything else 500."""
        if isinstance(err, DSecError):
            await error_response(err, self.svc.settings.api_retry_after_s)(scope, receive, send)
            return
        log.exception("unhandled error on %s %s", scope["method"], scope["path"], exc_info=err)
        await _reply(send, 500, json.dumps({
            "code": "internal", "message": f"internal error ({type(err).__name__}); see the server log for details",
            "details": {}}).encode())

    async def _slotted(self, op: Coroutine[Any, Any, ExecResult]) -> ExecResult:
        """Run ``op`` holding an exec slot until it finishes or ``hold`` passes.

        Why: when hundreds of execs arrive (or finish) together, each one's start and
        reply run in the same loop iteration, and /health and every other request wait
        behind the whole burst (measured: the loop ran timers >50 ms late a third of the
        time at 200 concurrent sandboxes). Slots spread a burst over iterations. The hold
        bound means a long command (a test suite) costs others at most ``hold`` of waiting.
        ``op`` runs in this request's own task (a timer frees the slot after ``hold``): no
        task of its own and no waiter, which cost a trivial exec three loop passes.
        """
        try:
            await self._slots.acquire()
        except BaseException:
            op.close()
            raise
        held = [True]

        def free() -> None:
            if held[0]:
                held[0] = False
                self._slots.release()

        timer = asyncio.get_running_loop().call_later(self._hold, free)
        try:
            return await op  # cancelling this request cancels the exec too
        finally:
            timer.cancel()
            free()


def _body_error(e: ValidationError) -> DSecError:
    """A body that fails its model, worded as FastAPI reports it."""
    errs = [{**x, "loc": ("body", *x["loc"])} for x in e.errors()]
    if any(x["type"] == "json_invalid" for x in errs):
        errs = [{"loc": ("body", 0), "msg": "JSON decode error"}]
    return validation_error(errs)


async def _tenant(svc: Services, scope: Scope) -> Any:
    """The tenant ``RequestGuard`` (in front of us) already authenticated, else authenticate."""
    tenant = scope.get(TENANT_KEY)
    return tenant if tenant is not None else await svc.auth.authenticate(_header(scope, b"authorization"))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


async def _body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge(f"exec request exceeds the limit of {limit} bytes (Settings.max_upload_bytes); "
                                  "send large inputs as a file upload", limit=limit)
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)
