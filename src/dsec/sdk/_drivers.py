"""The HTTP drivers behind ``Client`` (urllib3) and ``AsyncClient`` (aiohttp).

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
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlencode

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


class _U3:
    """The urllib3 side of ``Client`` (about half of httpx's per-request cost); its errors
    are re-raised as the matching httpx transport errors, as ``_Aio`` does."""

    def __init__(self, cfg: ClientConfig) -> None:
        import urllib3

        self._base = cfg.url.rstrip("/")
        self._headers = default_headers(cfg)
        self._timeout = cfg.timeout_s
        # No urllib3 retries or redirects: the sans-IO core decides what is safe to resend.
        self._pool = urllib3.PoolManager(num_pools=4, maxsize=cfg.max_keepalive, block=False, retries=False)

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
        self._pool.clear()
