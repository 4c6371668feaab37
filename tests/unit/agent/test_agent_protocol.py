"""Pure encode/decode of the exec agent wire protocol (docs/exec-agent.md)."""

from __future__ import annotations

import struct

import pytest

from dsec.errors import InvalidArgument, NotFound, SandboxFailure
from dsec.runtime.agent import protocol as p
from dsec.runtime.agent_build import CFLAGS, binary_name


def test_exec_request_layout() -> None:
    """The exec request is byte-for-byte what dsec_init.c parses."""
    fr = p.encode_exec(["ls", "-l"], {"A": "1"}, "/w", 1.5, stdin=True)
    length, kind = struct.unpack(">IB", fr[:5])
    assert kind == ord("R") and length == len(fr) - 4
    body = fr[5:]
    assert body[:2] == bytes([p.PROTO_VERSION]) + b"E"
    assert struct.unpack(">IIIB", body[2:15]) == (1500, 2, 1, 1)
    assert body[15:] == b"/w\0ls\0-l\0A=1\0"


def test_background_request_carries_output_path() -> None:
    """'B' requests end with the output path and never carry a timeout."""
    body = p.encode_exec(["sleep", "1"], {}, "", None, background_output="/tmp/o")[5:]
    assert body[1:2] == b"B" and struct.unpack(">IIIB", body[2:15]) == (0, 2, 0, 0)
    assert body[15:] == b"\0sleep\0001\0/tmp/o\0"


@pytest.mark.parametrize(("argv", "env", "cwd", "match"), [
    ([], {}, "/", "non-empty"),
    ([""], {}, "/", "non-empty"),
    (["a\0b"], {}, "/", "NUL"),
    (["a"], {"K": "v\0"}, "/", "NUL"),
    (["a"], {"K=X": "v"}, "/", "contains '='"),
    (["a"], {"": "v"}, "/", "empty"),
    (["a"], {}, "/\0", "NUL"),
    (["a", "x" * p.MAX_REQUEST], {}, "/", "limit"),
    (["a"] * (p.MAX_STRINGS + 1), {}, "/", "limit is"),
])
def test_bad_exec_requests_are_invalid_argument(argv: list[str], env: dict[str, str], cwd: str, match: str) -> None:
    """Malformed argv/env/cwd fail before anything is sent, with a message naming the problem."""
    with pytest.raises(InvalidArgument, match=match):
        p.encode_exec(argv, env, cwd, 1.0)


@pytest.mark.parametrize(("timeout", "ms"), [(None, 0), (0.0001, 1), (1.0, 1000), (2.0004, 2001), (1e12, 2**32 - 1)])
def test_timeout_to_ms(timeout: float | None, ms: int) -> None:
    """Timeouts round up (never to 0 = unlimited) and saturate at the u32 maximum."""
    assert p.timeout_to_ms(timeout) == ms


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_bad_timeouts_rejected(bad: float) -> None:
    """Zero, negative and non-finite timeouts are refused rather than meaning 'no limit'."""
    with pytest.raises(InvalidArgument):
        p.timeout_to_ms(bad)


def test_stdin_frames_chunked_and_terminated() -> None:
    """stdin is split into CHUNK-sized 'I' frames and always ends with the empty 'i' frame."""
    frames = p.stdin_frames(b"a" * (p.CHUNK * 2 + 3))
    assert [f[4:5] for f in frames] == [b"I", b"I", b"I", b"i"]
    assert [len(f) - 5 for f in frames] == [p.CHUNK, p.CHUNK, 3, 0]
    assert p.stdin_frames(b"") == [b"\0\0\0\1i"]


def test_decode_exit_ps_and_ping() -> None:
    """Replies decode to the documented fields (signed exit codes, ms timestamps, argv)."""
    assert p.decode_exit(struct.pack(">iB", 137, 1)) == (137, True)
    assert p.decode_exit(struct.pack(">iB", -1, 0)) == (-1, False)
    entries = struct.pack(">I", 2)
    entries += struct.pack(">IBiQH", 7, 1, 0, 1_700_000_000_123, 8) + b"sleep\0001\0"
    entries += struct.pack(">IBiQH", 9, 0, 143, 5, 0)
    ps = p.decode_ps(entries)
    assert ps[0] == p.PsEntry(7, True, None, 1_700_000_000.123, ["sleep", "1"])
    assert ps[1] == p.PsEntry(9, False, 143, 0.005, [])
    assert p.decode_ping(b"\x01dsec-init 1") == (1, "dsec-init 1")
    for bad in (entries[:-3], b"", struct.pack(">I", 1)):
        with pytest.raises(SandboxFailure, match="malformed"):
            p.decode_ps(bad)
    with pytest.raises(SandboxFailure, match="malformed exit"):
        p.decode_exit(b"\0\0")


def test_failure_kinds_map_to_error_classes() -> None:
    """'F' kinds become InvalidArgument / NotFound / SandboxFailure naming the socket."""
    bad = p.failure_error(b"\x01bad request: argv is empty", "socket /s")
    assert isinstance(bad, InvalidArgument) and "socket /s" in str(bad) and "argv is empty" in str(bad)
    assert isinstance(p.failure_error(b"\x03dsec-init: x: command not found", "s"), InvalidArgument)
    assert "dsec-init:" not in str(p.failure_error(b"\x03dsec-init: x: command not found", "s"))
    assert isinstance(p.failure_error(b"\x02no background process with pid 5", "s"), NotFound)
    assert isinstance(p.failure_error(b"\x04fork failed", "s"), SandboxFailure)


def test_frame_header_bounds() -> None:
    """A corrupt length from the agent is a protocol violation, not a huge allocation."""
    assert p.parse_header(b"\0\0\0\x05X") == (4, b"X")
    for bad in (b"\0\0\0\0X", struct.pack(">IB", p.MAX_REPLY_FRAME + 1, 79)):
        with pytest.raises(SandboxFailure, match="protocol violation"):
            p.parse_header(bad)


def test_kill_request_validation() -> None:
    """PID 1/0 and out-of-range signals are refused before reaching the agent."""
    assert p.encode_kill(42, 9)[5:] == b"\x01K" + struct.pack(">II", 42, 9)
    for pid, sig in ((1, 9), (0, 9), (42, 65), (42, -1)):
        with pytest.raises(InvalidArgument):
            p.encode_kill(pid, sig)


def test_binary_name_is_content_addressed() -> None:
    """Any change to the source or the flags yields a different binary name."""
    base = binary_name(b"int main(){}", CFLAGS)
    assert base == binary_name(b"int main(){}", CFLAGS) and base.startswith("dsec-init-")
    assert base != binary_name(b"int main(){ }", CFLAGS)
    assert base != binary_name(b"int main(){}", (*CFLAGS, "-g"))
