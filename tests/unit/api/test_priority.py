"""GC pause recording for the API process's metrics."""

from __future__ import annotations

import gc

from dsec.api.priority import GcPauses, boost_current_thread


def test_gc_pauses_are_recorded_and_drained() -> None:
    """Every collection is reported once with its generation; close() stops recording."""
    pauses = GcPauses()
    try:
        gc.collect()
        got = pauses.drain()
        assert any(gen == 2 and 0 <= s < 10 for gen, s in got)
        assert pauses.drain() == []
    finally:
        pauses.close()
    gc.collect()
    assert pauses.drain() == []


def test_nice_zero_means_leave_alone() -> None:
    """api_loop_nice=0 changes nothing (and reports it did not)."""
    assert boost_current_thread(0) is False
