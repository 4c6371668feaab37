"""Timeouts and cancellation kill the command's whole process tree, daemons included."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from agent_helpers import ENV, alive, sh, wait_dead

from dsec.runtime.agent_client import agent_exec_stream, agent_ping

pytestmark = pytest.mark.integration

# child in the group, a setsid'd daemon (own session) and a double-forked orphan
TREE = ('sleep 1000 & echo $!; setsid sleep 1000 & echo $!; '
        '(sh -c "sleep 1000 & echo \\$!; exec sleep 1000") & echo $!; sleep 0.3; echo ready; wait')


def pids_from(out: bytes) -> list[int]:
    return [int(x) for x in out.split() if x.isdigit()]


async def test_timeout_kills_tree_including_setsid_daemon(sock: Path) -> None:
    """On timeout every process of the tree dies (verified by pid) and the sandbox lives on."""
    r = await sh(sock, TREE, timeout=1.0)
    assert r.timed_out and r.exit_code == 137
    pids = pids_from(r.stdout) + [r.pid]  # type: ignore[list-item]
    assert len(pids) == 5, r.stdout
    assert await alive(sock, pids) == []
    assert await agent_ping(sock, 2.0)


async def test_client_disconnect_cancels_and_kills_tree(sock: Path) -> None:
    """Closing the stream early (host cancel) kills the running tree."""
    out = b""
    async with contextlib.aclosing(agent_exec_stream(sock, ["/bin/sh", "-c", TREE], env=ENV, cwd="/",
                                                     timeout=None)) as stream:
        async for item in stream:
            assert isinstance(item, tuple)
            out += item[1]
            if b"ready" in out:
                break
    pids = pids_from(out)
    assert len(pids) == 4
    assert await wait_dead(sock, pids) == []


async def test_background_job_of_finished_command_survives(sock: Path) -> None:
    """Without timeout or cancel, a daemon the command started keeps running after it exits."""
    r = await sh(sock, "setsid sleep 1000 >/dev/null 2>&1 & echo $!")
    (pid,) = pids_from(r.stdout)
    assert r.exit_code == 0 and await alive(sock, [pid]) == [pid]
    await sh(sock, f"kill -9 {pid}")
    assert await wait_dead(sock, [pid]) == []
