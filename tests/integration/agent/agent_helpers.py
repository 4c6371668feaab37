"""Helpers of the exec agent tests (run commands inside the agent's pid namespace)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from dsec.runtime.agent_client import ExecOutcome, agent_exec

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}


async def sh(sock: Path, script: str, *args: str, timeout: float = 20, max_output: int = 1 << 20,
             stdin: bytes | None = None, cwd: str = "/") -> ExecOutcome:
    """Run a /bin/sh script in the agent's namespace."""
    return await agent_exec(sock, ["/bin/sh", "-c", script, "sh", *args], env=ENV, cwd=cwd, timeout=timeout,
                            stdin=stdin, max_output=max_output)


async def alive(sock: Path, pids: list[int]) -> list[int]:
    """Which of pids (in the agent's pid namespace) still exist and are not zombies."""
    r = await sh(sock, 'for p; do [ -e /proc/$p ] && ! grep -q "^State:.*Z" /proc/$p/status && echo $p; done; true',
                 *map(str, pids))
    assert r.exit_code == 0, r
    return [int(x) for x in r.stdout.split()]


async def wait_dead(sock: Path, pids: list[int], within: float = 5.0) -> list[int]:
    """Poll until all pids are gone; returns the survivors (empty on success)."""
    deadline = time.monotonic() + within
    left = await alive(sock, pids)
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        left = await alive(sock, pids)
    return left
