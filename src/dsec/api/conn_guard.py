"""An HTTP protocol that closes half-sent requests (issue 18 #12).

uvicorn arms no timer on a fresh connection and none while a request's headers
trickle in (its keep-alive timer only runs between requests), so 1,000 half-sent
requests stayed open indefinitely. This subclass of uvicorn's httptools protocol:

* gives every request ``api_header_timeout_s`` from connect (or from its first byte on
  a kept-alive connection) to complete its headers, then closes the connection;
* counts, per client address, connections holding a partial header block (or none
  at all ``api_pending_grace_s`` after connect) and closes a new one at once past
  ``api_max_pending_per_client``. A well-behaved client sends its headers in one write
  right after connecting and is never counted, whatever its connection pool size.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsec.config import Settings

log = logging.getLogger("dsec.api")


class _RateLimitedLog:
    """One warning per ``every_s`` with a count of what it stands for: a flood of bad
    connections must not turn into a flood of log lines."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._last = -1e9
        self._count = 0

    def warn(self, msg: str, *args: object) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            log.warning(msg + " (%d such connections closed since the last report)", *args, self._count)
            self._last, self._count = now, 0


def _close(transport: asyncio.BaseTransport | None) -> None:
    if transport is not None and not transport.is_closing():
        transport.close()


class GuardedHttpTools(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    pending_grace_s: float = 1.0
    max_pending_per_client: int = 64
    pending: Counter[str]  # client address -> connections with a partial header block
    over_cap_log: _RateLimitedLog
    timeout_log: _RateLimitedLog

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        self._counted = False
        self._in_headers = True  # until the first request's headers are complete
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(
            self.header_timeout_s, self._header_timeout)
        # A connection that stays silent counts too, but only after a grace: a burst of
        # connects is accepted before any of them is read.
        self._grace_timer: asyncio.TimerHandle | None = self.loop.call_later(self.pending_grace_s, self._count)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._count()

    def _count(self) -> None:
        """Count this connection as pending while its headers are incomplete; close it if
        its client already has its share of pending connections."""
        self._grace_timer = None
        if not self._in_headers or self._counted or self.transport is None or self.transport.is_closing():
            return
        if self.pending[self._peer] >= self.max_pending_per_client:
            self.over_cap_log.warn("closing a connection from %s without a complete request header: %d of this "
                                   "client's already wait for theirs (api_max_pending_per_client)", self._peer,
                                   self.pending[self._peer])
            _close(self.transport)
            return
        self.pending[self._peer] += 1
        self._counted = True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def on_headers_complete(self) -> None:
        self._headers_done()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

    def _headers_done(self) -> None:
        self._in_headers = False
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._counted:
            self._counted = False
            self.pending[self._peer] -= 1
            if self.pending[self._peer] <= 0:
                del self.pending[self._peer]

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_headers:
            self.timeout_log.warn("closing a connection from %s: no complete request header within %gs "
                                  "(api_header_timeout_s)", self._peer, self.header_timeout_s)
            _close(self.transport)


def guarded_protocol(settings: Settings) -> type[Any]:
    """A protocol class for one server (its own per-client counters)."""
    return type("GuardedHttpTools", (GuardedHttpTools,), {
        "header_timeout_s": settings.api_header_timeout_s,
        "pending_grace_s": settings.api_pending_grace_s,
        "max_pending_per_client": settings.api_max_pending_per_client,
        "pending": Counter(), "over_cap_log": _RateLimitedLog(), "timeout_log": _RateLimitedLog()})
