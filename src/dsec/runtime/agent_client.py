"""asyncio client of the in-sandbox exec agent (dsec-init); the node agent's only exec path.

The agent forks one handler per connection, so a slow command never blocks another.
Foreground execs ask for keep-alive: after a clean exit frame that says so, the
connection goes back to a small per-sandbox idle pool and carries the next exec
(no connect, accept or handler fork: about half of a trivial exec's round trip). A
connection serves one exec at a time, so two execs' output never share one; concurrent
execs take more connections. A pooled connection the agent has meanwhile closed (idle
limit, restart) is replaced transparently: the request is re-sent on a fresh connection
only when the old one ended before answering anything, i.e. before the agent read it.
Closing a connection before the exit frame cancels the exec: the agent kills the
command's whole process tree. A timeout is a result (``timed_out=True``), not an
exception; an unreachable agent or a broken stream raises ``SandboxFailure`` naming the
socket. Wire format: docs/exec-agent.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dsec.config import get_settings
from dsec.errors import DSecError, SandboxFailure
from dsec.models import BackgroundProcess
from dsec.runtime.agent import protocol as p

__all__ = [
    "ExecOutcome",
    "agent_background",
    "agent_exec",
    "agent_exec_stream",
    "agent_forget",
    "agent_kill",
    "agent_ping",
    "agent_ps",
    "register_opener",
    "unregister_opener",
]


@dataclass(frozen=True)
class ExecOutcome:
    """Result of one exec. In ``agent_exec_stream`` stdout/stderr are empty (already streamed)."""

    exit_code: int  # 128+signal when killed by a signal (also after a timeout kill)
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    duration: float  # seconds, host-measured round trip
    pid: int | None = None  # the command's pid inside the sandbox


Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
# Agents reached another way than connect() to a host socket path (gVisor: a relay
# started with `runsc exec`), by the key their sandbox's execs use as ``sock_path``.
_openers: dict[str, Opener] = {}


def register_opener(key: Path, opener: Opener) -> None:
    """Connections to ``key`` are made by ``opener`` (a stream to the agent) from now on."""
    _openers[str(key)] = opener


def unregister_opener(key: Path) -> None:
    _openers.pop(str(key), None)


class _Stale(Exception):
    """A pooled connection ended before answering: the agent never read the request."""


class _Conn:
    """One agent connection with frame reads bounded by an optional deadline."""

    def __init__(self, sock_path: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.where = f"socket {sock_path}"
        self.reader, self.writer = reader, writer
        self.reused = False  # came from the idle pool (it may have been closed meanwhile)
        self.idle_since = 0.0

    @classmethod
    async def open(cls, sock_path: Path) -> _Conn:
        timeout = get_settings().agent_connect_timeout_s
        opener = _openers.get(str(sock_path))
        try:
            async with asyncio.timeout(timeout):
                if opener is not None:
                    reader, writer = await opener()
                else:
                    reader, writer = await asyncio.open_unix_connection(str(sock_path))
        except (OSError, TimeoutError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            raise SandboxFailure(
                f"exec agent at socket {sock_path} is unreachable ({reason}): the sandbox's init "
                "(dsec-init) is not running or the sandbox is gone; recreate the sandbox",
                socket=str(sock_path)) from exc
        return cls(sock_path, reader, writer)

    async def read_frame(self, deadline: float | None = None, first: bool = False) -> tuple[bytes, bytes]:
        try:
            if deadline is None:
                return await self._read()
            async with asyncio.timeout_at(deadline):
                return await self._read()
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if first and self.reused and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
                raise _Stale() from exc
            raise SandboxFailure(f"exec agent at {self.where} broke the stream ({exc!r}); the sandbox "
                                 "or its init process may have died", socket=self.where) from exc
        except TimeoutError:
            raise SandboxFailure(f"exec agent at {self.where} stopped answering (no reply past the exec "
                                 "timeout plus grace); the sandbox may be frozen or overloaded",
                                 socket=self.where) from None
        except OSError as exc:
            raise SandboxFailure(f"exec agent at {self.where} broke the stream ({exc!r}); the sandbox "
                                 "or its init process may have died", socket=self.where) from exc

    async def _read(self) -> tuple[bytes, bytes]:
        length, kind = p.parse_header(await self.reader.readexactly(5))
        payload = await self.reader.readexactly(length) if length else b""
        return kind, payload

    async def send(self, data: bytes) -> None:
        try:
            self.writer.write(data)
            await self.writer.drain()
        except OSError as exc:
            if self.reused:
                raise _Stale() from exc
            raise SandboxFailure(f"exec agent at {self.where} refused data ({exc!r})", socket=self.where) from exc

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError:  # its event loop is closed (a pooled conn outlived it): drop the fd
            sock = getattr(self.writer.transport, "_sock", None)
            if sock is not None:
                sock.close()

    def unexpected(self, kind: bytes, payload: bytes) -> DSecError:
        if kind == b"F":
            err = p.failure_error(payload, self.where)
            assert isinstance(err, DSecError)
            return err
        return SandboxFailure(f"exec agent at {self.where} sent an unexpected {kind!r} frame", socket=self.where)


# Idle kept-alive connections: event loop -> socket path -> connections, newest last.
# Per loop because asyncio transports belong to the loop that opened them.
_idle: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, list[_Conn]]] = weakref.WeakKeyDictionary()


def _idle_of(sock_path: Path) -> list[_Conn] | None:
    return _idle.get(asyncio.get_running_loop(), {}).get(str(sock_path))


async def _checkout(sock_path: Path) -> _Conn:
    """A pooled idle connection when a fresh enough one is there, else a new one."""
    conns = _idle_of(sock_path)
    if conns:
        horizon = time.monotonic() - get_settings().agent_keepalive_idle_s
        while conns:
            conn = conns.pop()
            if conn.idle_since >= horizon and not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
    return await _Conn.open(sock_path)


def _checkin(sock_path: Path, conn: _Conn) -> bool:
    """Keep conn for the next exec; False (caller closes it) when the pool is full."""
    limit = get_settings().agent_keepalive_max_idle
    per_loop = _idle.setdefault(asyncio.get_running_loop(), {})
    conns = per_loop.setdefault(str(sock_path), [])
    if len(conns) >= limit:
        return False
    conn.reused, conn.idle_since = True, time.monotonic()
    conns.append(conn)
    return True


# Agent sockets whose background table is known to be empty: the host marks a new agent
# (fresh init, or a recycled one whose table it cleared) and every background request
# unmarks its socket before it is sent. Only the host reaches an agent's socket (it is
# bound outside the sandbox; init got the listening fd), so a marked table is empty and a
# recycle needs no clear request for it (issue 15). Unmarked (a background exec ran, or
# the server restarted since the agent started): cleared as before.
_bg_empty: set[str] = set()


def agent_mark_bg_empty(sock_path: Path) -> None:
    """sock_path's agent has an empty background table (it just started, or was cleared)."""
    _bg_empty.add(str(sock_path))


def agent_bg_known_empty(sock_path: Path) -> bool:
    """True when no background request reached sock_path's agent since it was marked."""
    return str(sock_path) in _bg_empty


def agent_forget(sock_path: Path) -> None:
    """Close the idle connections kept for sock_path (its sandbox is going away)."""
    _bg_empty.discard(str(sock_path))
    for per_loop in list(_idle.values()):
        for conn in per_loop.pop(str(sock_path), []):
            conn.close()


_STDIN_FINISH_S = 2.0  # the agent waits this long (LINGER_MS) for each stdin frame it drains


async def _feed_stdin(conn: _Conn, data: bytes) -> bool:
    """True once every stdin frame was written. A command that exits without reading
    stdin closes the pipe; the exit frame decides the result."""
    with contextlib.suppress(OSError, SandboxFailure):
        for fr in p.stdin_frames(data):
            conn.writer.write(fr)
            await conn.writer.drain()
        return True
    return False


async def agent_exec_stream(sock_path: Path, argv: list[str], *, env: dict[str, str], cwd: str,
                            timeout: float | None, stdin: bytes | None = None,
                            ) -> AsyncIterator[tuple[str, bytes] | ExecOutcome]:
    """Yield ("stdout"|"stderr", chunk) as the command writes, then one ExecOutcome.

    Closing the iterator early (``aclose()``, or leaving ``contextlib.aclosing``) closes
    the connection, and the agent kills the command's process tree.
    """
    settings = get_settings()
    keep = settings.agent_keepalive_max_idle > 0
    request = p.encode_exec(argv, env, cwd, timeout, stdin=stdin is not None, keep_alive=keep)
    start = time.monotonic()
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout + settings.agent_grace_s
    conn = await _checkout(sock_path) if keep else await _Conn.open(sock_path)
    feeder: asyncio.Task[bool] | None = None
    pooled = False
    try:
        try:
            await conn.send(request)
            kind, payload = await conn.read_frame(deadline, first=True)
        except _Stale:
            # the agent closed this idle connection without reading the request: resend fresh
            conn.close()
            conn = await _Conn.open(sock_path)
            await conn.send(request)
            kind, payload = await conn.read_frame(deadline)
        if stdin is not None:
            feeder = asyncio.create_task(_feed_stdin(conn, stdin))
        pid = None
        while True:
            if kind == b"O":
                yield ("stdout", payload)
            elif kind == b"E":
                yield ("stderr", payload)
            elif kind == b"S":
                pid = p.decode_pid(payload)
            elif kind == b"X":
                code, timed_out = p.decode_exit(payload)
                reusable = keep and p.exit_reusable(payload)
                if reusable and feeder is not None and not feeder.done():
                    # a command that exited without reading all its stdin: the agent drains
                    # the rest before it reads the next request, so finish sending it
                    # (bounded) instead of dropping a clean connection
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(feeder), _STDIN_FINISH_S)
                # back to the pool before the last yield: a consumer may stop right there
                if reusable and (feeder is None or _fed(feeder)):
                    pooled = _checkin(sock_path, conn)
                yield ExecOutcome(code, b"", b"", timed_out, False, time.monotonic() - start, pid)
                return
            else:
                raise conn.unexpected(kind, payload)
            kind, payload = await conn.read_frame(deadline)
    finally:
        if feeder is not None and not feeder.done():
            feeder.cancel()
        if not pooled:
            conn.close()


def _fed(feeder: asyncio.Task[bool]) -> bool:
    """All stdin frames, the final 'i' included, went out (the agent drains them before
    it reads the next request); a feeder still running or failed makes the conn unusable."""
    return feeder.done() and not feeder.cancelled() and feeder.result() is True


async def agent_exec(sock_path: Path, argv: list[str], *, env: dict[str, str], cwd: str,
                     timeout: float | None, stdin: bytes | None = None, max_output: int) -> ExecOutcome:
    """Run argv to completion; keep the first max_output bytes of each stream, drain the rest."""
    if max_output < 0:
        raise ValueError(f"max_output must be >= 0, got {max_output}")
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = False
    async with contextlib.aclosing(agent_exec_stream(sock_path, argv, env=env, cwd=cwd, timeout=timeout,
                                                     stdin=stdin)) as stream:
        async for item in stream:
            if isinstance(item, ExecOutcome):
                return replace(item, stdout=bytes(bufs["stdout"]), stderr=bytes(bufs["stderr"]),
                               truncated=truncated)
            name, chunk = item
            buf = bufs[name]
            room = max_output - len(buf)
            if len(chunk) > room:
                truncated = True
                chunk = chunk[:max(room, 0)]
            buf += chunk
    raise SandboxFailure(f"exec agent at socket {sock_path} ended the stream without an exit frame")


async def agent_prime(sock_path: Path) -> None:
    """One trivial exec that leaves a kept-alive handler (its fork already done) for the
    next first exec into a new or recycled pool member: that exec skips the connect and
    the fork, ~1-1.5 ms of a warm hand-over (issue 15). Best effort: a missing `true`
    (exit 127) still leaves the connection kept, and a failure only costs that saving."""
    with contextlib.suppress(DSecError, OSError):
        await agent_exec(sock_path, ["true"], env={}, cwd="/", timeout=5.0, max_output=0)


async def _one_shot(sock_path: Path, request: bytes) -> tuple[bytes, bytes, _Conn]:
    conn = await _Conn.open(sock_path)
    try:
        await conn.send(request)
        deadline = asyncio.get_running_loop().time() + get_settings().agent_grace_s
        kind, payload = await conn.read_frame(deadline)
    finally:
        conn.close()
    return kind, payload, conn


async def agent_background(sock_path: Path, argv: list[str], *, env: dict[str, str], cwd: str,
                           output_path: str = "/dev/null") -> int:
    """Start argv in the background (own session, stdout+stderr appended to output_path,
    a path inside the sandbox); returns its pid once execve succeeded."""
    _bg_empty.discard(str(sock_path))  # first, before any await: a recycle then clears the table
    request = p.encode_exec(argv, env, cwd, None, background_output=output_path)
    kind, payload, conn = await _one_shot(sock_path, request)
    if kind != b"S":
        raise conn.unexpected(kind, payload)
    return p.decode_pid(payload)


async def agent_ps(sock_path: Path) -> list[BackgroundProcess]:
    """Background processes started through the agent (running, or their exit code)."""
    kind, payload, conn = await _one_shot(sock_path, p.encode_simple(p.OP_PS))
    if kind != b"L":
        raise conn.unexpected(kind, payload)
    return [BackgroundProcess(pid=e.pid, argv=e.argv, started_at=e.started_at, running=e.running,
                              exit_code=e.exit_code) for e in p.decode_ps(payload)]


async def agent_kill(sock_path: Path, pid: int, signal: int) -> None:
    """Signal a background process's process group and every descendant.
    Raises NotFound when pid is not a background process of this agent."""
    kind, payload, conn = await _one_shot(sock_path, p.encode_kill(pid, signal))
    if kind != b"K":
        raise conn.unexpected(kind, payload)


async def agent_clear_background(sock_path: Path) -> int:
    """Empty the agent's background table (its processes must be dead already); returns
    how many entries it held. Agents built before this op answer ``F`` (bad request),
    which raises: such a sandbox cannot be recycled."""
    kind, payload, conn = await _one_shot(sock_path, p.encode_simple(p.OP_CLEAR))
    if kind != b"C" or len(payload) != 4:
        raise conn.unexpected(kind, payload)
    return int.from_bytes(payload, "big")


async def agent_ping(sock_path: Path, timeout: float) -> bool:
    """True when an agent speaking our protocol version answers within timeout seconds."""
    try:
        async with asyncio.timeout(timeout):
            kind, payload, _ = await _one_shot(sock_path, p.encode_simple(p.OP_PING))
    except (SandboxFailure, OSError, TimeoutError):
        return False
    return kind == b"H" and bool(payload) and p.decode_ping(payload)[0] == p.PROTO_VERSION
