"""The async SDK's lean HTTP/1.1 path (``dsec.sdk._drivers._AioRaw``, issue 15), held to
what the sync one (``_Raw``) guarantees: answers with a length, chunked or ended by close
are read whole; keep-alive connections are reused; a connection the server dropped while
idle is replaced without an error and the request is sent once; no server is a
ConnectError (which the retry policy may resend); a silent server is a ReadTimeout."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from test_sdk_raw_driver import _Server

from dsec.sdk._drivers import _AioRaw


def _client(port: int) -> _AioRaw:
    return _AioRaw(f"http://127.0.0.1:{port}", {"authorization": "Bearer t"}, 5.0, 4)


async def test_length_chunked_and_close_answers() -> None:
    srv = _Server([b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
                   b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
                   b"HTTP/1.1 500 Oops\r\nconnection: close\r\ncontent-length: 3\r\n\r\nbye"])
    c = _client(srv.port)
    r = await c.request("POST", "/v1/x", {"content-type": "application/json"}, b'{"a":1}', 5.0)
    assert (r.status, r.content) == (200, b"hello")
    assert srv.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n") and srv.requests[0].endswith(b'{"a":1}')
    assert b"authorization: Bearer t" in srv.requests[0]
    r = await c.request("GET", "/v1/y?z=1", {}, None, 5.0)
    assert (r.status, r.content) == (201, b"abcde")
    assert srv.connections == 1  # kept alive
    r = await c.request("GET", "/v1/z", {}, None, 5.0)
    assert (r.status, r.content) == (500, b"bye")
    r = await c.request("GET", "/v1/z", {}, None, 5.0)  # the server closed: a new connection
    assert srv.connections == 2 and (r.status, r.content) == (500, b"bye")
    c.close()


async def test_idle_connection_dropped_by_the_server_is_replaced() -> None:
    """The server answers once per connection and closes it (like an idle timeout), also
    with an answer that has no length (it ends with the connection)."""
    srv = _Server([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"HTTP/1.1 200 OK\r\n\r\nok"],
                  close_after=1)
    c = _client(srv.port)
    for _ in range(3):
        assert (await c.request("POST", "/v1/e", {}, b"{}", 5.0)).content == b"ok"
        await asyncio.sleep(0.05)  # the server's close arrives while the connection is idle
    assert srv.connections == 3 and len(srv.requests) == 3
    c.close()


async def test_no_server_is_a_connect_error_and_silence_a_read_timeout() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(httpx.ConnectError):
        await _client(port).request("GET", "/health", {}, None, 2.0)
    mute = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never answers
    with pytest.raises(httpx.ReadTimeout):
        await _client(mute.getsockname()[1]).request("GET", "/health", {}, None, 0.3)
    mute.close()
