"""The CLI's light client finds the server and token exactly as the SDK does, and its
first-hour errors name the problem and the next command."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.cli import wire
from dsec.cli.common import next_step
from dsec.config import Settings
from dsec.errors import NotFound, Unauthorized
from dsec.sdk._config import resolve_config


def _home(tmp_path: Path, url: str | None = "http://127.0.0.1:4242", token: str | None = "tok-file") -> Path:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    if url:
        (home / "server.json").write_text(json.dumps({"url": url, "pid": 1}))
    if token:
        (home / "token").write_text(token + "\n")
    return home


CASES = [
    {},  # server.json + token file
    {"DSEC_URL": "http://10.1.2.3:99/", "DSEC_TOKEN": "tok-env"},
    {"DSEC_PORT": "7171", "DSEC_HOST": "127.0.0.2", "NO_FILES": "1"},
    {"dsec_url": "http://lower.case:1"},  # pydantic-settings reads env case-insensitively
    {"CONFIG": 'url = "http://from.toml:5"\ntoken = "tok-toml"\nclient_timeout_s = 7\n'},
    {"CONFIG": 'url = "http://from.toml:5"\n', "DSEC_URL": "http://env.wins:6"},
    {"DSEC_URL": "http://a:7070/, http://b:7070,http://a:7070"},  # several servers on one state
]


@pytest.mark.parametrize("case", CASES)
def test_target_matches_the_sdk(case: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_target (no pydantic) == dsec.sdk._config.resolve_config for URL, token,
    timeout and retry settings, over env, TOML and DSEC_HOME files."""
    for k in list(__import__("os").environ):
        if k.upper().startswith("DSEC_"):
            monkeypatch.delenv(k)
    case = dict(case)
    no_files = case.pop("NO_FILES", None)
    home = _home(tmp_path, None, None) if no_files else _home(tmp_path)
    monkeypatch.setenv("DSEC_HOME", str(home))
    if "CONFIG" in case:
        cfg = tmp_path / "dsec.toml"
        cfg.write_text(case.pop("CONFIG"))
        monkeypatch.setenv("DSEC_CONFIG", str(cfg))
    for k, v in case.items():
        monkeypatch.setenv(k, v)
    sdk = resolve_config()
    t = wire.resolve_target()
    assert (t.url, t.token, t.timeout_s, t.retries, t.backoff_s, t.backoff_max_s) == (
        sdk.url, sdk.token, sdk.timeout_s, sdk.retries, sdk.backoff_s, sdk.backoff_max_s)
    assert t.urls == (getattr(sdk, "urls", None) or (sdk.url,))


def test_defaults_match_settings() -> None:
    """The few Settings defaults the light client repeats are Settings' own."""
    fields = Settings.model_fields
    for name, value in wire._DEFAULTS.items():
        want = fields[name].get_default(call_default_factory=False) if name != "home" else Path("/var/lib/dsec")
        assert (Path(value) if name == "home" else value) == want, name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_server_names_the_problem_and_dsec_serve(tmp_path: Path) -> None:
    """`dsec ps` with nothing listening: one line with the URL, one with `dsec serve`; no
    traceback, exit 1, and it answers at once (no retry loop)."""
    import os
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    url = f"http://127.0.0.1:{_free_port()}"
    env.update(DSEC_HOME=str(tmp_path), DSEC_URL=url)
    t0 = time.monotonic()
    r = subprocess.run([str(Path(sys.executable).parent / "dsec"), "ps"], env=env, capture_output=True, text=True,
                       timeout=60, check=False)
    assert time.monotonic() - t0 < 20
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"no DSec server answers at {url}" in r.stderr and "dsec serve" in r.stderr and "dsec doctor" in r.stderr


def test_next_step_hints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrong token -> where the token came from and how to get the right one; unknown
    image -> `dsec image ls`; a stock image not built -> `dsec image ensure-stock --only`."""
    monkeypatch.setenv("DSEC_HOME", str(_home(tmp_path)))
    monkeypatch.setenv("DSEC_TOKEN", "bad")
    hint = next_step(Unauthorized("invalid token")) or ""
    assert "DSEC_TOKEN" in hint and "unset DSEC_TOKEN" in hint and "dsec tenant add" in hint
    monkeypatch.delenv("DSEC_TOKEN")
    assert str(tmp_path / "home" / "token") in (next_step(Unauthorized("invalid token")) or "")
    assert "dsec image ls" in (next_step(NotFound("x", image="myimg:1")) or "")
    assert "ensure-stock --only python" in (next_step(NotFound("x", image="python")) or "")
    assert "ensure-stock --only busybox" in (next_step(NotFound("x", image="busybox:latest")) or "")
    assert next_step(NotFound("sandbox gone", sandbox_id="sb-1")) is None  # the message already says it


def test_fails_over_to_the_next_server(tmp_path: Path) -> None:
    """DSEC_URL with several servers: a request nobody answered at the first goes to the
    next; when none answers, the error names every URL and why."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'[{"id": "sb-1"}]'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    dead, dead2 = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    try:
        live = f"http://127.0.0.1:{srv.server_address[1]}"
        env = {"DSEC_HOME": str(tmp_path), "DSEC_URL": f"{dead},{live}"}
        with wire.Wire(wire.resolve_target(env)) as w:
            assert w.call("GET", "/v1/sandboxes") == [{"id": "sb-1"}] and w.url == live
    finally:
        srv.shutdown()
    env = {"DSEC_HOME": str(tmp_path), "DSEC_URL": f"{dead},{dead2}"}
    with wire.Wire(wire.resolve_target(env)) as w, pytest.raises(wire.ServerUnreachable) as e:
        w.call("GET", "/v1/sandboxes")
    assert f"any of {dead} (Connection refused), {dead2} (Connection refused)" in e.value.message


def test_plain_socket_http_chunked_stream_then_keep_alive(tmp_path: Path) -> None:
    """The CLI's own HTTP/1.1: a chunked NDJSON stream (lines split across chunks) read
    to its end, then a Content-Length answer on the same kept-alive connection, then a
    429 with Retry-After retried; one TCP connection for all of it."""
    import socket as so
    import threading

    srv = so.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    accepted: list[int] = []
    requests: list[bytes] = []

    def serve() -> None:
        c, _ = srv.accept()
        accepted.append(1)
        f = c.makefile("rb")
        answers = [
            (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
             b"9\r\n{\"kind\": \r\n" b"12\r\n\"stdout\", \"n\": 1}\n\r\n" b"0\r\n\r\n"),
            b"HTTP/1.1 429 Too Many\r\nretry-after: 0.01\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\": 42}\n",
        ]
        for raw in answers:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += f.readline()
            requests.append(head.split(b"\r\n")[0])
            n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
            f.read(n)
            c.sendall(raw)
        c.close()

    threading.Thread(target=serve, daemon=True).start()
    env = {"DSEC_HOME": str(tmp_path), "DSEC_URL": f"http://127.0.0.1:{srv.getsockname()[1]}", "DSEC_TOKEN": "t"}
    with wire.Wire(wire.resolve_target(env)) as w:
        assert list(w.lines("POST", "/v1/sandboxes/sb-1/exec/stream", {"cmd": "true"})) == [
            {"kind": "stdout", "n": 1}]
        assert w.call("GET", "/v1/sandboxes") == {"ok": 42}
    srv.close()
    assert accepted == [1]
    assert requests == [b"POST /v1/sandboxes/sb-1/exec/stream HTTP/1.1", b"GET /v1/sandboxes HTTP/1.1",
                        b"GET /v1/sandboxes HTTP/1.1"]
