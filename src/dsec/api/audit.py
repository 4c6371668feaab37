"""Per-sandbox audit log: buffered in memory, flushed to the state store in batches.

Exec can run thousands of times a second; one SQLite transaction per flush interval
keeps that off the event loop (flushes run in a worker thread). ``flush()`` is called
before reads so ``dsec logs`` always sees every record written so far.

Denied network attempts (``watch_network``) are pulled from the node: every
``net_denied_audit_poll_s``, at every ``flush()`` (so a read sees them at once) and when
the sandbox is torn down. ``network_denied`` records itemize the first attempt to each of
the first ``net_denied_audit_distinct`` destinations; one ``network_denied_summary`` with
the counts is written at teardown (``dsec.net.denied``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec.api.metrics import Metrics
from dsec.net.denied import DeniedTally, itemized_fields
from dsec.state.store import AuditRecord, StateStore

log = logging.getLogger("dsec.audit")


def clip(value: Any, max_chars: int) -> Any:
    """Bound what one record may hold (argv can be megabytes of heredoc)."""
    if isinstance(value, str) and len(value) > max_chars:
        return value[:max_chars] + f"...[{len(value) - max_chars} more chars]"
    if isinstance(value, list):
        return [clip(v, max_chars) for v in value]
    return value


class AuditLog:
    def __init__(self, state: StateStore, metrics: Metrics, flush_interval_s: float, max_chars: int) -> None:
        self.owners: dict[str, str] = {}  # sandbox id -> owner uid (SandboxService shares its map)
        self._state = state
        self._metrics = metrics
        self._interval = flush_interval_s
        self._max_chars = max_chars
        self._buf: list[AuditRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._net: _DeniedNetwork | None = None

    def watch_network(self, node: Any, poll_s: float, max_distinct: int) -> None:
        """Copy ``node``'s denied connection attempts into the sandboxes' audit logs.

        ``node`` needs ``list()`` and ``denied_network_attempts(id, since_seq)``; when it
        has a local ``manager`` with ``before_teardown`` hooks, the last attempts and the
        summary are written before the sandbox's network goes. Nodes without the method
        are ignored (nothing to copy)."""
        if not callable(getattr(node, "denied_network_attempts", None)):
            return
        self._net = _DeniedNetwork(self, node, poll_s, max_distinct)
        hooks = getattr(getattr(node, "manager", None), "before_teardown", None)
        if isinstance(hooks, list):
            hooks.append(self._net.final)

    def record(self, sandbox_id: str, tenant: str, kind: str, **data: Any) -> None:
        data = {k: clip(v, self._max_chars) for k, v in data.items()}
        self._buf.append(AuditRecord(sandbox_id=sandbox_id, tenant=tenant, ts=time.time(), kind=kind, data=data))

    async def flush(self) -> None:
        """Write every buffered record, after pulling the node's new denied attempts."""
        if self._net is not None:
            await self._net.poll()
        await self._write()

    async def _write(self) -> None:
        async with self._lock:
            batch, self._buf = self._buf, []
            if not batch:
                return
            try:
                await self._state.append_audit(batch)
                self._metrics.audit_records.inc(len(batch))
            except Exception:
                # Keep the records for the next attempt rather than losing them.
                self._buf[:0] = batch
                raise

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        polled = loop.time()
        while True:
            await asyncio.sleep(self._interval)
            try:
                if self._net is not None and loop.time() - polled >= self._net.poll_s:
                    polled = loop.time()
                    await self._net.poll()
                await self._write()
            except Exception:
                log.exception("audit flush failed; will retry")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="dsec-audit-flush")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()


@dataclass
class _Tracked:
    tenant: str
    tally: DeniedTally
    done: bool = False  # summary written at teardown; polls must not re-read the sandbox


class _DeniedNetwork:
    """Pulls denied attempts from a node into an AuditLog, bounded per sandbox."""

    def __init__(self, audit: AuditLog, node: Any, poll_s: float, max_distinct: int) -> None:
        self.audit, self.node, self.poll_s, self.max_distinct = audit, node, poll_s, max_distinct
        self.source: Callable[[str, int], list[Any]] = node.denied_network_attempts
        self.tracked: dict[str, _Tracked] = {}

    def _ingest(self, sandbox_id: str, t: _Tracked) -> None:
        try:
            events = self.source(sandbox_id, t.tally.last_seq)
        except Exception:  # a node that lost the sandbox already; nothing more to read
            log.debug("reading denied attempts of %s failed", sandbox_id, exc_info=True)
            return
        for e in t.tally.add(events):
            self.audit.record(sandbox_id, t.tenant, "network_denied", **itemized_fields(e))

    def _summarize(self, sandbox_id: str, t: _Tracked) -> None:
        t.done = True
        if t.tally.total:
            self.audit.record(sandbox_id, t.tenant, "network_denied_summary", **t.tally.summary())

    async def poll(self) -> None:
        live = {}
        for info in await self.node.list():
            if info.network is not None and info.tenant:
                live[info.id] = info.tenant
        for sid, tenant in live.items():
            t = self.tracked.get(sid)
            if t is None:
                t = self.tracked[sid] = _Tracked(tenant, DeniedTally(self.max_distinct))
            if not t.done:
                self._ingest(sid, t)
        for sid in [s for s in self.tracked if s not in live]:
            t = self.tracked.pop(sid)
            if not t.done:  # gone without our teardown hook (another node's reaper)
                self._summarize(sid, t)

    def final(self, sandbox_id: str) -> None:
        """Teardown hook: the sandbox's last attempts and its summary, before detach."""
        t = self.tracked.get(sandbox_id)
        if t is None:
            try:
                if not self.source(sandbox_id, 0):
                    return  # no network or nothing refused: nothing to write
            except Exception:
                log.debug("reading denied attempts of %s failed", sandbox_id, exc_info=True)
                return
            # A sync hook (the node's teardown): the owners this API created, from memory
            # (the state store is async and may be remote).
            tenant = self.audit.owners.get(sandbox_id)
            if tenant is None:
                return  # not created through the API: no audit log to write to
            t = self.tracked[sandbox_id] = _Tracked(tenant, DeniedTally(self.max_distinct))
        if t.done:
            return
        self._ingest(sandbox_id, t)
        self._summarize(sandbox_id, t)
