"""Live clones through a real server (issue 16): copy-on-write isolation between a sandbox,
its clones and their siblings on both tiers, the parent keeps running, timing with a warm
pool, all-or-nothing, and refusals (dead/foreign sandbox, bad n)."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
import uuid

import httpx
import pytest
from e2e_server import Server

from dsec.errors import Conflict, InvalidArgument, NotFound
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

pytestmark = pytest.mark.integration

SHAPE = {"image": "busybox", "cpu": 0.25, "memory": "256M"}


def _wait_pool(server: Server, spec: dict, size: int, timeout: float = 90) -> None:
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=60) as h:
        r = h.put("/v1/pools", json={"spec": spec, "size": size})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pools = h.get("/v1/pools").json()["pools"]
            if any(p.get("ready", 0) >= size for p in pools):
                return
            time.sleep(0.5)
    raise AssertionError(f"warm pool did not fill: {pools}")


def _set_pool(server: Server, spec: dict, size: int) -> None:
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=60) as h:
        h.put("/v1/pools", json={"spec": spec, "size": size})


def _clone_audit(c: Client, sid: str) -> dict:
    return [e for e in c.audit(sid) if e.kind == "clone"][-1].data


def test_clone_isolation_and_timing(server: Server) -> None:
    """A parent with 100 MB of changed files: its clones see every file as at the clone
    (a deleted image file stays deleted), a write or delete in one clone is invisible to
    the parent and its sibling, the parent's later writes are invisible to the clones, and
    the parent's running daemon survives. Timing (warm pool of the parent's shape): one
    clone median and 16 at once are printed (targets: 50 ms, 0.3 s)."""
    with Client(server.url, server.token) as c:
        parent = Sandbox.create(client=c, **SHAPE)
        try:
            parent.exec("for i in 1 2 3 4; do dd if=/dev/urandom of=/data$i bs=1M count=25 2>/dev/null; done; "
                        "echo v1 > /tmp/state; rm /etc/motd 2>/dev/null; rm -f /bin/vi; "
                        "cd / && (setsid sh -c 'while :; do sleep 1; done' &)")  # cwd on / : the fast path
            sums = parent.exec("md5sum /data1 /data4").stdout
            a, b = parent.clone(n=2)
            try:
                assert a.id != b.id != parent.id
                for x in (a, b):
                    assert x.exec("md5sum /data1 /data4").stdout == sums
                    assert x.exec("cat /tmp/state; ls /bin/vi 2>&1").stdout.startswith("v1\n")
                    assert x.exec("test -e /bin/vi").exit_code == 1
                assert a.exec("echo a > /tmp/state; echo new > /tmp/only-a; rm /data2").exit_code == 0
                assert parent.exec("cat /tmp/state; ls /tmp; ls /data2").stdout == "v1\nstate\n/data2\n"
                assert b.exec("cat /tmp/state; ls /tmp; ls /data2").stdout == "v1\nstate\n/data2\n"
                assert parent.exec("echo v2 > /tmp/state; echo p > /tmp/only-parent").exit_code == 0
                assert a.exec("cat /tmp/state; ls /tmp").stdout == "a\nonly-a\nstate\n"
                assert b.exec("cat /tmp/state; ls /tmp").stdout == "v1\nstate\n"
                assert "sleep 1" in parent.exec("ps -o args").stdout  # the parent ran on
                assert "sleep 1" not in a.exec("ps -o args").stdout  # a clone copies files, not processes
                assert a.info.cpu == parent.info.cpu and a.info.memory == parent.info.memory
                assert _clone_audit(c, parent.id)["mode"] == "stack", _clone_audit(c, parent.id)
            finally:
                a.kill()
                b.kill()

            _wait_pool(server, SHAPE, 17)
            one = []
            for i in range(11):
                parent.exec(f"echo {i} > /tmp/step")  # a new state each time: a real freeze
                t0 = time.perf_counter()
                (x,) = parent.clone()
                one.append(time.perf_counter() - t0)
                assert x.exec("cat /tmp/step").stdout == f"{i}\n"
                x.kill()
            paused = _clone_audit(c, parent.id)["paused_ms"]
            _wait_pool(server, SHAPE, 17)
            parent.exec("echo sixteen > /tmp/step")
            t0 = time.perf_counter()
            many = parent.clone(n=16)
            sixteen = time.perf_counter() - t0
            try:
                assert len({x.id for x in many}) == 16
                assert all(x.exec("cat /tmp/step").stdout == "sixteen\n" for x in many[:3])
            finally:
                for x in many:
                    x.kill()
        finally:
            _set_pool(server, SHAPE, 0)
            parent.kill()
    med = statistics.median(one)
    print(f"clone (100 MB changed, warm pool): median {med * 1000:.1f} ms over {len(one)}, parent paused "
          f"{paused:.1f} ms; 16 clones at once {sixteen * 1000:.0f} ms")
    # Targets (issue 16): median <= 50 ms, 16 at once <= 0.3 s; met on an idle box (14 ms,
    # 138 ms). Printed, not asserted: timings on a shared CI host are no test (the
    # behaviour that makes them fast, the stacked no-copy path, is asserted above).


def test_clone_with_open_writer_copies_and_stays_isolated(server: Server) -> None:
    """A parent process holding a file open for writing would keep writing into a stacked
    layer: the clone takes the copy path instead, and what the writer appends after the
    clone never shows up in the clone."""
    with Client(server.url, server.token) as c, Sandbox.create(client=c, **SHAPE) as parent:
        parent.exec("(setsid sh -c 'exec 3>>/tmp/log; while :; do echo x >&3; sleep 0.05; done' &) ; sleep 0.3")
        (x,) = parent.clone()
        try:
            assert _clone_audit(c, parent.id)["mode"] == "copy"
            n0 = int(x.exec("wc -l < /tmp/log").stdout)
            time.sleep(0.5)
            assert int(x.exec("wc -l < /tmp/log").stdout) == n0
            assert int(parent.exec("wc -l < /tmp/log").stdout) > n0
        finally:
            x.kill()


@pytest.mark.gvisor
def test_gvisor_clone_is_isolated(server: Server) -> None:
    """The gVisor tier clones too (copy path, cold create): same isolation guarantees."""
    with Client(server.url, server.token) as c:
        if shutil.which("runsc") is None:
            pytest.skip("runsc not installed")
        with Sandbox.create(client=c, isolation="gvisor", **SHAPE) as parent:
            parent.exec("echo g1 > /tmp/g; mkdir -p /w && echo keep > /w/k")
            (x,) = parent.clone()
            try:
                assert x.info.isolation == "gvisor"
                assert x.exec("cat /tmp/g /w/k").stdout == "g1\nkeep\n"
                x.exec("echo child > /tmp/g")
                assert parent.exec("cat /tmp/g").stdout == "g1\n"
                parent.exec("echo g2 > /tmp/g")
                assert x.exec("cat /tmp/g").stdout == "child\n"
            finally:
                x.kill()


def test_async_clone_and_refusals(server: Server) -> None:
    """AsyncSandbox.clone returns AsyncSandbox handles; n=0 and n above clone_max are 422;
    another tenant's sandbox is 404; a killed sandbox is 404/409; nothing is left behind."""
    async def run() -> None:
        async with AsyncClient(server.url, server.token) as c:
            sb = await AsyncSandbox.create(client=c, **SHAPE)
            async with sb:
                await sb.exec("echo hi > /tmp/h")
                (x,) = await sb.clone()
                assert isinstance(x, AsyncSandbox)
                async with x:
                    assert (await x.exec("cat /tmp/h")).stdout == "hi\n"
                for n in (0, 10_000):
                    with pytest.raises(InvalidArgument, match="clone_max"):
                        await sb.clone(n=n)
            with pytest.raises((NotFound, Conflict)):
                await sb.clone()
            with pytest.raises(NotFound):
                await c.clone("sb-000000000000")

    asyncio.run(run())
    with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}) as admin:
        name = "clone-other-" + uuid.uuid4().hex[:6]
        tok = admin.post("/v1/tenants", json={"name": name}).json()["token"]
        try:
            with Client(server.url, server.token) as c, Sandbox.create(client=c, **SHAPE) as mine, \
                    Client(server.url, tok) as other:
                with pytest.raises(NotFound):
                    other.clone(mine.id)
                before = {i.id for i in c.list()}
            assert {i.id for i in Client(server.url, server.token).list()} <= before
        finally:
            admin.delete(f"/v1/tenants/{name}")


def test_clone_of_a_clone_outlives_its_parent_and_leaves_nothing(server: Server) -> None:
    """A clone of a clone sees both generations' files; clones keep working after their
    parent is killed (the frozen layers live while a mount uses them); once every user is
    gone no frozen layer is left on the node; a parent with nothing new since its last
    clone reuses that layer (no new freeze)."""
    layers = server.home / "clones"
    with Client(server.url, server.token) as c:
        p = Sandbox.create(client=c, **SHAPE)
        p.exec("echo gen0 > /g0")
        (a,) = p.clone()
        (a2,) = p.clone()  # nothing written in between
        assert _clone_audit(c, p.id)["mode"] == "reused"
        a.exec("echo gen1 > /g1")
        (b,) = a.clone()
        p.kill()
        assert b.exec("cat /g0 /g1").stdout == "gen0\ngen1\n"
        assert a2.exec("cat /g0; test -e /g1 || echo no-g1").stdout == "gen0\nno-g1\n"
        b.exec("echo gen2 > /g0")
        assert a.exec("cat /g0").stdout == "gen0\n"
        assert len(list(layers.iterdir())) >= 2
        for x in (a, a2, b):
            x.kill()
    assert list(layers.iterdir()) == []
