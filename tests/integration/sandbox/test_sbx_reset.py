"""sb.reset(): a sandbox goes back to its image's pristine state and stays usable.

Nothing a workload did may survive a reset: files (new, changed, deleted), processes
(including setsid daemons and fork bombs), /dev and /dev/shm entries, SysV IPC objects;
limits stay as created; the id, agent and file API keep working; destroy after resets
still leaves nothing behind. Container tier resets in place; gVisor re-makes the sandbox.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from sbx_helpers import cgroup_file, leftovers, make, sh

from dsec.node import cgroups

pytestmark = pytest.mark.integration

DIRTY = (
    "echo junk > /tmp/junk; echo pwned >> /etc/passwd; rm /bin/ls; mkdir -p /root/deep/er; "
    "echo x > /root/deep/er/f; echo s > /dev/shm/s; echo d > /dev/evil; rm /dev/null; echo f > /dev/null; "
    "chmod 600 /dev/zero; (setsid sleep 1000 >/dev/zero 2>&1 &); (sleep 999 &); sleep 0.05"
)
CHECK = ("test -e /tmp/junk && echo JUNK; grep -c pwned /etc/passwd; test -e /bin/ls || echo NOLS; "
         "test -e /root/deep && echo DEEP; ls /dev/shm; test -e /dev/evil && echo EVIL; "
         "test -c /dev/null || echo NULLBAD; stat -c %a /dev/zero; ps -o pid,args | grep -c 'slee[p]'")


async def test_reset_leaves_nothing_of_the_workload(node, tier):
    """Files, processes (daemons too), /dev and /dev/shm entries do not survive; the
    sandbox keeps its id and pid 1, and exec plus the file API work on the new root."""
    info = await make(node, tier)
    r = await sh(node, info.id, DIRTY)
    assert r.exit_code == 0, r
    dirty = await sh(node, info.id, CHECK)
    assert "JUNK" in dirty.stdout and "EVIL" in dirty.stdout  # the check does see a dirty sandbox

    after = await node.reset(info.id)
    assert after.id == info.id and after.state.value == "idle"
    if tier == "container":  # right after the reset: init alone
        assert cgroups.pids_in("dsec", info.id) == {info.pid}
    r = await sh(node, info.id, CHECK)
    assert r.stdout.split() == ["0", "666", "0"], r  # no junk, passwd clean, ls back, /dev exact
    if tier == "container":
        assert node.manager.counters.get("reset_in_place") == 1
        assert after.pid == info.pid  # same init: reset in place, not a restart
    await node.write_file(info.id, "/work/new.txt", b"hello")
    assert (await sh(node, info.id, "cat /work/new.txt")).stdout == "hello"
    assert await node.read_file(info.id, "/work/new.txt") == b"hello"


async def test_reset_twice_and_destroy_leaves_nothing(node, tier):
    """Repeated resets reuse the sandbox; destroy afterwards still cleans every resource
    (no stale reset mounts or scratch dirs)."""
    info = await make(node, tier)
    for i in range(3):
        await sh(node, info.id, f"echo {i} > /tmp/round{i}")
        await node.reset(info.id)
        assert (await sh(node, info.id, "ls /tmp | wc -l")).stdout.strip() == "0"
    pid = (await node.get(info.id)).pid
    await node.destroy(info.id)
    assert leftovers(node, info.id, [pid]) == []


async def test_reset_kills_fork_bomb_and_keeps_limits(node):
    """A fork bomb filling the pids limit is gone after reset; memory/pids limits are
    still what the sandbox was created with."""
    info = await make(node, "container", pids=64)
    await node.exec(info.id, __import__("dsec.models", fromlist=["ExecRequest"]).ExecRequest(
        # Each level sleeps after forking, so the bomb holds the pids limit instead of
        # dying out between polls (a bare `b|b &` in ash can collapse within milliseconds).
        cmd="b(){ b|b & sleep 1000; }; b", background=True))
    for _ in range(100):  # the bomb is running (wait for it on a loaded box)
        if len(cgroups.pids_in("dsec", info.id)) > 3:
            break
        await asyncio.sleep(0.05)
    assert len(cgroups.pids_in("dsec", info.id)) > 3
    await node.reset(info.id)
    assert cgroups.pids_in("dsec", info.id) == {info.pid}
    assert cgroup_file("pids", info.id, "pids.max").read_text().strip() == "64"
    assert int(cgroup_file("memory", info.id, "memory.limit_in_bytes").read_text()) == info.memory
    assert (await sh(node, info.id, "echo ok")).stdout.strip() == "ok"


async def test_reset_removes_sysv_ipc(node, python_image):
    """SysV shm segments, semaphores and message queues outlive their processes; reset
    removes them from the sandbox's IPC namespace."""
    info = await make(node, "container", image=python_image, memory="512M")
    mk = ("import ctypes; c=ctypes.CDLL(None); "
          "print(c.shmget(0,4096,0o1600), c.semget(0,1,0o1600), c.msgget(0,0o1600))")
    r = await sh(node, info.id, ["python3", "-c", mk])
    assert r.exit_code == 0 and "-1" not in r.stdout.split(), r
    count = "cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg | grep -vc key"
    assert (await sh(node, info.id, ["sh", "-c", count])).stdout.strip() == "3"
    await node.reset(info.id)
    assert (await sh(node, info.id, ["sh", "-c", count])).stdout.strip() == "0"


async def test_reset_median_fast_in_place(node):
    """The in-place path is what runs every time (not a silent fallback to a restart). Its
    speed is a bench figure (`dsec bench speed`), printed here, not asserted: timings on a
    shared box are not a test's business."""
    info = await make(node, "container")
    times = []
    for i in range(15):
        await sh(node, info.id, f"echo {i} > /tmp/f{i}")
        t0 = time.perf_counter()
        await node.reset(info.id)
        times.append(time.perf_counter() - t0)
    assert node.manager.counters.get("reset_in_place") == 15
    assert node.manager.counters.get("reset_remade") is None
    print(f"in-place reset: median {statistics.median(times) * 1000:.2f} ms")


async def test_reset_reuses_a_small_scratch_and_replaces_a_big_one(node):
    """Issue 15 (recycling speed): after a tenant wrote a few files, a reset deletes them on
    the same scratch tmpfs (no new tmpfs mount and no umount, which waits for an RCU grace
    period); after more files than ``REUSE_SCRATCH_MAX_INODES`` the whole tmpfs is replaced,
    so a reset never spends long deleting. Either way nothing written survives, the disk
    quota is whole again (a second near-full write fits) and the file API sees the new layer.
    A deep directory chain within the bound is deleted in place as well, and a spare
    tmpfs left mounted by an earlier reset that failed half-way is unmounted."""
    import os

    from dsec.node import reset as rs
    from dsec.node import syscalls

    info = await make(node, "container", disk="16M")
    scratch = node.manager.paths(info.id).scratch
    dev = os.stat(scratch).st_dev
    fill = "dd if=/dev/zero of=/work/fill bs=1M count=12 2>&1 && echo FILLED"
    assert "FILLED" in (await sh(node, info.id, fill)).stdout
    spare = scratch.with_name("scratch.next")
    spare.mkdir(0o700, exist_ok=True)
    syscalls.mount_tmpfs(str(spare), 1 << 20, mode=0o700)  # as a failed new-tmpfs reset leaves it
    await node.reset(info.id)
    assert not os.path.ismount(spare)
    assert os.stat(scratch).st_dev == dev  # same tmpfs: a few files were deleted in place
    assert sorted(os.listdir(scratch)) == ["upper", "work"]  # no stale next dirs
    assert (await sh(node, info.id, "ls /work | wc -l")).stdout.strip() == "0"
    assert "FILLED" in (await sh(node, info.id, fill)).stdout  # the 12M of the old layer were freed
    assert await node.read_file(info.id, "/work/fill") == b"\0" * (12 << 20)
    deep = "/".join(["d"] * 400)  # a deep chain within the bound: deleted in place too
    assert (await sh(node, info.id, f"mkdir -p /tmp/{deep} && echo ok")).stdout == "ok\n"
    await node.reset(info.id)
    assert os.stat(scratch).st_dev == dev
    assert (await sh(node, info.id, "find /tmp /work -mindepth 1 | wc -l")).stdout.strip() == "0"

    many = rs.REUSE_SCRATCH_MAX_INODES + 100
    r = await sh(node, info.id, f"rm /work/fill; mkdir /tmp/m && cd /tmp/m && seq 1 {many} | xargs touch && ls | wc -l")
    assert r.stdout.strip() == str(many), r
    await node.reset(info.id)
    assert os.stat(scratch).st_dev != dev  # a new tmpfs: the big tree went with the old one
    assert (await sh(node, info.id, "ls /tmp | wc -l")).stdout.strip() == "0"
    await node.write_file(info.id, "/work/x", b"x")
    assert (await sh(node, info.id, "cat /work/x")).stdout == "x"
    pid = (await node.get(info.id)).pid
    await node.destroy(info.id)
    assert leftovers(node, info.id, [pid]) == []
