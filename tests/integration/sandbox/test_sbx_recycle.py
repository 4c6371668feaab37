"""Recycling (issue 15): a sandbox its user destroyed goes back to the warm pool under a new
id instead of being torn down. The next tenant must find no trace of the previous one.

The previous tenant here is hostile: an agent background job and a setsid daemon whose
argv carry a secret, files in /tmp, /work, /root and /dev/shm, a secret in its env, CPU
and memory burnt (cgroup counters and peaks). After the recycle the next tenant's sandbox
must show none of it: no process, no file, no env, a hostname that is its own id, an
empty background table, zeroed cgroup counters (CPU time, memory peak, failcnt), and the
same limits and device rules as a fresh create. The old id is dead at once. Container tier only: gVisor pool shapes and
networked shapes are torn down as before (``SandboxManager._recycle_plan``).
"""

from __future__ import annotations

import pytest
from sbx_helpers import cgroup_file, leftovers, sh

from dsec.errors import Conflict, DSecError
from dsec.models import SandboxSpec
from dsec.node import cgroups
from dsec.runtime import agent_client

pytestmark = pytest.mark.integration

POOL = SandboxSpec(image="busybox", isolation="container", cpu=0.5, memory="256M", disk="64M",
                   labels={"dsec.pool": "1"}, timeout=7 * 24 * 3600)
SECRET = "alice-secret-4711"
HOSTILE = (
    f"echo {SECRET} > /tmp/t; mkdir -p /work && echo {SECRET} > /work/w; echo {SECRET} > /root/r; "
    f"echo {SECRET} > /dev/shm/s; (setsid sh -c 'sleep 1000; : {SECRET}-daemon' >/dev/null 2>&1 &); "
    "dd if=/dev/zero of=/dev/shm/big bs=1M count=48 2>/dev/null; rm /dev/shm/big; "
    "i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; sleep 0.05"
)
CHECK = ("cat /tmp/t /work/w /root/r /dev/shm/s 2>/dev/null; env; hostname; ps -o args; ls -A /tmp /dev/shm")


def _counters(sid: str) -> dict[str, int]:
    return {f"{c}/{n}": int(cgroup_file(c, sid, n).read_text()) for c, n in (
        ("cpuacct", "cpuacct.usage"), ("memory", "memory.max_usage_in_bytes"), ("memory", "memory.failcnt"))}


def _limits(sid: str) -> dict[str, str]:
    return {f"{c}/{n}": cgroup_file(c, sid, n).read_text() for c, n in (
        ("memory", "memory.limit_in_bytes"), ("cpu", "cpu.cfs_quota_us"), ("pids", "pids.max"),
        ("devices", "devices.list"), ("cpuset", "cpuset.cpus"))}


def _count_clears(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record each background-table clear request a recycle sends."""
    calls: list[object] = []
    real = agent_client.agent_clear_background

    async def counted(sock: object) -> int:
        calls.append(sock)
        return await real(sock)  # type: ignore[arg-type]
    monkeypatch.setattr(agent_client, "agent_clear_background", counted)
    return calls


async def test_recycled_sandbox_has_no_trace_of_the_previous_tenant(node, monkeypatch):
    """A hostile tenant's processes, files, env, background table and cgroup counters do
    not reach the next tenant of the recycled sandbox; the old id is retired at once;
    limits and device rules are those of a fresh create; a repeated kill of the old id while
    the recycle runs changes nothing; destroy leaves nothing of either id. The recycle
    looks its image up once (its checks' answer is reused; issue 15: one per episode), and
    sends the agent's table clear only when a background job was started in it."""
    member = await node.create(POOL, pooled=True)
    alice = await node.claim(member.id, POOL.model_copy(update={"env": {"SECRET": SECRET}, "labels": {"t": "a"}}),
                             "alice")
    bg = await sh(node, alice.id, ["sh", "-c", f"sleep 1000; : {SECRET}-job"], background=True)
    assert bg.pid
    r = await sh(node, alice.id, HOSTILE)
    assert r.exit_code == 0, r
    dirty = await sh(node, alice.id, CHECK)
    assert dirty.stdout.count(SECRET) >= 7, dirty.stdout  # the check sees every trace while they exist
    before, limits = _counters(alice.id), _limits(alice.id)
    assert before["memory/memory.max_usage_in_bytes"] > 40 << 20

    clears = _count_clears(monkeypatch)
    images, lookups = node.manager.images, []
    resolve_fast = images.resolve_fast
    with monkeypatch.context() as m:
        m.setattr(images, "resolve_fast", lambda ref: lookups.append(ref) or resolve_fast(ref))
        done = await node.start_recycle(alice.id, POOL)  # returns once the old id is retired
    assert lookups == [POOL.image]
    assert alice.id not in {i.id for i in await node.list()}  # killed: not listed while it is reset
    with pytest.raises(DSecError):
        await sh(node, alice.id, "true")
    await node.destroy(alice.id)  # a repeated kill while the reset runs: a no-op
    fresh = await done
    assert fresh.id != alice.id and fresh.state.value == "ready" and fresh.tenant is None
    assert fresh.labels == POOL.labels and fresh.pid == alice.pid  # the same init: recycled in place
    assert (await node.get(alice.id)).state.value == "stopped"
    with pytest.raises(DSecError):
        await sh(node, alice.id, "true")
    assert cgroups.sandbox_cgroup_dirs("dsec", alice.id) == []
    assert leftovers(node, alice.id) == []
    assert len(clears) == 1  # alice started a background job: her agent's table was cleared

    bob = await node.claim(fresh.id, POOL.model_copy(update={"labels": {"t": "b"}}), "bob")
    r = await sh(node, bob.id, CHECK)
    assert r.exit_code == 0, r
    assert SECRET not in r.stdout + r.stderr, r.stdout
    assert "SECRET=" not in r.stdout
    lines = r.stdout.split()
    assert bob.id in lines and alice.id not in r.stdout  # hostname is the new id
    assert await node.processes(bob.id) == []  # the agent's background table starts empty
    assert "sleep" not in r.stdout  # neither the job nor the setsid daemon survived
    after = _counters(bob.id)
    assert after["memory/memory.failcnt"] == 0
    assert after["memory/memory.max_usage_in_bytes"] < before["memory/memory.max_usage_in_bytes"] // 4
    assert after["cpuacct/cpuacct.usage"] < before["cpuacct/cpuacct.usage"]
    assert _limits(bob.id) == limits  # same limits and device rules as the fresh create had
    for path in ("/tmp/t", "/work/w", "/root/r"):
        with pytest.raises(DSecError):
            await node.read_file(bob.id, path)
    await node.write_file(bob.id, "/tmp/mine", b"bob")  # the file API works on the new root
    assert (await sh(node, bob.id, "cat /tmp/mine")).stdout == "bob"

    # Bob never started a background job: his recycle sends no clear request (issue 15),
    # and the next member's table is still empty.
    carol = await (await node.start_recycle(bob.id, POOL))
    assert len(clears) == 1
    assert await node.processes(carol.id) == []
    await node.destroy(carol.id)
    assert leftovers(node, carol.id, [carol.pid]) == []


async def test_recycle_refuses_a_sandbox_unlike_the_pool_shape(node):
    """A sandbox whose limits differ from the pool shape (here its pids) is not recycled:
    Conflict, and it stays the user's, untouched and usable."""
    info = await node.create(POOL.model_copy(update={"pids": 64, "labels": {}}), tenant="alice")
    with pytest.raises(Conflict, match="limits differ"):
        await node.recycle(info.id, POOL)
    assert (await node.get(info.id)).state.value == "idle"
    assert (await sh(node, info.id, "echo ok")).stdout == "ok\n"
