"""The SDK against the real FastAPI app: handles, errors, streaming, config discovery, retries."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

import dsec
from dsec.api.services import Services
from dsec.errors import InvalidArgument, NotFound, QuotaExceeded, TransientError, Unauthorized
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox
from dsec.sdk._config import resolve_config
from dsec.sdk._core import Call, Outcome, Response, RetryPolicy, Send, Sleep, plan


async def test_async_sandbox_lifecycle(aclient: tuple[AsyncClient, Services]) -> None:
    """AsyncSandbox: create, exec, files, stream, list by label; the context manager kills on exit."""
    c, services = aclient
    async with await AsyncSandbox.create(image="busybox", cpu=1, labels={"run": "r1"}, client=c) as sb:
        r = await sb.exec("echo hi")
        assert (r.exit_code, r.stdout) == (0, "hi\n")
        await sb.files.write("/w/a.py", "print(1)")
        assert await sb.files.read("/w/a.py") == b"print(1)"
        assert [e.name for e in await sb.files.list("/w")] == ["a.py"]
        events = [ev async for ev in sb.exec_stream("echo s")]
        assert events[-1].kind == "exit" and events[0].data == "s\n"
        assert [x.id for x in await AsyncSandbox.list({"run": "r1"}, client=c)] == [sb.id]
        assert (await AsyncSandbox.connect(sb.id, client=c)).info.image == "busybox"
        sid = sb.id
    assert sid not in services.node.sandboxes  # type: ignore[attr-defined]
    with pytest.raises(NotFound):
        await c.get(sid)


async def test_errors_are_dsec_classes(aclient: tuple[AsyncClient, Services]) -> None:
    """Users only ever see dsec.errors classes, with the server's message."""
    c, _ = aclient
    with pytest.raises(NotFound, match="nosuch"):
        await AsyncSandbox.create(image="nosuch", client=c)
    with pytest.raises(InvalidArgument, match="cpu"):
        AsyncSandbox.create(image="busybox", cpu=-2, client=c)  # validated locally, before any I/O
    bad = AsyncClient(c.config.url, "wrong", transport=c._http._transport)  # type: ignore[attr-defined]
    with pytest.raises(Unauthorized):
        await bad.list()
    assert isinstance(NotFound("x"), dsec.errors.DSecError)


async def test_many_concurrent_sandboxes_one_client(aclient: tuple[AsyncClient, Services]) -> None:
    """One AsyncClient drives many sandboxes concurrently; quota overflow surfaces as QuotaExceeded."""
    c, _ = aclient
    sbs = await asyncio.gather(*(AsyncSandbox.create(client=c, cpu=0.1) for _ in range(50)))
    results = await asyncio.gather(*(sb.exec(f"echo {i}") for i, sb in enumerate(sbs)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(50)]
    c2 = AsyncClient(c.config.url, c.config.token, retries=0, transport=c._http._transport)  # type: ignore
    with pytest.raises(QuotaExceeded, match="max_sandboxes"):
        await AsyncSandbox.create(client=c2)
    await asyncio.gather(*(sb.kill() for sb in sbs))


def test_sync_sandbox_over_loopback(live_server: tuple[str, str, Services]) -> None:
    """The sync Sandbox works over a real socket, streams output, and kills on exit."""
    url, token, services = live_server
    with Client(url, token) as c:
        with Sandbox.create(image="python", client=c, labels={"k": "v"}) as sb:
            assert sb.exec(["echo", "a", "b"]).stdout == "a b\n"
            sb.files.write("/x", b"\x00\x01")
            assert sb.files.read("/x") == b"\x00\x01"
            assert [e.kind for e in sb.exec_stream("echo z")] == ["stdout", "exit"]
            assert Sandbox.kill_by_labels({"k": "nomatch"}, client=c) == []
            sid = sb.id
        assert c.list() == []
        log = c.audit(sid)
        assert [e.kind for e in log] == ["create", "exec", "file_write", "exec", "kill"]


def test_connection_refused_is_transient_error(tmp_path: Path) -> None:
    """No server: a TransientError telling the user to start `dsec serve`, after bounded retries."""
    with Client("http://127.0.0.1:9", "t", retries=1) as c, pytest.raises(TransientError, match="dsec serve"):
        c.list()


def test_config_discovery_from_dsec_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no env, the SDK finds the URL in DSEC_HOME/server.json and the token in DSEC_HOME/token."""
    monkeypatch.delenv("DSEC_URL", raising=False)
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    (tmp_path / "server.json").write_text(json.dumps({"url": "http://127.0.0.1:1234"}))
    (tmp_path / "token").write_text("dsec_tok\n")
    cfg = resolve_config()
    assert (cfg.url, cfg.token) == ("http://127.0.0.1:1234", "dsec_tok")
    monkeypatch.setenv("DSEC_URL", "http://h:1")
    monkeypatch.setenv("DSEC_TOKEN", "env")
    cfg = resolve_config()
    assert (cfg.url, cfg.token) == ("http://h:1", "env")
    assert resolve_config("http://x/", "y").url == "http://x"


def _drive(call: Call[str], outcomes: list[Outcome], policy: RetryPolicy) -> tuple[list[float], str]:
    gen = plan(call, policy, "http://u")
    sleeps: list[float] = []
    step = next(gen)
    try:
        while True:
            if isinstance(step, Send):
                step = gen.send(outcomes.pop(0))
            else:
                assert isinstance(step, Sleep)
                sleeps.append(step.seconds)
                step = gen.send(None)
    except StopIteration as stop:
        return sleeps, stop.value


def _resp(status: int, body: object = None, **headers: str) -> Outcome:
    return Outcome(response=Response(status, headers, json.dumps(body).encode() if body is not None else b""))


def test_retry_plan_honours_retry_after_and_backoff() -> None:
    """429 waits Retry-After, 503 backs off exponentially, then the answer is parsed."""
    call = Call("GET", "/x", lambda r: r.content.decode(), idempotent=True)
    policy = RetryPolicy(retries=4, backoff_s=0.1, backoff_max_s=5)
    sleeps, value = _drive(call, [_resp(429, {"code": "overloaded", "message": "m"}, **{"retry-after": "2"}),
                                  _resp(503, {"code": "transient", "message": "m"}),
                                  _resp(503), Outcome(response=Response(200, {}, b"ok"))], policy)
    assert sleeps == [2.0, 0.2, 0.4] and value == "ok"


def test_retry_plan_gives_up_and_never_resends_unsafe_calls() -> None:
    """Retries are bounded; a non-idempotent call is not resent after a read error (it may have run)."""
    call = Call("POST", "/exec", lambda r: "x", idempotent=False)
    policy = RetryPolicy(retries=2, backoff_s=0.1, backoff_max_s=5)
    with pytest.raises(TransientError):
        _drive(call, [Outcome(error=httpx.ReadError("reset"))], policy)
    sleeps, _ = _drive(call, [Outcome(error=httpx.ConnectError("refused")), _resp(200, {})], policy)
    assert sleeps == [0.1]  # never sent: safe to retry
    with pytest.raises(dsec.errors.Overloaded):
        _drive(call, [_resp(429, {"code": "overloaded", "message": "busy"})] * 3, policy)
