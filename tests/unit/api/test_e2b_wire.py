"""E2B wire formats (``dsec.api.compat.e2b_wire``): pure functions, no server."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest

from dsec.api.compat import e2b_wire as w
from dsec.errors import InvalidArgument, NotFound, PayloadTooLarge, QuotaExceeded, SandboxFailure
from dsec.models import FileEntry


def test_envelopes_round_trip_and_end_of_stream() -> None:
    """Connect framing: flag byte + big-endian length; the end-of-stream frame (0x02) carries
    the error, and is skipped when a request body is split into messages."""
    body = w.envelope({"a": 1}) + w.end_stream(("deadline_exceeded", "late"))
    flags, n = struct.unpack_from(">BI", body, 0)
    assert (flags, json.loads(body[5:5 + n])) == (0, {"a": 1})
    tail = body[5 + n:]
    assert tail[0] == w.END_STREAM
    assert json.loads(tail[5:]) == {"error": {"code": "deadline_exceeded", "message": "late"}}
    assert json.loads(w.end_stream()[5:]) == {}
    assert w.parse_envelopes(body) == [b'{"a":1}']


@pytest.mark.parametrize("bad", [b"\x00\x00\x00", b"\x00\x00\x00\x00\x09{}", b"\x01\x00\x00\x00\x02{}"])
def test_malformed_envelopes_are_invalid_argument(bad: bytes) -> None:
    """Truncated headers or payloads and compressed messages are refused by name."""
    with pytest.raises(InvalidArgument):
        w.parse_envelopes(bad)


def test_connect_timeout_header() -> None:
    assert w.parse_timeout_ms(None) is None
    assert w.parse_timeout_ms("1500") == 1.5
    for bad in ("-1", "1e3", "12345678901"):
        with pytest.raises(InvalidArgument, match="Connect-Timeout-Ms"):
            w.parse_timeout_ms(bad)


def test_command_timeout() -> None:
    """E2B's timeout=0 (no header) is no limit, not DSec's 60 s exec default; a given
    timeout ends the command just before the client's deadline."""
    assert w.command_timeout(None) == 24 * 3600
    assert w.command_timeout(60.0) == pytest.approx(59.95)
    assert w.command_timeout(0.1) == pytest.approx(0.09)
    assert w.command_timeout(10 ** 7) == 24 * 3600


def test_error_mapping_tells_a_dead_sandbox_from_a_missing_file() -> None:
    """The SDK raises SandboxNotRunning for 'was not found' + unavailable, FileNotFound for
    not_found: a NotFound about the sandbox must become the first, one about a path the second."""
    code, msg = w.connect_error(NotFound("sandbox sb-1 not found", sandbox_id="sb-1"), "sb-1")
    assert code == "unavailable" and "was not found" in msg
    assert w.connect_error(NotFound("no such file", path="/x"), "sb-1") == ("not_found", "no such file")
    assert w.connect_error(w.AlreadyExists("/d already exists"), "s")[0] == "already_exists"
    assert w.connect_error(QuotaExceeded("quota"), "s")[0] == "resource_exhausted"
    assert w.connect_error(SandboxFailure("agent gone"), "s")[0] == "unavailable"
    assert w.connect_error(InvalidArgument("bad"), "s")[0] == "invalid_argument"
    assert w.http_error(InvalidArgument("bad")) == (400, {"code": 400, "message": "bad"})
    assert w.http_error(PayloadTooLarge("big"))[0] == 413


def test_envd_token_binds_tenant_and_sandbox() -> None:
    """A token opens exactly one sandbox of one tenant, and names that tenant."""
    t = w.envd_token("team-a", "h1", "sb-1")
    assert w.envd_token_tenant(t) == "team-a"
    assert w.envd_token_valid(t, "team-a", "h1", "sb-1")
    assert not w.envd_token_valid(t, "team-a", "h1", "sb-2")
    assert not w.envd_token_valid(t, "team-a", "h2", "sb-1")  # token rotated
    assert not w.envd_token_valid(w.envd_token("team-b", "h1", "sb-1"), "team-a", "h1", "sb-1")
    for bad in ("", "dsec_x", "dsec_envd_%%%.00", "dsec_envd_" + "A" * 600 + ".0"):
        assert w.envd_token_tenant(bad) is None


def test_multipart_as_httpx_encodes_it() -> None:
    """The SDK's multipart upload (httpx) parses back to (path, bytes), binary-safe and with
    httpx's filename escaping undone."""
    files = [("file", ("/w/a.txt", b"hello")), ("file", ("/w/q\"u\\o.bin", bytes(range(256)) + b"\r\n--x"))]
    req = httpx.Request("POST", "http://x/files", files=files)
    body = req.read()
    got = w.parse_multipart(body, req.headers["content-type"])
    assert got == [("/w/a.txt", b"hello"), ("/w/q\"u\\o.bin", bytes(range(256)) + b"\r\n--x")]
    with pytest.raises(InvalidArgument, match="boundary"):
        w.parse_multipart(body, "multipart/form-data")
    with pytest.raises(InvalidArgument):
        w.parse_multipart(b"garbage", req.headers["content-type"])


def test_command_argv_falls_back_to_sh_without_bash() -> None:
    """The SDK always asks for /bin/bash -l -c; busybox images have only /bin/sh."""
    argv = w.command_argv(w.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "echo hi"]))
    assert argv[:2] == ["/bin/sh", "-c"] and argv[-3:] == ["-l", "-c", "echo hi"] and "/bin/bash" in argv[2]
    assert w.command_argv(w.ProcessConfig(cmd="/usr/bin/env", args=["true"])) == ["/usr/bin/env", "true"]
    with pytest.raises(InvalidArgument):
        w.command_argv(w.ProcessConfig(cmd="/bin/sh", args=["a\0b"]))


def test_process_events() -> None:
    """Output is base64 (proto3 JSON bytes); exit status and signal deaths as envd reports them."""
    assert base64.b64decode(w.data_event("stdout", "hé")["event"]["data"]["stdout"]) == "hé".encode()
    assert w.end_event(0)["event"]["end"] == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    assert w.end_event(3)["event"]["end"]["error"] == "exit status 3"
    killed = w.end_event(-1, signal=9)["event"]["end"]
    assert killed["exitCode"] == -1 and killed["error"] == "signal: killed"
    assert w.signal_number("SIGNAL_SIGKILL") == 9 and w.signal_number(15) == 15
    with pytest.raises(InvalidArgument, match="signal"):
        w.signal_number("SIGNAL_SIGSTOP")


def test_entry_info_and_paths() -> None:
    e = FileEntry(name="d", path="/a/d", size=4096, mode=0o755, type="dir", mtime=0.0)
    info = w.entry_info(e)
    assert info["type"] == "FILE_TYPE_DIRECTORY" and info["permissions"] == "drwxr-xr-x"
    assert info["size"] == "4096" and info["modifiedTime"] == "1970-01-01T00:00:00Z"
    assert w.split_path("/a/b/") == ("/a", "b") and w.split_path("/") == ("/", "")
    assert w.split_path("/x") == ("/", "x")


def test_metadata_query_and_unsupported_create_options() -> None:
    assert w.parse_metadata_query("run%3D1=a%20b&k=v") == {"run=1": "a b", "k": "v"}
    assert w.parse_metadata_query(None) == {}
    with pytest.raises(InvalidArgument, match="metadata"):
        w.parse_metadata_query("no-equals-sign")
    body = w.NewSandbox.model_validate({"templateID": "busybox", "autoPause": True, "mcp": {"x": 1},
                                        "allow_internet_access": False, "unknownField": 1})
    assert [b.split(" ")[0] for b in w.unsupported_create_fields(body)] == ["autoPause", "mcp"]
