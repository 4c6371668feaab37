"""The HTTP drivers behind ``Client`` (urllib3) and ``AsyncClient`` (aiohttp); plain-HTTP
whole answers take a lean raw path on both (``_Raw``, ``_AioRaw``).

Each performs one ``Call`` and returns the sans-IO core's ``Response``; transport
failures are re-raised as the matching httpx exception, so ``_core.RetryPolicy`` (which
decides what is safe to resend) judges every driver alike. Why not httpx here: a round
trip through httpx costs 2-3x these (measured in ``dsec bench api``), and the SDK's
share of an exec's overhead was mostly that. httpx stays the driver when a test passes
a ``transport`` (e.g. ``httpx.ASGITransport`` for in-process tests).
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx

from dsec import __version__
from dsec.sdk._config import ClientConfig
from dsec.sdk._core import Call, Response, error_of


def default_headers(cfg: ClientConfig) -> dict[str, str]:
    headers = {"user-agent": f"dsec-sdk/{__version__}"}
    if cfg.token:
        headers["authorization"] = f"Bearer {cfg.token}"
    return headers


class _Aio:
    """The aiohttp side of ``AsyncClient``: its errors are re-raised as the matching httpx
    transport errors, so the retry policy in ``_core`` judges both drivers alike."""

    def __init__(self, cfg: ClientConfig) -> None:
        self._cfg = cfg
        self._base = cfg.url.rstrip("/")
        self._session: Any = None
        self._closer: AsyncIterator[None] | None = None
        self._headers = default_headers(cfg)
        self._raw = _AioRaw(self._base, self._headers, cfg.timeout_s, cfg.max_keepalive, cfg.max_connections) \
            if self._base.startswith("http://") else None

    async def _sess(self) -> Any:
        # Made lazily: an aiohttp session belongs to the loop it is first used on, and
        # clients are often constructed before the loop runs.
        if self._session is None or self._session.closed:
            import aiohttp
            conn = aiohttp.TCPConnector(limit=self._cfg.max_connections, limit_per_host=0,
                                        keepalive_timeout=self._cfg.keepalive_s)
            self._session = aiohttp.ClientSession(connector=conn, headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=self._cfg.timeout_s))
            # Clients that are never closed (``AsyncClient.default()``, forgotten ones) must
            # not end the program with "Unclosed client session" errors: a suspended async
            # generator is closed by the loop's shutdown (asyncio.run), and closes the session.
            self._closer = _close_at_loop_shutdown(self._session)
            await anext(self._closer)
        return self._session

    def _kwargs(self, call: Call[Any]) -> dict[str, Any]:
        import aiohttp
        kw: dict[str, Any] = {}
        if call.params:
            kw["params"] = call.params
        if call.headers:
            kw["headers"] = call.headers
        if call.json is not None:
            kw["json"] = call.json
        elif call.content is not None:
            kw["data"] = call.content
        if call.timeout is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=call.timeout)
        return kw

    @staticmethod
    def _mapped(e: BaseException) -> httpx.TransportError:
        import aiohttp
        if isinstance(e, aiohttp.ClientConnectorError):
            return httpx.ConnectError(str(e))  # never sent: always safe to retry
        if isinstance(e, asyncio.TimeoutError):
            return httpx.ReadTimeout(f"no answer within the client timeout ({e})")
        return httpx.ReadError(f"{type(e).__name__}: {e}")

    async def request(self, call: Call[Any]) -> Response:
        if self._raw is not None:
            path = call.path + ("?" + urlencode(call.params) if call.params else "")
            headers, body = dict(call.headers), call.content
            if call.json is not None:
                body = json.dumps(call.json).encode()
                headers["content-type"] = "application/json"
            return await self._raw.request(call.method, path, headers, body, call.timeout or self._cfg.timeout_s)
        import aiohttp
        try:
            async with (await self._sess()).request(call.method, self._base + call.path, **self._kwargs(call)) as r:
                body = await r.read()
                return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, body)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._mapped(e) from e

    async def lines(self, call: Call[Any]) -> AsyncIterator[str]:
        """NDJSON lines of a streamed answer (no line-length limit: chunks are split here)."""
        import aiohttp
        try:
            async with (await self._sess()).request(call.method, self._base + call.path, **self._kwargs(call)) as r:
                if r.status >= 400:
                    raise error_of(Response(r.status, {k.lower(): v for k, v in r.headers.items()},
                                            await r.read()))
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    *done, buf = buf.split(b"\n")
                    for line in done:
                        yield line.decode()
                if buf:
                    yield buf.decode()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._mapped(e) from e

    async def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        if self._closer is not None:
            await self._closer.aclose()  # closes the session
            self._closer = None
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _close_at_loop_shutdown(session: Any) -> AsyncIterator[None]:
    try:
        yield
    finally:
        if not session.closed:
            await session.close()


class _Raw:
    """Plain-HTTP/1.1 keep-alive requests over pooled sockets, for ``Client.request``.

    Why: an exec's round trip through urllib3 costs ~0.3 ms of Python per call (pool
    bookkeeping, header objects, http.client's line-by-line parser); the sync SDK's
    overhead target is what the async driver reaches. This writes the request in one
    ``sendall`` and reads the answer with a few ``recv``s. Only ``http://`` URLs and
    non-streamed answers; everything else stays on urllib3. Thread-safe (a lock-guarded
    list of idle sockets). A pooled socket the server closed while idle is detected
    before use; one that fails with no answer byte at all is replaced once (the server
    had not read the request: it only closes idle connections).
    """

    def __init__(self, base: str, headers: dict[str, str], timeout: float, maxsize: int) -> None:
        u = urlsplit(base)
        self._addr = (u.hostname or "127.0.0.1", u.port or 80)
        self._prefix = base[len(f"{u.scheme}://{u.netloc}"):]
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {"host": u.netloc, **headers}.items()).encode("latin-1")
        self._timeout = timeout
        self._maxsize = maxsize
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _take(self) -> socket.socket | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                s = self._idle.pop()
            try:  # readable while idle = closed by the server (or junk): not reusable
                if not select.select([s], [], [], 0)[0]:
                    return s
            except (OSError, ValueError):
                pass
            s.close()

    def _connect(self, timeout: float) -> socket.socket:
        try:
            s = socket.create_connection(self._addr, timeout=timeout)
        except TimeoutError as e:
            raise httpx.ConnectTimeout(str(e)) from e
        except OSError as e:  # never sent: always safe to retry
            raise httpx.ConnectError(str(e)) from e
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes | None,
                timeout: float) -> Response:
        head = [f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"), self._head]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        head.append(f"content-length: {len(body or b'')}\r\n\r\n".encode() if body is not None or method in (
            "POST", "PUT", "PATCH") else b"\r\n")
        data = b"".join(head) + (body or b"")
        s = self._take()
        reused = s is not None
        for _ in range(2):
            if s is None:
                s = self._connect(timeout)
            s.settimeout(timeout)
            try:
                try:
                    s.sendall(data)
                except (BrokenPipeError, ConnectionResetError) as e:
                    raise _NoAnswer(str(e)) from None
                resp, keep = _read_response(s)
            except _NoAnswer as e:
                s.close()
                s = None
                if reused:  # the server dropped this idle connection just now: once more, fresh
                    reused = False
                    continue
                raise httpx.ReadError(f"server closed the connection without answering ({e})") from None
            except TimeoutError as e:
                s.close()
                raise httpx.ReadTimeout(f"no answer within the client timeout ({e})") from e
            except OSError as e:
                s.close()
                raise httpx.ReadError(f"{type(e).__name__}: {e}") from e
            if keep:
                with self._lock:
                    if len(self._idle) < self._maxsize:
                        self._idle.append(s)
                        s = None
            if s is not None:
                s.close()
            return resp
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


class _NoAnswer(Exception):
    """The connection ended before one byte of an answer arrived."""


def _read_response(s: socket.socket) -> tuple[Response, bool]:
    """One HTTP/1.1 answer (content-length, chunked, or until close); (response, reusable)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError as e:
            if buf:
                raise
            raise _NoAnswer(str(e)) from None
        if not chunk:
            if not buf:
                raise _NoAnswer("EOF")
            raise OSError("connection closed inside the answer's header")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    keep = headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = s.recv(max(65536, n - len(rest)))
            if not chunk:
                raise OSError("connection closed inside the answer's body")
            rest += chunk
        return Response(status, headers, rest[:n]), keep
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            while b"\r\n" not in rest:
                chunk = s.recv(65536)
                if not chunk:
                    raise OSError("connection closed inside a chunked answer")
                rest += chunk
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                chunk = s.recv(65536)
                if not chunk:
                    raise OSError("connection closed inside a chunked answer")
                rest += chunk
            if size == 0:
                return Response(status, headers, bytes(body)), keep  # (no trailers from our server)
            body += rest[:size]
            rest = rest[size + 2:]
    if status in (204, 304) or status < 200:
        return Response(status, headers, b""), keep
    while chunk := s.recv(65536):  # no length: the answer ends with the connection
        rest += chunk
    return Response(status, headers, rest), False


def _parse_answer(buf: bytes | bytearray, eof: bool) -> tuple[Response, int, bool] | None:
    """One HTTP/1.1 answer at the start of ``buf``: (response, bytes used, reusable), or None
    while incomplete (``eof``: the connection has ended, so a length-less body is whole).
    Raises OSError for an answer cut short by the end of the connection."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if eof:
            raise OSError("connection closed inside the answer's header")
        return None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    keep = headers.get("connection", "").lower() != "close"
    pos = end + 4
    if "content-length" in headers:
        n = int(headers["content-length"])
        if len(buf) - pos < n:
            if eof:
                raise OSError("connection closed inside the answer's body")
            return None
        return Response(status, headers, bytes(buf[pos:pos + n])), pos + n, keep
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            size = int(bytes(buf[pos:nl]).split(b";")[0], 16)
            if len(buf) < nl + 2 + size + 2:
                break
            if size == 0:
                return Response(status, headers, bytes(body)), nl + 4, keep  # (no trailers from our server)
            body += buf[nl + 2:nl + 2 + size]
            pos = nl + 2 + size + 2
        if eof:
            raise OSError("connection closed inside a chunked answer")
        return None
    if status in (204, 304) or status < 200:
        return Response(status, headers, b""), pos, keep
    if not eof:  # no length: the answer ends with the connection
        return None
    return Response(status, headers, bytes(buf[pos:])), len(buf), False


class _Conn(asyncio.Protocol):
    """One kept-alive connection of ``_AioRaw``: bytes in, a wake-up for the reader."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def answer(self) -> tuple[Response, bool]:
        while True:
            got = _parse_answer(self.buf, self.eof)
            if got is not None:
                resp, used, keep = got
                del self.buf[:used]
                return resp, keep and not self.eof and not self.buf
            if self.eof and not self.buf:
                raise _NoAnswer("EOF")
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _AioRaw:
    """``_Raw`` for ``AsyncClient``: plain-HTTP/1.1 keep-alive requests over pooled asyncio
    connections (a Protocol, no streams). Why: aiohttp's request machinery (session,
    connector, response and header objects) cost ~1 ms per exec on this VM, twice the async
    SDK's overhead budget (issue 15). Whole answers over ``http://`` only; streamed answers
    stay on aiohttp. Connections belong to the loop that opened them."""

    def __init__(self, base: str, headers: dict[str, str], timeout: float, maxsize: int,
                 max_open: int = 2048) -> None:
        u = urlsplit(base)
        self._addr = (u.hostname or "127.0.0.1", u.port or 80)
        self._prefix = base[len(f"{u.scheme}://{u.netloc}"):]
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {"host": u.netloc, **headers}.items()).encode("latin-1")
        self._timeout = timeout
        self._maxsize = maxsize
        self._idle: list[_Conn] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._max_open = max_open
        self._slots: asyncio.Semaphore | None = None  # at most max_open requests in flight

    def _take(self) -> _Conn | None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # another loop's connections cannot be used (or closed) here
            self._idle, self._loop = [], loop
            self._slots = asyncio.Semaphore(self._max_open)
        while self._idle:
            c = self._idle.pop()
            if not c.eof and not c.buf:  # closed by the server while idle, or junk: not reusable
                return c
            c.close()
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await loop.create_connection(_Conn, *self._addr)
        except OSError as e:  # never sent: always safe to retry
            raise httpx.ConnectError(str(e)) from e
        sock = proto.transport.get_extra_info("socket") if proto.transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return proto

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes | None,
                      timeout: float) -> Response:
        head = [f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"), self._head]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()]
        head.append(f"content-length: {len(body or b'')}\r\n\r\n".encode() if body is not None or method in (
            "POST", "PUT", "PATCH") else b"\r\n")
        data = b"".join(head) + (body or b"")
        c = self._take()
        assert self._slots is not None
        async with self._slots:
            return await self._send(c, data, timeout)

    async def _send(self, c: _Conn | None, data: bytes, timeout: float) -> Response:
        reused = c is not None
        try:
            async with asyncio.timeout(timeout):
                for _ in range(2):
                    if c is None:
                        c = await self._connect()
                    try:
                        assert c.transport is not None
                        c.transport.write(data)
                        resp, keep = await c.answer()
                    except _NoAnswer as e:
                        c.close()
                        c = None
                        if reused:  # the server dropped this idle connection just now: once more, fresh
                            reused = False
                            continue
                        raise httpx.ReadError(f"server closed the connection without answering ({e})") from None
                    except OSError as e:
                        c.close()
                        c = None
                        raise httpx.ReadError(f"{type(e).__name__}: {e}") from e
                    if keep and len(self._idle) < self._maxsize:
                        self._idle.append(c)
                    else:
                        c.close()
                    c = None
                    return resp
        except TimeoutError as e:
            raise httpx.ReadTimeout(f"no answer within the client timeout ({timeout:g}s)") from e
        finally:
            if c is not None:  # cancelled or timed out mid-request: the connection is in an unknown state
                c.close()
        raise AssertionError("unreachable")

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()


class _U3:
    """The urllib3 side of ``Client`` (about half of httpx's per-request cost); its errors
    are re-raised as the matching httpx transport errors, as ``_Aio`` does. Plain-HTTP
    requests with a whole answer take the leaner ``_Raw`` path."""

    def __init__(self, cfg: ClientConfig) -> None:
        import urllib3

        self._base = cfg.url.rstrip("/")
        self._headers = default_headers(cfg)
        self._timeout = cfg.timeout_s
        # No urllib3 retries or redirects: the sans-IO core decides what is safe to resend.
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=cfg.max_keepalive, block=False, retries=False)
        self._raw = _Raw(self._base, self._headers, cfg.timeout_s, cfg.max_keepalive) \
            if self._base.startswith("http://") else None

    def _open(self, call: Call[Any], stream: bool) -> Any:
        import urllib3

        url = self._base + call.path
        if call.params:
            url += "?" + urlencode(call.params)
        headers = {**self._headers, **call.headers}
        body = call.content
        if call.json is not None:
            body = json.dumps(call.json).encode()
            headers["content-type"] = "application/json"
        try:
            return self._pool.request(call.method, url, body=body, headers=headers, redirect=False,
                                      timeout=call.timeout or self._timeout, preload_content=not stream)
        except urllib3.exceptions.NewConnectionError as e:  # never sent: always safe to retry
            raise httpx.ConnectError(str(e)) from e
        except urllib3.exceptions.ConnectTimeoutError as e:
            raise httpx.ConnectTimeout(str(e)) from e
        except urllib3.exceptions.TimeoutError as e:
            raise httpx.ReadTimeout(str(e)) from e
        except urllib3.exceptions.HTTPError as e:
            raise httpx.ReadError(f"{type(e).__name__}: {e}") from e

    def request(self, call: Call[Any]) -> Response:
        if self._raw is not None:
            path = call.path + ("?" + urlencode(call.params) if call.params else "")
            headers, body = dict(call.headers), call.content
            if call.json is not None:
                body = json.dumps(call.json).encode()
                headers["content-type"] = "application/json"
            return self._raw.request(call.method, path, headers, body, call.timeout or self._timeout)
        r = self._open(call, stream=False)
        return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.data)

    def lines(self, call: Call[Any]) -> Iterator[str]:
        import urllib3

        r = self._open(call, stream=True)
        try:
            if r.status >= 400:
                raise error_of(Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()))
            buf = b""
            for chunk in r.stream(65536):
                buf += chunk
                *done, buf = buf.split(b"\n")
                for line in done:
                    yield line.decode()
            if buf:
                yield buf.decode()
        except urllib3.exceptions.HTTPError as e:
            raise httpx.ReadError(f"{type(e).__name__}: {e}") from e
        finally:
            r.release_conn()

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        self._pool.clear()
