"""The local trajectory journal of a live episode (appended off the exec path)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from ckpt_agent import command, make_engine, run_agent

from dsec.checkpoints.trajectory import read_journal
from dsec.models import ExecRequest
from dsec.testing.faults import FAULT_EXIT_CODE

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent



def _export(eng, ep="ep") -> list[dict]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(eng.export(ep)), read_across_frames=True).read()
    return [json.loads(x) for x in raw.splitlines()]


def test_journal_equals_the_checkpointed_trajectory_and_restarts_on_restore(work):
    """Every committed step is in the journal exactly as in the checkpoint units (the unit
    reuses the journal's frames), a restored episode's journal restarts from its unit, and
    closing the episode removes it (no per-episode file left on the node)."""
    eng = make_engine(work, full_every=3)   # compaction every 3 steps: concatenated frames
    asyncio.run(run_agent(eng, "ep", 7))
    path = eng._journal_path("ep")
    assert read_journal(path) == _export(eng) and len(_export(eng)) == 7
    asyncio.run(eng.forget("ep"))
    eng2 = make_engine(work, full_every=3)

    async def more():
        await eng2.open("ep")
        await eng2.step("ep", 7, ExecRequest(cmd=command(7)))
        assert read_journal(path) == _export(eng2) and [r["step"] for r in read_journal(path)] == list(range(8))
        await eng2.close("ep")
    asyncio.run(more())
    assert not path.exists()  # closed: the units hold the trajectory, the local copy goes


def test_crash_between_journal_and_metadata_keeps_journal_consistent_after_resume(work):
    """Killed after the step's journal record is durable but before its unit's metadata:
    the journal holds that executed-but-unacknowledged step, the units do not; resuming
    rewrites the journal from the last unit and the step then runs once, live."""
    make_engine(work)
    proc = subprocess.run([sys.executable, str(HERE / "ckpt_agent.py"), str(work), "ep", "6"],
                          env={**os.environ, "DSEC_FAULTS": "ckpt.after_parts=exit@4"}, timeout=120, check=False)
    assert proc.returncode == FAULT_EXIT_CODE
    eng = make_engine(work)
    journal = read_journal(eng._journal_path("ep"))
    logged = _export(eng)
    assert journal[: len(logged)] == logged and len(journal) == len(logged) + 1
    res = asyncio.run(run_agent(eng, "ep", 6))
    assert [r.replayed for r in res] == [True] * len(logged) + [False] * (6 - len(logged))
    assert read_journal(eng._journal_path("ep")) == _export(eng)
    asyncio.run(eng.close("ep"))
