"""``RequestGuard``: authenticate before any body is read, and cap every body by route.

Why (issue 18 #5): FastAPI reads and parses a JSON body before it solves the route's
dependencies, token check included, so four unauthenticated 400 MB posts grew the
server by 1.7 GiB before each got its 401. This pure-ASGI layer sits in front of the
whole app (hot path included): a ``/v1/`` request without a valid token is answered
401 from its headers alone, a declared Content-Length over the route's limit is 413
at once, and a body that turns out longer (chunked) is cut off at the limit. A 401, and
any refusal of a request that still has a body to send, closes the connection
(``Connection: close``): nobody keeps streaming into a refused request or keeps an
unauthenticated connection alive for more tries.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from dsec.api.errors import error_response
from dsec.api.services import Services
from dsec.config import Settings
from dsec.errors import DSecError, PayloadTooLarge, Unauthorized

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TENANT_KEY = "dsec.tenant"  # scope key: the tenant the guard authenticated (read by deps.context)

# Routes whose body is raw bytes streamed to a sandbox or the image store.
_RAW_UPLOADS = [("PUT", re.compile(r"^/v1/sandboxes/[^/]+/(files|tar)$")), ("POST", re.compile(r"^/v1/images/import$"))]


def body_limit(method: str, path: str, settings: Settings) -> int:
    """Largest body accepted by ``method path``: raw uploads ``max_upload_bytes``, episode
    routes room for an agent context (``checkpoint_max_context_bytes``), the rest JSON."""
    if any(m == method and rx.match(path) for m, rx in _RAW_UPLOADS):
        return settings.max_upload_bytes
    if path.startswith("/v1/episodes/"):
        return settings.checkpoint_max_context_bytes + settings.api_max_json_bytes
    return settings.api_max_json_bytes


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() not in ("", "0"))


@dataclass
class _Flow:
    received: int = 0
    over: bool = False
    started: bool = False


class RequestGuard:
    def __init__(self, app: ASGIApp, services: Services) -> None:
        self.app = app
        self.svc = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        settings = self.svc.settings
        limit = body_limit(scope["method"], scope["path"], settings)
        try:
            scope[TENANT_KEY] = await self.svc.auth.authenticate(_header(scope, b"authorization"))
            declared = _header(scope, b"content-length")
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                raise PayloadTooLarge(_too_large(scope, limit, declared), limit=limit)
        except DSecError as err:
            # An unauthenticated connection is not kept alive for more tries; a 413's is
            # closed only when its body is left unread.
            await self._refuse(err, scope, receive, send, close=isinstance(err, Unauthorized) or _has_body(scope))
            return
        if _header(scope, b"transfer-encoding") is None:
            # The server never delivers more than the Content-Length checked above (none:
            # no body), so only chunked bodies need counting; the exec hot path stays lean.
            await self.app(scope, receive, send)
            return
        flow = _Flow()

        async def capped_receive() -> Message:
            if flow.over:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                flow.received += len(msg.get("body", b""))
                if flow.received > limit:
                    flow.over = True  # the app sees a client that went away; we answer 413
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Message) -> None:
            if flow.over and not flow.started:
                return  # whatever the app says about the "disconnect" is replaced by the 413
            if msg["type"] == "http.response.start":
                flow.started = True
            await send(msg)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except Exception:
            if not (flow.over and not flow.started):
                raise
        if flow.over and not flow.started:
            await self._refuse(PayloadTooLarge(_too_large(scope, limit, None), limit=limit), scope, receive, send,
                               close=True)

    async def _refuse(self, err: DSecError, scope: Scope, receive: Receive, send: Send, *, close: bool) -> None:
        response = error_response(err, self.svc.settings.api_retry_after_s)
        if close:  # the rest of the body is never read: end the connection instead
            response.headers["connection"] = "close"
        await response(scope, receive, send)


def _too_large(scope: Scope, limit: int, declared: str | None) -> str:
    size = f"of {declared} bytes " if declared is not None else ""
    return (f"request body {size}exceeds the limit of {limit} bytes for {scope['method']} {scope['path']} "
            "(api_max_json_bytes for JSON, max_upload_bytes for raw uploads); send large data as a file upload")
