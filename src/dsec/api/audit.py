"""Per-sandbox audit log: buffered in memory, flushed to the state store in batches.

Exec can run thousands of times a second; one SQLite transaction per flush interval
keeps that off the event loop (flushes run in a worker thread). ``flush()`` is called
before reads so ``dsec logs`` always sees every record written so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from dsec.api.metrics import Metrics
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
        self._state = state
        self._metrics = metrics
        self._interval = flush_interval_s
        self._max_chars = max_chars
        self._buf: list[AuditRecord] = []
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def record(self, sandbox_id: str, tenant: str, kind: str, **data: Any) -> None:
        data = {k: clip(v, self._max_chars) for k, v in data.items()}
        self._buf.append(AuditRecord(sandbox_id=sandbox_id, tenant=tenant, ts=time.time(), kind=kind, data=data))

    async def flush(self) -> None:
        async with self._lock:
            batch, self._buf = self._buf, []
            if not batch:
                return
            try:
                await asyncio.to_thread(self._state.append_audit, batch)
                self._metrics.audit_records.inc(len(batch))
            except Exception:
                # Keep the records for the next attempt rather than losing them.
                self._buf[:0] = batch
                raise

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.flush()
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
