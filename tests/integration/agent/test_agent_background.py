"""Background processes: start, list, signal (whole tree), failures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agent_helpers import ENV, alive, sh, wait_dead

from dsec.errors import InvalidArgument, NotFound
from dsec.runtime.agent_client import agent_background, agent_kill, agent_ps

pytestmark = pytest.mark.integration


async def _ps_entry(sock: Path, pid: int, *, running: bool, within: float = 5.0):
    for _ in range(int(within / 0.05)):
        entry = next(e for e in await agent_ps(sock) if e.pid == pid)
        if entry.running == running:
            return entry
        await asyncio.sleep(0.05)
    raise AssertionError(f"pid {pid} never reached running={running}")


async def test_background_output_file_and_exit_code(sock: Path, tmp_path: Path) -> None:
    """A background command writes to its output file; ps then shows its exit code."""
    out = tmp_path / "bg.log"
    pid = await agent_background(sock, ["/bin/sh", "-c", "echo hello; echo oops >&2; exit 5"], env=ENV,
                                 cwd="/", output_path=str(out))
    entry = await _ps_entry(sock, pid, running=False)
    assert entry.exit_code == 5 and entry.argv[:2] == ["/bin/sh", "-c"]
    assert out.read_text() == "hello\noops\n"


async def test_kill_signals_group_and_setsid_descendants(sock: Path, tmp_path: Path) -> None:
    """kill reaches the background process, its group and a setsid'd grandchild."""
    pidfile = tmp_path / "pids"
    pid = await agent_background(
        sock, ["/bin/sh", "-c", f"setsid sleep 1000 & echo $! > {pidfile}; sleep 1000"], env=ENV, cwd="/")
    entry = await _ps_entry(sock, pid, running=True)
    assert entry.exit_code is None and entry.started_at > 0
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        await asyncio.sleep(0.02)
    daemon = int(pidfile.read_text())
    assert await alive(sock, [pid, daemon]) == [pid, daemon]
    await agent_kill(sock, pid, 15)
    entry = await _ps_entry(sock, pid, running=False)
    assert entry.exit_code == 128 + 15
    assert await wait_dead(sock, [daemon]) == []


async def test_background_failures(sock: Path) -> None:
    """A missing program fails the start at once; killing an unknown pid is NotFound."""
    with pytest.raises(InvalidArgument, match="no-such-bg-prog: command not found"):
        await agent_background(sock, ["no-such-bg-prog"], env=ENV, cwd="/")
    with pytest.raises(InvalidArgument, match="cannot change directory"):
        await agent_background(sock, ["true"], env=ENV, cwd="/nope")
    r = await sh(sock, "sleep 1000 >/dev/null & echo $!")
    fg_orphan = int(r.stdout)
    with pytest.raises(NotFound, match=f"no background process with pid {fg_orphan}"):
        await agent_kill(sock, fg_orphan, 9)
    await sh(sock, f"kill -9 {fg_orphan}")
