"""A node agent killed with SIGKILL: callers get a clear error (NodeLost, 410) or an
answer, never a hang; Ray restarts the detached actor on its node, the new agent
reconciles (adopts the sandbox that kept running) and the same sandbox answers again.
Calls take the agent's direct data endpoint (dsec.cluster.dataplane), which refuses a
wrong token; the restarted agent's new endpoint is found by the proxy itself."""

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
    """SIGKILL of the agent process: an exec in flight on the direct data path ends with
    NodeLost within seconds (not when the command would have ended), the next calls end
    with NodeLost or succeed; once Ray restarted the actor, the sandbox created before is
    adopted (same id, its file intact) under a new agent pid, reached on the new agent's
    own endpoint and token. A wrong token is refused by the endpoint."""
    import ray

    from dsec.cluster import local
    from dsec.cluster.dataplane import DataClient, Refused
    from dsec.cluster.ray import RayNodeProxy, connect, get_agent

    base = tmp_path / "c"
    c = local.up(base, 1, ["busybox"], log=lambda _m: None)
    try:
        connect(c.address)
        p = RayNodeProxy("n0", get_agent("n0"))
        await p.start()
        info = await p.create(SandboxSpec(image="busybox", cpu=0.25, memory="128M", disk="64M"))
        await p.write_file(info.id, "/work/keep", b"kept")
        ep = p._endpoint
        assert ep is not None and ep.host == c.nodes[0].ip  # on the node's own address
        assert p.stats["ray"] == 0 and p.stats["direct"] == 2
        bad = DataClient(ep.model_copy(update={"token": "x" * len(ep.token)}), errors.NodeLost)
        with pytest.raises(Refused, match="Unauthorized"):
            await bad.connect(10)
        old_pid = await p.agent_pid()
        slow = asyncio.ensure_future(p.exec(info.id, ExecRequest(cmd="sleep 60")))
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(errors.NodeLost):
            await asyncio.wait_for(slow, 30)
        assert time.monotonic() - t0 < 10
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
        assert p._endpoint is not None and p._endpoint.token != ep.token and p.stats["ray"] == 0
        assert [i.id for i in await p.list()] == [info.id]
        await p.destroy(info.id)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        local.down(base, log=lambda _m: None)
