"""The NodeAgent contract: every implementation (shared fake, real local agent, real agent
behind a Ray actor) answers these calls the same way, so the layers above (API service,
scheduler driver, cluster router) can be tested on the fake and run on any of them."""

from __future__ import annotations

import io
import tarfile
from typing import Any

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec, SandboxState
from dsec.node.api import (
    NODE_METHODS,
    ImageLayers,
    LayerIndex,
    NodeAgent,
    NodeCapacity,
    NodeHealth,
    NodeUsage,
    RestoreSource,
)

SMALL: dict[str, Any] = {"cpu": 0.5, "memory": "128M", "disk": "64M"}
LIVE = (SandboxState.idle, SandboxState.running, SandboxState.ready)
DEAD = (SandboxState.stopped, SandboxState.destroyed)


def spec(**kw: Any) -> SandboxSpec:
    return SandboxSpec(image="busybox", **{**SMALL, **kw})


async def test_implements_the_whole_protocol(node: Any) -> None:
    """Every protocol method exists; node views are the protocol's models and name this node."""
    assert isinstance(node, NodeAgent)
    for m in (*NODE_METHODS, "exec_stream", "capacity", "start", "close"):
        assert callable(getattr(node, m, None)), m
    cap = node.capacity()
    assert isinstance(cap, NodeCapacity) and cap.node_id == node.node_id and cap.cpu > 0
    assert "container" in cap.isolation
    health = await node.health()
    assert isinstance(health, NodeHealth) and health.ok and health.node_id == node.node_id and health.pid > 0
    usage = await node.usage()
    assert isinstance(usage, NodeUsage) and 0 <= usage.cpu_busy <= 1


async def test_layer_index_and_image_resolution(node: Any) -> None:
    """The node reports the images it holds with their layers; an unknown image is NotFound naming it."""
    index = await node.layer_index()
    assert isinstance(index, LayerIndex) and index.node_id == node.node_id
    busybox = next(i for i in index.images if any(n.startswith("busybox") for n in i.names))
    assert busybox.layers and all(d.startswith("sha256:") and size > 0 for d, size in busybox.layers)
    one = await node.resolve_image("busybox")
    assert isinstance(one, ImageLayers) and one.image_id == busybox.image_id and one.layers == busybox.layers
    with pytest.raises(errors.NotFound, match="no-such-image"):
        await node.resolve_image("no-such-image")


async def test_create_get_list_destroy(node: Any) -> None:
    """A created sandbox is live, carries its node, labels and tenant, is listed (filters
    apply), and after destroy is neither listed nor live; destroying it again is harmless,
    an unknown id is NotFound."""
    a = await node.create(spec(labels={"run": "r1"}), tenant="t1")
    b = await node.create(spec(labels={"run": "r2"}), tenant="t2")
    # A router (many nodes behind one agent) answers with the node that holds the sandbox.
    assert a.node == node.node_id or a.node in getattr(node, "agents", {})
    assert a.state in LIVE and a.tenant == "t1" and a.expires_at is not None
    assert (await node.get(a.id)).id == a.id
    assert {i.id for i in await node.list()} >= {a.id, b.id}
    assert [i.id for i in await node.list(labels={"run": "r1"})] == [a.id]
    assert [i.id for i in await node.list(tenant="t2")] == [b.id]
    await node.destroy(a.id)
    assert a.id not in {i.id for i in await node.list()}
    try:
        assert (await node.get(a.id)).state in DEAD
    except errors.NotFound:
        pass
    await node.destroy(a.id)
    with pytest.raises(errors.NotFound):
        await node.destroy("sb-does-not-exist")
    with pytest.raises(errors.NotFound):
        await node.get("sb-does-not-exist")


async def test_create_with_caller_id_and_bad_image(node: Any) -> None:
    """The caller may choose the id; an unknown image is NotFound naming it and leaves nothing."""
    info = await node.create(spec(), sandbox_id="sb-contract01")
    assert info.id == "sb-contract01"
    before = {i.id for i in await node.list()}
    with pytest.raises(errors.NotFound, match="nope-image"):
        await node.create(SandboxSpec(image="nope-image", **SMALL))
    assert {i.id for i in await node.list()} == before


async def test_pooled_create_and_claim(node: Any) -> None:
    """A pooled member is ready with no TTL running; claim hands it to a tenant with the
    request's labels and starts the TTL; a second claim is a Conflict."""
    member = await node.create(spec(labels={"dsec.pool": "1"}), pooled=True)
    assert member.state is SandboxState.ready and member.expires_at is None
    got = await node.claim(member.id, spec(labels={"job": "j1"}, timeout=120), "t1")
    assert got.id == member.id and got.state in (SandboxState.idle, SandboxState.running)
    assert got.tenant == "t1" and got.labels == {"job": "j1"} and got.timeout == 120 and got.expires_at
    with pytest.raises(errors.Conflict):
        await node.claim(member.id, spec(), "t2")


async def test_set_timeout(node: Any) -> None:
    """set_timeout moves the expiry; a non-positive timeout is InvalidArgument."""
    info = await node.create(spec(timeout=60))
    new = await node.set_timeout(info.id, 300)
    assert new.timeout == 300 and new.expires_at is not None and new.expires_at > info.expires_at
    with pytest.raises(errors.InvalidArgument):
        await node.set_timeout(info.id, 0)


async def test_exec_and_stream(node: Any) -> None:
    """exec returns output and exit code; a stream yields output then exactly one exit
    event; exec in an unknown sandbox is NotFound."""
    info = await node.create(spec())
    r = await node.exec(info.id, ExecRequest(cmd="echo hi"))
    assert (r.exit_code, r.stdout, r.timed_out) == (0, "hi\n", False)
    assert (await node.exec(info.id, ExecRequest(cmd="exit 3"))).exit_code == 3
    events = [e async for e in node.exec_stream(info.id, ExecRequest(cmd="echo streamed"))]
    assert "".join(e.data for e in events if e.kind == "stdout") == "streamed\n"
    assert [e.kind for e in events].count("exit") == 1 and events[-1].kind == "exit"
    assert events[-1].result is not None and events[-1].result.exit_code == 0
    with pytest.raises(errors.NotFound):
        await node.exec("sb-does-not-exist", ExecRequest(cmd="echo x"))


async def test_exec_timeout(node: Any) -> None:
    """A command past its timeout comes back timed_out, not as an error."""
    info = await node.create(spec())
    r = await node.exec(info.id, ExecRequest(cmd="sleep 5", timeout=0.5))
    assert r.timed_out and r.exit_code != 0


async def test_background_processes_and_signal(node: Any) -> None:
    """A background exec returns a pid listed by processes(); kill_process signals it;
    an unknown pid is NotFound."""
    info = await node.create(spec())
    r = await node.exec(info.id, ExecRequest(cmd="sleep 100", background=True))
    assert r.pid is not None and r.pid > 0
    assert r.pid in {p.pid for p in await node.processes(info.id)}
    await node.kill_process(info.id, r.pid, 9)
    for _ in range(50):
        procs = {p.pid: p for p in await node.processes(info.id)}
        if r.pid not in procs or not procs[r.pid].running:
            break
        import asyncio
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("process still running after SIGKILL")
    with pytest.raises(errors.NotFound):
        await node.kill_process(info.id, 999999, 9)


async def test_files(node: Any) -> None:
    """Files written are read back byte for byte, listed, seen by exec, and removed; a
    missing file is NotFound."""
    info = await node.create(spec())
    data = bytes(range(256)) * 4
    await node.write_file(info.id, "/work/a.bin", data)
    await node.write_file(info.id, "/work/t.txt", b"hello\n")
    assert await node.read_file(info.id, "/work/a.bin") == data
    names = {e.name: e for e in await node.list_files(info.id, "/work")}
    assert names["a.bin"].size == len(data) and names["a.bin"].type == "file"
    assert (await node.exec(info.id, ExecRequest(cmd="cat /work/t.txt"))).stdout == "hello\n"
    await node.remove_file(info.id, "/work/a.bin")
    with pytest.raises(errors.NotFound):
        await node.read_file(info.id, "/work/a.bin")


async def test_tar_round_trip(node: Any) -> None:
    """A tar uploaded into a directory comes back (same names and bytes) from download_tar."""
    info = await node.create(spec())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, body in (("x.txt", b"x" * 10), ("y.txt", b"why")):
            ti = tarfile.TarInfo(name)
            ti.size = len(body)
            tf.addfile(ti, io.BytesIO(body))
    await node.upload_tar(info.id, "/work/up", buf.getvalue())
    assert await node.read_file(info.id, "/work/up/y.txt") == b"why"
    with tarfile.open(fileobj=io.BytesIO(await node.download_tar(info.id, "/work/up"))) as tf:
        got = {m.name.lstrip("./"): tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert got == {"x.txt": b"x" * 10, "y.txt": b"why"}


async def test_network_update_needs_an_interface(node: Any) -> None:
    """A sandbox created without a network cannot get an allow-list later (InvalidArgument
    saying how); its denied-attempt log is an empty list."""
    info = await node.create(spec())
    with pytest.raises(errors.InvalidArgument, match="network"):
        await node.update_network(info.id, ["127.0.0.1:80"])
    assert await node.network_denied_events(info.id) == []


async def test_checkpoint_and_restore(node: Any) -> None:
    """A checkpoint captured on the node restores (create with restore=...) into a new
    sandbox with the same files; an unknown checkpoint is NotFound."""
    info = await node.create(spec())
    await node.write_file(info.id, "/work/state.txt", b"step 7\n")
    ck = await node.checkpoint(info.id, "t1")
    assert ck.id.startswith("ck-") and ck.sandbox_id == info.id
    back = await node.create(spec(), tenant="t1", restore=RestoreSource(tenant="t1", checkpoint_id=ck.id))
    assert back.id != info.id and back.state in LIVE
    assert await node.read_file(back.id, "/work/state.txt") == b"step 7\n"
    with pytest.raises(errors.NotFound):
        await node.create(spec(), tenant="t2", restore=RestoreSource(tenant="t2", checkpoint_id=ck.id))


async def test_reset(node: Any) -> None:
    """reset returns a live sandbox to its state as created: same id, files written since
    are gone, background processes are gone; an unknown id is NotFound."""
    info = await node.create(spec())
    await node.write_file(info.id, "/work/dirty.txt", b"x")
    bg = await node.exec(info.id, ExecRequest(cmd="sleep 100", background=True))
    back = await node.reset(info.id)
    assert back.id == info.id and back.state in LIVE
    with pytest.raises(errors.NotFound):
        await node.read_file(info.id, "/work/dirty.txt")
    assert not [p for p in await node.processes(info.id) if p.pid == bg.pid and p.running]
    assert (await node.exec(info.id, ExecRequest(cmd="echo ok"))).stdout == "ok\n"
    with pytest.raises(errors.NotFound):
        await node.reset("sb-does-not-exist")
