"""End to end over HTTP with real sandboxes: SDK, CLI, tenants, bad input, restart recovery."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from e2e_server import Server, ensure_images, reap_home, start_server

from dsec.errors import Conflict, InvalidArgument, NotFound, PayloadTooLarge
from dsec.models import ExecRequest
from dsec.sdk import Client, Sandbox

pytestmark = pytest.mark.integration


def test_sdk_roundtrip_real_sandbox(server: Server) -> None:
    """Create, exec, files, stream, audit and kill a real busybox sandbox through the SDK."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", cpu=1, memory="256M", labels={"run": "e2e"}, client=c) as sb:
            r = sb.exec("echo hello; echo oops >&2; exit 3")
            assert (r.exit_code, r.stdout, r.stderr) == (3, "hello\n", "oops\n")
            sb.files.write("/tmp/a.txt", b"data\n")
            assert sb.exec("cat /tmp/a.txt").stdout == "data\n"
            assert sb.files.read("/tmp/a.txt") == b"data\n"
            assert "a.txt" in [e.name for e in sb.files.list("/tmp")]
            chunks = list(sb.exec_stream("for i in 1 2 3; do echo $i; done"))
            assert "".join(e.data for e in chunks if e.kind == "stdout") == "1\n2\n3\n"
            assert chunks[-1].kind == "exit" and chunks[-1].result.exit_code == 0
            assert [s.id for s in Sandbox.list({"run": "e2e"}, client=c)] == [sb.id]
            sid = sb.id
        try:  # the node may keep a tombstone for a while
            assert c.get(sid).state.value in ("stopping", "stopped", "destroyed")
        except NotFound:
            pass
        with pytest.raises((NotFound, Conflict)):
            c.exec(sid, ExecRequest(cmd="true"))
        kinds = [e.kind for e in c.audit(sid)]
        assert kinds[:4] == ["create", "exec", "file_write", "exec"] and "kill" in kinds


def test_bad_input_real(server: Server) -> None:
    """Unknown image is 404 naming it; oversized upload 413; impossible cpu 422 naming the limit."""
    with Client(server.url, server.token) as c:
        with pytest.raises(NotFound, match="no-such-image"):
            Sandbox.create(image="no-such-image:1", client=c)
        with pytest.raises(InvalidArgument, match="cpu"):
            Sandbox.create(image="busybox", cpu=512, client=c)
        with Sandbox.create(image="busybox", client=c) as sb:
            with pytest.raises(PayloadTooLarge, match="max_upload_bytes"):
                sb.files.write("/tmp/big", b"x" * (2 << 20))
        assert c.list() == []


def test_cli_and_tenants(server: Server) -> None:
    """CLI run/ps/logs work with zero config; a new tenant cannot see the local tenant's sandboxes."""
    r = server.cli("run", "busybox", "--", "sh", "-c", "echo from-cli; exit 4", check=False)
    assert r.returncode == 4 and r.stdout == "from-cli\n"
    created = json.loads(server.cli("tenant", "add", "team-a", "--max-sandboxes", "2", "--json").stdout)
    env_a = {**server.env, "DSEC_TOKEN": created["token"]}
    sid = json.loads(server.cli("run", "busybox", "--keep", "--json", "--", "true").stdout)["sandbox_id"]
    ps_local = json.loads(server.cli("ps", "--json").stdout)
    assert [s["id"] for s in ps_local] == [sid]
    assert json.loads(server.cli("ps", "--json", env=env_a).stdout) == []
    denied = server.cli("kill", sid, env=env_a, check=False)
    assert denied.returncode == 1 and "not found" in denied.stderr
    logs = json.loads(server.cli("logs", sid, "--json").stdout)
    assert [e["kind"] for e in logs] == ["create", "exec"]
    server.cli("kill", sid)
    assert "team-a" in server.cli("tenant", "ls").stdout
    server.cli("tenant", "rm", "team-a")
    assert server.cli("ps", env=env_a, check=False).returncode == 1


def test_restart_recovers_state(tmp_path: Path) -> None:
    """After SIGTERM and restart: sandboxes are adopted, tokens and idempotency keys persist."""
    ensure_images(tmp_path, ["busybox"])
    srv = start_server(tmp_path)
    try:
        with Client(srv.url, srv.token) as c:
            sb = Sandbox.create(image="busybox", request_id="job-42", client=c)
            sb.files.write("/tmp/keep", b"kept")
        assert srv.stop(signal.SIGTERM) == 0
        assert not (tmp_path / "server.json").exists()
        srv = start_server(tmp_path)
        assert srv.token == (tmp_path / "token").read_text().strip()
        with Client(srv.url, srv.token) as c:
            again = Sandbox.create(image="busybox", request_id="job-42", client=c)
            assert again.id == sb.id
            assert again.exec("cat /tmp/keep").stdout == "kept"
            again.kill()
            assert c.list() == []
    finally:
        if srv.proc.poll() is not None:  # died mid-test: restart it so its sandboxes are adopted and killed
            srv = start_server(tmp_path)
        srv.kill_all()
        srv.stop()
        reap_home(tmp_path)


def test_images_api_real(server: Server) -> None:
    """Images over HTTP: list shows the stock image, a build produces a usable image, garbage
    imports are refused as 4xx, removing an unknown image is 404; the local token file is 0600."""
    import os
    import stat

    import httpx

    assert stat.S_IMODE(os.stat(server.home / "token").st_mode) == 0o600
    h = {"authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=h, timeout=300) as c:
        names = [n for i in c.get("/v1/images").json() for n in i["names"]]
        assert any(n.startswith("busybox") for n in names)
        r = c.post("/v1/images/build", json={"tag": "e2e-built:1", "spec": {
            "from": "busybox", "steps": [{"copy": {"src": "hello.txt", "dest": "/opt/hello.txt"}},
                                         {"run": "echo built > /opt/built.txt"}]},
            "files": {"hello.txt": "hello from the build context\n"}})
        assert r.status_code == 201, r.text
        r = c.post("/v1/images/import", params={"name": "junk:1"}, content=b"not a tar at all")
        assert 400 <= r.status_code < 500, r.text
        assert c.delete("/v1/images/no-such-image:9").status_code == 404
    with Client(server.url, server.token) as cl, Sandbox.create(image="e2e-built:1", client=cl) as sb:
        assert sb.exec("cat /opt/hello.txt /opt/built.txt").stdout == "hello from the build context\nbuilt\n"


@pytest.mark.gvisor
def test_gvisor_tier_via_api(server: Server) -> None:
    """isolation="gvisor" through the public API runs the command under runsc."""
    with Client(server.url, server.token) as c, \
            Sandbox.create(image="busybox", isolation="gvisor", cpu=1, memory="256M", client=c) as sb:
        assert sb.info.isolation == "gvisor"
        r = sb.exec("echo in-gvisor; dmesg 2>/dev/null | head -1")
        assert r.exit_code == 0 and r.stdout.startswith("in-gvisor\n")
        assert "gVisor" in r.stdout  # runsc's synthetic kernel log names itself


def test_async_client_real_server(server: Server) -> None:
    """The asyncio SDK's own HTTP driver (aiohttp) against a real server: concurrent execs
    on one pooled client, a streamed exec with a line longer than any read buffer, errors
    as dsec.errors classes, and a refused connection as a TransientError (no raw errors)."""
    import asyncio

    from dsec.errors import TransientError
    from dsec.sdk import AsyncClient, AsyncSandbox

    async def main() -> None:
        async with AsyncClient(server.url, server.token) as c:
            async with await AsyncSandbox.create(image="busybox", client=c) as sb:
                outs = await asyncio.gather(*(sb.exec(["echo", str(i)]) for i in range(20)))
                assert [o.stdout for o in outs] == [f"{i}\n" for i in range(20)]
                events = [e async for e in sb.exec_stream("head -c 300000 /dev/zero | tr '\\0' a; echo; echo end")]
                out = "".join(e.data for e in events if e.kind == "stdout")
                assert out == "a" * 300000 + "\nend\n" and events[-1].result.exit_code == 0
                with pytest.raises(NotFound, match="/nope"):
                    await sb.files.read("/nope")
            with pytest.raises(NotFound, match="sb-doesnotexist"):
                await AsyncSandbox.connect("sb-doesnotexist", client=c)
        async with AsyncClient("http://127.0.0.1:9", server.token, retries=1) as dead:
            with pytest.raises(TransientError, match="cannot connect"):
                await dead.health()

    asyncio.run(main())


def test_server_loop_boosted_sandboxes_not(server: Server) -> None:
    """The API event-loop thread runs at Settings.api_loop_nice (so sandbox load cannot
    starve it) while nothing it starts inherits that: sandbox processes run at nice 0."""
    import os

    from dsec.config import Settings

    want = Settings().api_loop_nice
    assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) == want  # main thread = event loop
    with Client(server.url, server.token) as c, Sandbox.create(image="busybox", client=c) as sb:
        nices = sb.exec("cut -d' ' -f19 /proc/1/stat /proc/self/stat").stdout.split()
        assert nices == ["0", "0"]


def test_default_async_client_exits_cleanly(server: Server) -> None:
    """A program that uses the default AsyncClient (never closed) under asyncio.run exits
    without "Unclosed client session" noise: the loop's shutdown closes it."""
    import subprocess
    import sys

    code = ("import asyncio, dsec\n"
            "async def main():\n"
            "    async with await dsec.AsyncSandbox.create(image='busybox') as sb:\n"
            "        print((await sb.exec('echo hi')).stdout, end='')\n"
            "asyncio.run(main())\n")
    env = {**server.env, "DSEC_URL": server.url, "DSEC_TOKEN": server.token}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0 and r.stdout == "hi\n", r.stderr
    assert "Unclosed" not in r.stderr, r.stderr
