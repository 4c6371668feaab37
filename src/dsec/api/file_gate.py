"""Where file-API I/O runs: its own threads, a few slots per tenant, a deadline per step.

Why (issue 18 #2): file calls used to run on the event loop's default thread pool (six
threads on a 2-core box), the same pool that state writes, creates, kills and audit
flushes use. Six requests blocked in ``open()`` on a fifo took the whole server. Now
file steps run on a dedicated pool, one tenant holds at most ``api_file_ops_per_tenant``
of its threads, and a step that overruns its deadline answers 504 while its slot stays
taken until the thread really returns (so a tenant can never pile up stuck threads).
Uploads additionally hold one of ``api_uploads_per_tenant`` slots for their whole body.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dsec.config import Settings
from dsec.errors import Overloaded, Timeout

T = TypeVar("T")


class FileGate:
    def __init__(self, settings: Settings) -> None:
        self._pool = ThreadPoolExecutor(settings.api_file_threads, thread_name_prefix="dsec-files")
        self._per_tenant = settings.api_file_ops_per_tenant
        self._uploads_per_tenant = settings.api_uploads_per_tenant
        self._wait_s = settings.api_file_slot_wait_s
        self._timeout_s = settings.api_file_op_timeout_s
        self._retry_after = settings.api_retry_after_s
        self._ops: dict[str, asyncio.Semaphore] = {}
        self._uploads: dict[str, asyncio.Semaphore] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a file thread, holding one of ``tenant``'s slots until it returns."""
        sem = self._ops.setdefault(tenant, asyncio.Semaphore(self._per_tenant))
        try:
            await asyncio.wait_for(sem.acquire(), self._wait_s)
        except TimeoutError:
            raise Overloaded(f"tenant {tenant!r} already has {self._per_tenant} file operations in flight "
                             f"(api_file_ops_per_tenant); retry later", retry_after=self._retry_after) from None
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except BaseException:
            sem.release()
            raise
        fut.add_done_callback(lambda _: sem.release())  # freed with the thread, not with our wait
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self._timeout_s)
        except TimeoutError:
            raise Timeout(f"a file operation took longer than {self._timeout_s:g}s (api_file_op_timeout_s)") from None

    def later(self, fn: Callable[[], Any]) -> None:
        """Run cleanup (close an fd) on a file thread without waiting or taking a slot: it
        may have to wait for a step still running on that fd (``dsec.node.files.OpenFile``)."""
        try:
            self._pool.submit(fn)
        except RuntimeError:  # shutting down: no thread left to wait on
            fn()

    @contextlib.asynccontextmanager
    async def upload(self, tenant: str) -> AsyncIterator[None]:
        """One of ``tenant``'s upload slots for the duration of an upload; 429 when none
        frees up within ``api_file_slot_wait_s`` (a waiting upload's body stays unread in
        the socket: uvicorn stops reading past 64 KiB, so waiting costs no memory)."""
        sem = self._uploads.setdefault(tenant, asyncio.Semaphore(self._uploads_per_tenant))
        try:
            await asyncio.wait_for(sem.acquire(), self._wait_s)
        except TimeoutError:
            raise Overloaded(f"tenant {tenant!r} already streams {self._uploads_per_tenant} uploads "
                             "(api_uploads_per_tenant); retry when one finished", retry_after=self._retry_after) from None
        try:
            yield
        finally:
            sem.release()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
