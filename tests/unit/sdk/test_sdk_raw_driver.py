"""The sync SDK's lean HTTP/1.1 path (``dsec.sdk._drivers._Raw``, issue 15): answers with
a length, chunked or ended by close are read whole; keep-alive sockets are reused; a
socket the server dropped while idle is replaced without an error; a server that is
not there is a ConnectError (which the retry policy may resend)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from dsec.sdk._drivers import _Raw


class _Server:
    """A scripted HTTP server on loopback: each accepted connection answers requests with
    the next canned reply; ``close_after`` replies per connection, then it closes."""

    def __init__(self, replies: list[bytes], close_after: int = 1000) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.replies, self.close_after = replies, close_after
        self.connections = 0
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket) -> None:
        with c:
            for _ in range(self.close_after):
                buf = b""
                while b"\r\n\r\n" not in buf:
                    got = c.recv(65536)
                    if not got:
                        return
                    buf += got
                head, _, body = buf.partition(b"\r\n\r\n")
                n = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                              if ln.lower().startswith(b"content-length")), b"0"))
                while len(body) < n:
                    body += c.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + body)
                c.sendall(self.replies[min(len(self.requests), len(self.replies)) - 1])


def _client(port: int) -> _Raw:
    return _Raw(f"http://127.0.0.1:{port}", {"authorization": "Bearer t"}, 5.0, 4)


def test_length_chunked_and_close_answers() -> None:
    srv = _Server([b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
                   b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
                   b"HTTP/1.1 500 Oops\r\nconnection: close\r\ncontent-length: 3\r\n\r\nbye"])
    c = _client(srv.port)
    r = c.request("POST", "/v1/x", {"content-type": "application/json"}, b'{"a":1}', 5.0)
    assert (r.status, r.content) == (200, b"hello")
    assert srv.requests[0].startswith(b"POST /v1/x HTTP/1.1\r\n") and srv.requests[0].endswith(b'{"a":1}')
    assert b"authorization: Bearer t" in srv.requests[0]
    r = c.request("GET", "/v1/y?z=1", {}, None, 5.0)
    assert (r.status, r.content) == (201, b"abcde")
    assert srv.connections == 1  # kept alive
    r = c.request("GET", "/v1/z", {}, None, 5.0)
    assert (r.status, r.content) == (500, b"bye")
    r = c.request("GET", "/v1/z", {}, None, 5.0)  # the server closed: a new connection
    assert srv.connections == 2


def test_idle_connection_dropped_by_the_server_is_replaced() -> None:
    """The server answers once per connection and closes it (like an idle timeout): every
    next request still succeeds, each on a fresh connection, and is sent exactly once."""
    srv = _Server([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"], close_after=1)
    c = _client(srv.port)
    for _ in range(3):
        assert c.request("POST", "/v1/e", {}, b"{}", 5.0).content == b"ok"
    assert srv.connections == 3 and len(srv.requests) == 3


def test_no_server_is_a_connect_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(httpx.ConnectError):
        _client(port).request("GET", "/health", {}, None, 2.0)
