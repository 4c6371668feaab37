"""RequestGuard (issue 18 #5) at the ASGI level: no body is read before the token is
checked, bodies are capped per route, and a refused request's connection is closed."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from dsec.api.guard import TENANT_KEY, RequestGuard, body_limit
from dsec.config import Settings
from dsec.errors import Unauthorized

SETTINGS = Settings(max_upload_bytes=1000, api_max_json_bytes=1024, checkpoint_max_context_bytes=5000)


class _Auth:
    async def authenticate(self, header: str | None) -> Any:
        if header != "Bearer good":
            raise Unauthorized("invalid API token")
        return SimpleNamespace(name="alice")


def _scope(method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


async def _call(scope: dict[str, Any], chunks: list[bytes]) -> tuple[list[dict[str, Any]], int, list[Any]]:
    """Run the guard around an app that reads the whole body and echoes its size."""
    sent: list[dict[str, Any]] = []
    reads = 0
    seen: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        body = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope.get(TENANT_KEY))
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise RuntimeError("client went away")  # what Starlette raises (ClientDisconnect)
            size += len(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})

    guard = RequestGuard(app, SimpleNamespace(auth=_Auth(), settings=SETTINGS))  # type: ignore[arg-type]
    await guard(scope, receive, send)
    return sent, reads, seen


def _status(sent: list[dict[str, Any]]) -> tuple[int, dict[bytes, bytes], Any]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def test_body_limit_by_route() -> None:
    """Raw uploads get max_upload_bytes, episodes room for a context, the rest the JSON cap."""
    assert body_limit("PUT", "/v1/sandboxes/sb-1/files", SETTINGS) == 1000
    assert body_limit("PUT", "/v1/sandboxes/sb-1/tar", SETTINGS) == 1000
    assert body_limit("POST", "/v1/images/import", SETTINGS) == 1000
    assert body_limit("POST", "/v1/sandboxes/sb-1/files", SETTINGS) == 1024
    assert body_limit("PUT", "/v1/episodes/e1/context", SETTINGS) == 5000 + 1024
    assert body_limit("POST", "/v1/sandboxes", SETTINGS) == 1024


async def test_unauthenticated_body_is_never_read() -> None:
    """A bad token is 401 from the headers: receive() is never called, the app never
    runs, and the connection is closed (its body is left unread)."""
    sent, reads, seen = await _call(_scope("POST", "/v1/sandboxes", {"content-length": "999999999"}),
                                    [b"x" * 100])
    status, headers, body = _status(sent)
    assert (status, reads, seen) == (401, 0, [])
    assert headers[b"connection"] == b"close" and json.loads(body)["code"] == "unauthorized"


async def test_declared_and_streamed_bodies_over_the_cap_are_413() -> None:
    """Content-Length over the route's cap: 413 before reading. A chunked body that
    passes the cap: the app sees a disconnect and its answer is replaced by a 413."""
    sent, reads, _ = await _call(_scope("POST", "/v1/sandboxes", {"authorization": "Bearer good",
                                                                  "content-length": "2048"}), [b"x" * 2048])
    assert (_status(sent)[0], reads) == (413, 0)
    sent, reads, seen = await _call(_scope("POST", "/v1/sandboxes", {"authorization": "Bearer good",
                                                                     "transfer-encoding": "chunked"}),
                                    [b"x" * 600, b"x" * 600, b"x" * 600])
    status, _, body = _status(sent)
    assert (status, reads) == (413, 2) and b"api_max_json_bytes" in body
    assert [m["type"] for m in sent].count("http.response.start") == 1 and seen[0].name == "alice"


async def test_within_the_cap_and_outside_v1_pass_through() -> None:
    """A body under the cap reaches the app whole, with the tenant already resolved;
    paths outside /v1 (health, compat front ends with their own auth) are not touched."""
    sent, _, seen = await _call(_scope("POST", "/v1/sandboxes", {"authorization": "Bearer good"}), [b"x" * 1000])
    assert _status(sent)[0::2] == (200, b"1000") and seen[0].name == "alice"
    sent, _, seen = await _call(_scope("POST", "/e2b/sandboxes", {}), [b"x" * 5000])
    assert _status(sent)[0::2] == (200, b"5000") and seen == [None]
