"""The async SQLite store: calls made in one event-loop iteration share one hop to the
store's thread (issue 15: each hop is two thread wake-ups, which on a loaded machine cost
more than the SQL of a warm hand-over's writes)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dsec.state import IdempotencyRecord
from dsec.state.sqlite import SqliteStateStore


def _count_hops(store: SqliteStateStore) -> list[int]:
    hops: list[int] = []
    real = store._pool.submit

    def submit(fn: Any, *args: Any, **kw: Any) -> Any:
        hops.append(1)
        return real(fn, *args, **kw)

    store._pool.submit = submit  # type: ignore[method-assign]
    return hops


async def test_calls_of_one_iteration_share_one_hop_in_order(tmp_path: Path) -> None:
    """Three writes sent together reach the thread in one hop, run in submission order
    (the dead mark sees the row recorded just before it), and each caller gets its own
    result or its own error."""
    store = SqliteStateStore(tmp_path / "s.db")
    try:
        hops = _count_hops(store)
        rec = IdempotencyRecord(tenant="u1", request_id="r1", sandbox_id="sb-1", created_at=1.0)
        got = await asyncio.gather(store.record_sandbox("sb-1", "u1", 1.0), store.mark_dead(["sb-1"], 2.0),
                                   store.idem_reserve(rec), store.sandbox_owner("sb-1"))
        assert len(hops) == 1
        assert got[2].sandbox_id == "sb-1" and got[3] == "u1"
        assert await store.live_sandbox_ids() == []  # the mark ran after the record
        assert len(hops) == 2

        def boom() -> None:
            raise ValueError("boom")

        ok, bad = await asyncio.gather(store.sandbox_owner("sb-1"), store._run(boom), return_exceptions=True)
        assert ok == "u1" and isinstance(bad, ValueError) and len(hops) == 3
    finally:
        await store.close()


async def test_a_closed_store_answers_an_error_not_a_hang(tmp_path: Path) -> None:
    """A call after close fails at once (the hand-over to a shut-down thread is refused)."""
    store = SqliteStateStore(tmp_path / "s.db")
    await store.close()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(store.sandbox_owner("sb-1"), 2)
