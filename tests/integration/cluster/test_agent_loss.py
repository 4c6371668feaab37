"""A node agent killed with SIGKILL: callers get a clear error (NodeLost, 410) or an
answer, never a hang; Ray restarts the detached actor on its node, the new agent
reconciles (adopts the sandbox that kept running) and the same sandbox answers again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")


async def test_agent_sigkill_is_node_lost_then_adopted(tmp_path: Path) -> None:
    """SIGKILL of the agent process: the next calls end within seconds with NodeLost or
    succeed; once Ray restarted the actor, the sandbox created before is adopted (same
    id, its file intact) under a new agent pid."""
    import ray

    from dsec.cluster import local
    from dsec.cluster.ray import RayNodeProxy, connect, get_agent

    base = tmp_path / "c"
    c = local.up(base, 1, ["busybox"], log=lambda _m: None)
    try:
        connect(c.address)
        p = RayNodeProxy("n0", get_agent("n0"))
        await p.start()
        info = await p.create(SandboxSpec(image="busybox", cpu=0.25, memory="128M", disk="64M"))
        await p.write_file(info.id, "/work/keep", b"kept")
        old_pid = await p.agent_pid()
        os.kill(old_pid, signal.SIGKILL)
        lost = 0
        deadline = time.monotonic() + 120
        while True:
            try:
                r = await asyncio.wait_for(p.exec(info.id, ExecRequest(cmd="cat /work/keep")), 30)
                break
            except errors.NodeLost as e:
                assert e.http_status == 410 and "n0" in e.message
                lost += 1
            assert time.monotonic() < deadline, "the agent did not come back"
            await asyncio.sleep(0.5)
        assert (r.exit_code, r.stdout) == (0, "kept")
        assert await p.agent_pid() != old_pid
        assert [i.id for i in await p.list()] == [info.id]
        await p.destroy(info.id)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        local.down(base, log=lambda _m: None)
