"""Exec semantics through the node agent, on both tiers unless a test says otherwise:
timeouts kill the command's whole process tree but never the sandbox, stdin, env/cwd,
argv passed verbatim without a shell, exit codes, streaming, background processes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sbx_helpers import count_procs, make, sh

from dsec.models import ExecRequest

pytestmark = pytest.mark.integration


async def _start_bystander(node, tier, sid) -> None:
    if tier == "container":
        await node.exec(sid, ExecRequest(cmd=["sleep", "999"], background=True))
    else:
        await sh(node, sid, "sleep 999 </dev/null >/dev/null 2>&1 &")


async def test_timeout_kills_the_whole_tree_not_the_sandbox(node, tier):
    """A timed-out command is reported timed_out and its whole tree dies (children and
    orphaned grandchildren), while processes of other execs and the sandbox live."""
    info = await make(node, tier)
    await _start_bystander(node, tier, info.id)
    r = await sh(node, info.id, "sleep 301 & (sleep 302 &); sleep 304", timeout=1)
    assert r.timed_out, r
    assert await count_procs(node, info.id, "^sleep 30[1-4]", 0) == 0
    assert await count_procs(node, info.id, "^sleep 999", 1) == 1
    assert (await node.get(info.id)).state.value == "idle"


async def test_timeout_kills_setsid_daemons(node, tier):
    """A daemon the command detached with setsid is still part of its tree and dies with
    it on timeout; the exec returns at its timeout even though the daemon held stdout.
    (gVisor has no child subreaper: `dsec-init run` freezes the tree by /proc ppid links
    before killing it, so the daemon cannot escape to PID 1.)"""
    info = await make(node, tier)
    r = await sh(node, info.id, "setsid sleep 303 & sleep 304", timeout=1)
    assert r.timed_out, r
    assert await count_procs(node, info.id, "^sleep 30[34]", 0, polls=5) == 0


async def test_background_job_does_not_hold_the_exec(node, tier):
    """`server &` without redirection: the exec returns when the command exits, with its
    output, although the job keeps the stdout pipe open (gVisor used to block on it)."""
    info = await make(node, tier)
    r = await sh(node, info.id, "sleep 60 & echo started", timeout=30)
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "started\n", False), r
    assert r.duration < 30
    assert await count_procs(node, info.id, "^sleep 60", 1) == 1


async def test_stdin_env_cwd_and_exit_codes(node, tier):
    """stdin reaches the command (also past one 64 KiB frame); the sandbox's env is
    merged with the exec's (exec wins); cwd applies; 127 for a missing program, 126 for
    a cwd that cannot be entered, 128+N when killed by signal N."""
    info = await make(node, tier, env={"A": "sandbox", "B": "sandbox"})
    r = await node.exec(info.id, ExecRequest(cmd=["cat"], stdin="hello\nworld"))
    assert (r.exit_code, r.stdout) == (0, "hello\nworld"), r
    big = "x" * 200_000
    r = await node.exec(info.id, ExecRequest(cmd="wc -c", stdin=big))
    assert r.stdout.strip() == "200000", r
    r = await node.exec(info.id, ExecRequest(cmd="echo $A $B $HOME; pwd", env={"B": "exec"}, cwd="/tmp"))
    assert r.stdout == "sandbox exec /root\n/tmp\n", r
    assert (await sh(node, info.id, ["no-such-program"])).exit_code == 127
    assert (await node.exec(info.id, ExecRequest(cmd="true", cwd="/no/such/dir"))).exit_code == 126
    assert (await sh(node, info.id, "kill -TERM $$")).exit_code == 143


async def test_argv_is_passed_verbatim_without_a_shell(node, tier):
    """An argv list is executed directly: quotes, $vars, ;, backticks and globs are data."""
    info = await make(node, tier)
    args = ["a b", "$HOME", ";rm -rf /work", "`id`", "*", "'q'", ""]
    r = await sh(node, info.id, ["printf", "%s|", *args])
    assert r.stdout == "|".join(args) + "|", r
    r = await sh(node, info.id, "echo $((6*7))")
    assert r.stdout == "42\n"  # a string goes through /bin/sh -c


async def test_streaming_delivers_output_then_exit(node, tier):
    """exec_stream yields stdout and stderr chunks and then exactly one exit event; on
    runc chunks arrive while the command runs (several events before exit)."""
    info = await make(node, tier)
    events = []
    async for ev in node.exec_stream(info.id, ExecRequest(cmd="echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c")):
        events.append(ev)
    assert events[-1].kind == "exit" and events[-1].result.exit_code == 0
    assert [e.kind for e in events].count("exit") == 1
    out = "".join(e.data for e in events if e.kind == "stdout")
    err = "".join(e.data for e in events if e.kind == "stderr")
    assert (out, err) == ("a\nc\n", "b\n")
    if tier == "container":
        assert len([e for e in events if e.kind != "exit"]) >= 3


async def test_closing_a_stream_cancels_the_command(node, tier):
    """Leaving an exec stream early (the caller went away) kills that command's tree
    (runc tier: the agent connection closes; gVisor: `runsc kill --pid` of its
    `dsec-init run`) and the sandbox keeps serving."""
    info = await make(node, tier)
    stream = node.exec_stream(info.id, ExecRequest(cmd="echo started; sleep 305 & sleep 306"))
    async with contextlib.aclosing(stream):
        async for ev in stream:
            assert ev.kind == "stdout" and ev.data == "started\n"
            break
    assert await count_procs(node, info.id, "^sleep 30[56]", 0) == 0  # killed after the close


async def test_background_processes_list_and_kill(node, tier):
    """Background execs return a pid at once, are listed as running, and kill_process
    ends them (their tree too), on both tiers (gVisor's go through the same agent)."""
    info = await make(node, tier)
    r = await node.exec(info.id, ExecRequest(cmd="sleep 401 & sleep 402", background=True))
    procs = {p.pid: p for p in await node.processes(info.id)}
    assert procs[r.pid].running
    await node.kill_process(info.id, r.pid, 9)
    for _ in range(100):  # the kill is answered at once; PID 1 records the exit when it reaps
        procs = {p.pid: p for p in await node.processes(info.id)}
        if not procs[r.pid].running:
            break
        await asyncio.sleep(0.05)
    assert not procs[r.pid].running and procs[r.pid].exit_code == 137
    assert await count_procs(node, info.id, "^sleep 40[12]", 0) == 0
