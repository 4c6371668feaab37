"""Kept-alive agent connections (issue 15): one connection carries exec after exec, never
mixes two execs' output, concurrency still works, and a dead pooled connection is
replaced without the caller seeing it. The command's parent pid is its handler (one
process per connection), which is how these tests see whether a connection was reused."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from agent_helpers import ENV, sh

from dsec.config import get_settings
from dsec.runtime.agent_client import agent_background, agent_forget

pytestmark = pytest.mark.integration


async def _handler(sock: Path, **kw: object) -> int:
    """The pid of the handler process that served this exec (the command's parent)."""
    r = await sh(sock, "read -r _ _ _ ppid _ < /proc/$$/stat; echo $ppid", **kw)  # type: ignore[arg-type]
    assert r.exit_code == 0, r
    return int(r.stdout)


async def test_sequential_execs_share_one_connection(sock: Path) -> None:
    """Back-to-back execs are served by the same handler: no connect/accept/fork per exec."""
    agent_forget(sock)
    first = await _handler(sock)
    assert [await _handler(sock) for _ in range(5)] == [first] * 5


async def test_keepalive_off_opens_a_connection_per_exec(sock: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """agent_keepalive_max_idle=0 restores one connection (and handler) per exec."""
    agent_forget(sock)
    monkeypatch.setattr(get_settings(), "agent_keepalive_max_idle", 0)
    assert len({await _handler(sock) for _ in range(3)}) == 3


async def test_stdin_exec_then_reuse(sock: Path) -> None:
    """An exec with stdin (even one that never reads it) leaves the connection clean for the next."""
    agent_forget(sock)
    h = await _handler(sock)
    r = await sh(sock, "cat", stdin=b"hello")
    assert r.stdout == b"hello"
    r = await sh(sock, "true", stdin=b"x" * 200_000)  # exits without reading: the agent drains it
    assert r.exit_code == 0
    assert await _handler(sock) == h
    r = await sh(sock, "echo next")
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"next\n", b"")


async def test_leftover_job_output_never_reaches_a_later_exec(sock: Path) -> None:
    """A job an exec leaves behind (still holding the old stdout) ends that connection's
    reuse: the next exec gets a new handler and sees only its own output."""
    agent_forget(sock)
    h = await _handler(sock)
    r = await sh(sock, "(sleep 0.3; echo LATE; echo LATE >&2) & echo first")
    assert r.stdout == b"first\n"
    outs = []
    for _ in range(5):
        r = await sh(sock, "sleep 0.1; echo mine")
        outs.append((r.stdout, r.stderr))
    assert outs == [(b"mine\n", b"")] * 5
    assert await _handler(sock) != h


async def test_timeout_on_a_kept_alive_connection_kills_only_its_tree(sock: Path) -> None:
    """A timed-out exec on a reused connection kills its own tree, setsid daemon included;
    a job a *previous* exec left running (handed to PID 1) survives."""
    agent_forget(sock)
    r = await sh(sock, "setsid sleep 30 >/dev/null 2>&1 & echo $!")
    survivor = int(r.stdout)
    await _handler(sock)
    pidfile = f"/tmp/daemon-{time.monotonic_ns()}"
    r = await sh(sock, f"setsid sh -c 'echo $$ > {pidfile}; exec sleep 31' & sleep 30", timeout=0.5)
    assert r.timed_out
    r = await sh(sock, f'd=$(cat {pidfile}); rm -f {pidfile}; for p in $1 $d; do '
                 '[ -e /proc/$p ] && ! grep -q "^State:.*Z" /proc/$p/status && echo alive || echo gone; done; '
                 'kill $1', str(survivor))
    assert r.stdout.splitlines() == [b"alive", b"gone"]


async def test_concurrent_execs_never_share_output(sock: Path) -> None:
    """64 execs at once on one sandbox, twice over (the second round reuses pooled
    connections): each gets exactly its own output."""
    agent_forget(sock)
    for _ in range(2):
        rs = await asyncio.gather(*(sh(sock, 'sleep 0.0$1; echo "$1"; echo "e$1" >&2', str(i)) for i in range(64)))
        assert [(r.stdout, r.stderr) for r in rs] == [(f"{i}\n".encode(), f"e{i}\n".encode()) for i in range(64)]


async def test_dead_pooled_connection_is_replaced(sock: Path) -> None:
    """The handler behind an idle pooled connection is killed (as at an agent restart or
    idle limit): the next exec transparently runs on a fresh connection, exactly once."""
    agent_forget(sock)
    h = await _handler(sock)
    await agent_background(sock, ["kill", "-9", str(h)], env=ENV, cwd="/")
    time.sleep(0.3)  # noqa: ASYNC251 - blocking on purpose: the loop must not see the EOF before the next exec
    marker = f"/tmp/once-{time.monotonic_ns()}"
    r = await sh(sock, f"echo x >> {marker}; wc -l < {marker}; rm -f {marker}")
    assert (r.exit_code, r.stdout.strip()) == (0, b"1")
    assert await _handler(sock) != h
