"""Full checkpoints squashed in the background from stored parts, off the step path."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_agent import command, make_engine
from ckpt_helpers import tree

from dsec.checkpoints.unit import complete_units
from dsec.models import ExecRequest, SandboxSpec
from dsec.testing.faults import FAULT_EXIT_CODE

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent



async def _steps(eng, start: int, n: int, wait_squash: bool = True) -> list:
    out = []
    for i in range(start, start + n):
        out.append(await eng.step("ep", i, ExecRequest(cmd=command(i))))
        live = eng._live["ep"]
        if wait_squash and live.squashing is not None:
            await live.squashing  # deterministic test: let each squash land before the next step
    return out


def test_background_squash_replaces_the_prefix_and_restores_identically(work):
    """Once the chain reaches full_every layers a background job stores one full layer
    (its provenance in ``squash_of``); the next unit references it in place of those
    layers, restore mounts at most full_every layers, and the restored tree is identical."""
    eng = make_engine(work, full_every=3)

    async def go():
        await eng.open("ep", SandboxSpec(image="bb"))
        await _steps(eng, 0, 9)
        info = await eng.info("ep")
        before = tree(work / "sbx" / info.sandbox_id / "merged", mtimes=False)
        await eng.forget("ep")
        return info, before
    info, before = asyncio.run(go())
    assert eng.counters["squashes"] >= 2 and eng.counters["squash_failures"] == 0
    meta = complete_units(eng.store, "ep")[0]
    assert meta.fs_chain[0].full and meta.fs_chain[0].squash_of, meta.fs_chain
    assert len(meta.fs_chain) <= 3
    eng2 = make_engine(work, full_every=3)

    async def back():
        opened = await eng2.open("ep")
        live = await eng2.info("ep")
        t = tree(work / "sbx" / live.sandbox_id / "merged", mtimes=False)
        await eng2.close("ep")
        return opened, t
    opened, after = asyncio.run(back())
    assert opened.fs_digest == info.fs_digest and after == before


def test_crash_right_after_the_squash_is_stored_loses_nothing(work):
    """A process killed just after storing a squashed layer (before any unit references
    it) resumes from its last unit, whose incremental chain is intact."""
    make_engine(work)
    code = f"""
import asyncio, sys
sys.path.insert(0, {str(HERE)!r})
from ckpt_agent import make_engine, run_agent
asyncio.run(run_agent(make_engine(__import__('pathlib').Path({str(work)!r}), full_every=3), "ep", 8))
"""
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DSEC_FAULTS": "ckpt.squash.after_put=exit@1"},
                          timeout=120, check=False)
    assert proc.returncode == FAULT_EXIT_CODE
    eng = make_engine(work, full_every=3)

    async def finish():
        info = await eng.open("ep")
        res = await _steps(eng, 0, 8)
        await eng.close("ep")
        return info, res
    info, res = asyncio.run(finish())
    assert 0 < info.steps < 8
    assert [r.replayed for r in res] == [True] * info.steps + [False] * (8 - info.steps)
    # /work/log has one line per executed writing step: none ran twice.
    assert res[-1].stdout.strip() == str(sum(1 for i in range(8) if i % 3 != 2))
