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
        """Copy ``node``'s denied connection attempts into the sandboxes' audit logs, through
        the node protocol only (``list`` and ``network_denied_events``), so it works the same
        for a node in this process and one across the cluster. A sandbox's last attempts
        and its summary are written when it is killed through the API (``before_destroy``),
        or at the first poll after another teardown (TTL, reaper): the node keeps a gone
        sandbox's attempts readable for a while."""
        self._net = _DeniedNetwork(self, node, poll_s, max_distinct)

    async def before_destroy(self, sandbox_id: str, tenant: str) -> None:
        """A kill through the API: write the sandbox's last denied attempts and summary now."""
        if self._net is not None:
            await self._net.final(sandbox_id, tenant)

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
        self.tracked: dict[str, _Tracked] = {}

    async def _ingest(self, sandbox_id: str, t: _Tracked) -> None:
        try:
            events = await self.node.network_denied_events(sandbox_id, t.tally.last_seq)
        except Exception:
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
                await self._ingest(sid, t)
        for sid in [s for s in self.tracked if s not in live]:
            t = self.tracked.pop(sid)
            if not t.done:  # gone without an API kill (TTL, reaper, another server): last read, then sum up
                await self._ingest(sid, t)
                self._summarize(sid, t)

    async def final(self, sandbox_id: str, tenant: str) -> None:
        """The sandbox's last attempts and its summary, before it is destroyed."""
        t = self.tracked.get(sandbox_id)
        if t is None:
            t = _Tracked(tenant, DeniedTally(self.max_distinct))
            await self._ingest(sandbox_id, t)
            if not t.tally.total:
                return  # no network or nothing refused: nothing to write
            self.tracked[sandbox_id] = t
        if t.done:
            return
        await self._ingest(sandbox_id, t)
        self._summarize(sandbox_id, t)
