"""FileGate (issue 18 #2): one tenant's slow file I/O holds at most its own slots; steps
past their deadline answer 504 but keep their slot until the thread really returns."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dsec.api.file_gate import FileGate
from dsec.config import Settings
from dsec.errors import Overloaded, Timeout


def _gate() -> FileGate:
    return FileGate(Settings(api_file_ops_per_tenant=2, api_file_slot_wait_s=0.2, api_file_op_timeout_s=0.3,
                             api_uploads_per_tenant=1, api_file_threads=8))


async def test_a_tenants_blocked_ops_do_not_stop_others() -> None:
    """Tenant a's two stuck steps fill a's slots: its third waits, then 429; tenant b's
    steps run meanwhile. Stuck steps answer 504 at their deadline, yet their slots stay
    taken until the threads return (a tenant cannot pile up stuck threads)."""
    gate, release = _gate(), threading.Event()
    try:
        stuck = [asyncio.create_task(gate.run("a", release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="api_file_ops_per_tenant"):
            await gate.run("a", time.sleep, 0)
        assert await gate.run("b", lambda: "b ran") == "b ran"
        for t in stuck:
            with pytest.raises(Timeout, match="api_file_op_timeout_s"):
                await t
        with pytest.raises(Overloaded):  # past the deadline, still running: slots still held
            await gate.run("a", time.sleep, 0)
        release.set()
        await asyncio.sleep(0.1)
        assert await gate.run("a", lambda: "a again") == "a again"
    finally:
        release.set()
        gate.close()


async def test_upload_slots_per_tenant() -> None:
    """With api_uploads_per_tenant=1 a second upload of the same tenant waits
    api_file_slot_wait_s, then 429; another tenant's upload is not affected."""
    gate = _gate()
    try:
        async with gate.upload("a"):
            with pytest.raises(Overloaded, match="api_uploads_per_tenant"):
                async with gate.upload("a"):
                    pass
            async with gate.upload("b"):
                pass
        async with gate.upload("a"):  # freed
            pass
    finally:
        gate.close()
