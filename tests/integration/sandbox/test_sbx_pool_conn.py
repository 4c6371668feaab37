"""A new warm-pool member keeps one agent connection for its first user (issue 15: the
first exec after a warm hand-over then skips the connect and the agent's handler fork,
~1-1.5 ms of a ~5 ms budget). A plain create keeps none (its first exec is the user's)."""

from __future__ import annotations

import pytest
from sbx_helpers import sh

from dsec.models import SandboxSpec
from dsec.runtime import agent_client as ac

pytestmark = pytest.mark.integration

POOL = SandboxSpec(image="busybox", isolation="container", cpu=0.5, memory="64M", disk="64M",
                   labels={"dsec.pool": "1"}, timeout=3600)


async def test_pool_member_keeps_an_agent_connection_for_its_first_exec(node):
    """After a pooled create one idle connection waits on the member's agent socket; the
    claimed member's first exec takes it (nothing left idle while it runs), and the
    command's output is its own. A plain create leaves no idle connection."""
    member = await node.create(POOL, pooled=True)
    plain = await node.create(POOL.model_copy(update={"labels": {}}))
    sock = node.manager.paths(member.id).socket
    idle = list(ac._idle_of(sock) or [])
    assert len(idle) == 1
    assert not ac._idle_of(node.manager.paths(plain.id).socket)
    await node.claim(member.id, POOL.model_copy(update={"labels": {"t": "a"}}), "alice")
    seen = []
    real = ac._Conn.open

    async def counting_open(path):  # type: ignore[no-untyped-def]
        seen.append(path)
        return await real(path)

    ac._Conn.open = counting_open  # type: ignore[method-assign]
    try:
        r = await sh(node, member.id, ["echo", "first"])
    finally:
        ac._Conn.open = real  # type: ignore[method-assign]
    assert r.exit_code == 0 and r.stdout == "first\n" and seen == []  # no new connection was opened
    assert ac._idle_of(sock) == idle  # the same connection, back in the pool
    for sid in (member.id, plain.id):
        await node.destroy(sid)
