"""Wire protocol of the in-sandbox exec agent (dsec-init), pure encode/decode.

No I/O here: ``dsec.runtime.agent_client`` does the socket work. The format is
documented in docs/exec-agent.md; the limits below must match ``dsec_init.c``.

Frame = u32 big-endian length of (type byte + payload), 1-byte type, payload.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from dsec.errors import InvalidArgument, NotFound, SandboxFailure

PROTO_VERSION = 1
MAX_REQUEST = 1 << 20  # largest request frame the agent accepts (MAX_REQUEST in C)
MAX_STRINGS = 65536  # argc + envc (MAX_STRINGS in C)
CHUNK = 65536  # stdin/output frame payload (CHUNK in C)
MAX_REPLY_FRAME = 8 << 20  # sanity bound on frames from the agent (largest: ps list)
MAX_TIMEOUT_MS = 0xFFFFFFFF

HEADER = struct.Struct(">IB")

OP_EXEC, OP_BACKGROUND, OP_PS, OP_KILL, OP_PING = b"E", b"B", b"P", b"K", b"H"
OP_CLEAR = b"C"  # forget the background table (recycling a sandbox for another tenant)

# 'F' failure kinds (first payload byte) -> the error class a caller sees
F_BAD_REQUEST, F_NOT_FOUND, F_EXEC, F_RESOURCE = 1, 2, 3, 4


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    """Encode one frame."""
    return HEADER.pack(len(payload) + 1, kind[0]) + payload


def parse_header(header: bytes) -> tuple[int, bytes]:
    """(payload length, type) of a 5-byte frame header; rejects absurd lengths."""
    length, kind = HEADER.unpack(header)
    if length < 1 or length > MAX_REPLY_FRAME:
        raise SandboxFailure(f"exec agent sent a frame of {length} bytes: protocol violation")
    return length - 1, bytes([kind])


def _cstr(value: str, what: str) -> bytes:
    raw = value.encode()
    if b"\0" in raw:
        raise InvalidArgument(f"{what} contains a NUL byte: {value!r}")
    return raw + b"\0"


def timeout_to_ms(timeout: float | None) -> int:
    """Seconds (None = no limit) to the wire's u32 milliseconds (0 = no limit)."""
    if timeout is None:
        return 0
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidArgument(f"exec timeout must be a positive number of seconds, got {timeout!r}")
    return min(MAX_TIMEOUT_MS, max(1, math.ceil(timeout * 1000)))


FLAG_STDIN, FLAG_KEEPALIVE = 1, 2  # exec request flags


def encode_exec(argv: list[str], env: dict[str, str], cwd: str, timeout: float | None, *,
                stdin: bool = False, background_output: str | None = None, keep_alive: bool = False) -> bytes:
    """The 'R' frame of a foreground ('E') or background ('B', when background_output is set) exec.

    keep_alive asks the agent to keep the connection for the next exec; its exit frame
    then says whether it did (``exit_reusable``). Agents before keep-alive ignore the bit.
    """
    if not argv or not argv[0]:
        raise InvalidArgument("exec argv must be a non-empty list with a non-empty program name")
    if len(argv) + len(env) > MAX_STRINGS:
        raise InvalidArgument(f"exec has {len(argv)} argv + {len(env)} env strings; the limit is {MAX_STRINGS}")
    for key in env:
        if not key or "=" in key:
            raise InvalidArgument(f"environment variable name {key!r} is empty or contains '='")
    op = OP_BACKGROUND if background_output is not None else OP_EXEC
    parts = [bytes([PROTO_VERSION]), op,
             struct.pack(">IIIB", timeout_to_ms(timeout), len(argv), len(env),
                         (FLAG_STDIN if stdin else 0) | (FLAG_KEEPALIVE if keep_alive else 0)),
             _cstr(cwd, "cwd")]
    parts += [_cstr(a, "argv entry") for a in argv]
    parts += [_cstr(f"{k}={v}", f"env {k}") for k, v in env.items()]
    if background_output is not None:
        parts.append(_cstr(background_output, "output path"))
    payload = b"".join(parts)
    if len(payload) + 1 > MAX_REQUEST:
        raise InvalidArgument(
            f"exec request is {len(payload)} bytes (argv + env); the limit is {MAX_REQUEST} bytes")
    return frame(b"R", payload)


def encode_simple(op: bytes) -> bytes:
    """'R' frame of a request without fields (ping, ps)."""
    return frame(b"R", bytes([PROTO_VERSION]) + op)


def encode_kill(pid: int, signal: int) -> bytes:
    if not 1 < pid < 2**31:
        raise InvalidArgument(f"pid {pid} is not a killable process id")
    if not 0 <= signal < 65:
        raise InvalidArgument(f"signal {signal} is out of range 0..64")
    return frame(b"R", bytes([PROTO_VERSION]) + OP_KILL + struct.pack(">II", pid, signal))


def stdin_frames(data: bytes) -> list[bytes]:
    """'I' frames of at most CHUNK bytes, then the 'i' end-of-input frame."""
    out = [frame(b"I", data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]
    out.append(frame(b"i"))
    return out


def _unpack(fmt: str, payload: bytes, what: str) -> tuple[int, ...]:
    try:
        return struct.unpack_from(fmt, payload)
    except struct.error:
        raise SandboxFailure(f"exec agent sent a malformed {what} frame ({len(payload)} bytes)") from None


def decode_pid(payload: bytes) -> int:
    return _unpack(">I", payload, "started")[0]


def decode_exit(payload: bytes) -> tuple[int, bool]:
    """(exit code, timed_out) of an 'X' frame; signals are 128+signo."""
    code, timed_out = _unpack(">iB", payload, "exit")
    return code, bool(timed_out)


def exit_reusable(payload: bytes) -> bool:
    """Whether an 'X' frame says the connection takes the next request (keep-alive was
    asked and the agent kept it: nothing of the exec is left running under its handler)."""
    return len(payload) >= 6 and payload[5] == 1


def decode_ping(payload: bytes) -> tuple[int, str]:
    """(protocol version, agent identification) of an 'H' reply."""
    if not payload:
        raise SandboxFailure("exec agent sent an empty ping reply")
    return payload[0], payload[1:].decode(errors="replace")


@dataclass(frozen=True)
class PsEntry:
    pid: int
    running: bool
    exit_code: int | None
    started_at: float  # unix seconds
    argv: list[str]


def decode_ps(payload: bytes) -> list[PsEntry]:
    """Entries of an 'L' frame: u32 count, then per entry u32 pid, u8 running,
    i32 exit code, u64 start (unix ms), u16 argv length, NUL-separated argv."""
    try:
        (count,) = struct.unpack_from(">I", payload, 0)
        off, out = 4, []
        for _ in range(count):
            pid, running, code, start_ms, alen = struct.unpack_from(">IBiQH", payload, off)
            off += 19
            blob = payload[off:off + alen]
            if len(blob) != alen:
                raise struct.error("argv past the end")
            off += alen
            argv = [a.decode(errors="replace") for a in blob.split(b"\0")[:-1]]
            out.append(PsEntry(pid, bool(running), None if running else code, start_ms / 1000.0, argv))
    except struct.error:
        raise SandboxFailure(f"exec agent sent a malformed process list ({len(payload)} bytes)") from None
    return out


def failure_error(payload: bytes, where: str) -> Exception:
    """The error to raise for an 'F' frame; ``where`` names the socket/sandbox."""
    kind = payload[0] if payload else 0
    text = payload[1:].decode(errors="replace").removeprefix("dsec-init: ")
    if kind in (F_BAD_REQUEST, F_EXEC):
        return InvalidArgument(f"exec agent {where} refused the request: {text}")
    if kind == F_NOT_FOUND:
        return NotFound(f"exec agent {where}: {text}")
    return SandboxFailure(f"exec agent {where} failed: {text}")
