"""Exec lifetime on both tiers, regression tests for issue 18 finding 9 (gVisor: exec
outlived its caller): an exec whose caller goes away (stream closed, task cancelled) or
whose timeout passes takes its whole process tree with it — setsid'd daemons included —
timeouts round up (never to 0 = "no timeout"), and every ``runsc`` child of the node is
reaped (no zombies)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest
from sbx_helpers import count_procs, make

from dsec.models import ExecRequest

pytestmark = pytest.mark.integration


def runsc_zombies() -> set[int]:
    """Zombie ``runsc`` children of this process (the node agent runs in it)."""
    me, out = os.getpid(), set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state == "Z" and int(ppid) == me and comm.startswith("runsc"):
            out.add(int(d))
    return out


async def new_runsc_zombies(before: set[int], wait_s: float = 5.0) -> set[int]:
    """Zombie runsc children not in ``before`` once their reapers had ``wait_s`` to run:
    the relay's ``runsc exec`` exits after the command's tree is gone (it notices its
    closed connection), and the event loop reaps it a moment later."""
    end = time.monotonic() + wait_s
    while (left := runsc_zombies() - before) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return left


async def test_closing_a_stream_kills_the_tree_and_reaps(node, tier):
    """Leaving an exec stream early (the caller went away) kills the command, its
    background jobs and a setsid'd daemon at once, leaves no zombie runsc behind, and the
    sandbox keeps serving. (gVisor used to leave the command running for good.)"""
    info = await make(node, tier)
    before = runsc_zombies()
    stream = node.exec_stream(info.id, ExecRequest(cmd="echo started; sleep 305 & setsid sleep 306 & sleep 307",
                                                   timeout=120))
    async with contextlib.aclosing(stream):
        async for ev in stream:
            assert ev.kind == "stdout" and ev.data == "started\n", ev
            break
    assert await count_procs(node, info.id, "^sleep 30[567]", 0) == 0
    assert await new_runsc_zombies(before) == set()
    r = await node.exec(info.id, ExecRequest(cmd="echo ok"))
    assert (r.exit_code, r.stdout) == (0, "ok\n")


async def test_cancelled_exec_kills_the_tree_and_reaps(node, tier):
    """A plain exec whose task is cancelled (client disconnect, server shutdown) kills the
    command's tree too, and its runsc child is reaped."""
    info = await make(node, tier)
    before = runsc_zombies()
    task = asyncio.ensure_future(node.exec(info.id, ExecRequest(cmd="sleep 308 & setsid sleep 309 & wait",
                                                                timeout=120)))
    assert await count_procs(node, info.id, "^sleep 30[89]", 2) == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await count_procs(node, info.id, "^sleep 30[89]", 0) == 0
    assert await new_runsc_zombies(before) == set()


async def test_sub_millisecond_timeout_rounds_up(node, tier):
    """timeout=0.0009 is 1 ms, never 0 (= no timeout): the exec answers timed_out at once
    and the command is dead when it does (gVisor used to run it on for good while answering
    timed_out after the 10 s grace)."""
    info = await make(node, tier)
    t0 = time.monotonic()
    r = await node.exec(info.id, ExecRequest(cmd="sleep 310; echo finished", timeout=0.0009))
    took = time.monotonic() - t0
    assert r.timed_out and "finished" not in r.stdout, r
    assert took < 5, f"a 1 ms timeout took {took:.1f} s"
    assert await count_procs(node, info.id, "^sleep 310", 0, polls=5) == 0
