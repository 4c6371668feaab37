"""The direct data path between the control plane and a node agent (no Ray hop per call).

Why: a Ray actor call costs ~2.3 ms on one box; an exec through the cluster paid that on
top of the exec itself (1.9-4x the single-node path). The node agent actor therefore also
serves its node's protocol calls on a small TCP endpoint of its own; the control plane's
``RayNodeProxy`` keeps one connection per node alive and multiplexes every call over it.
Ray stays for control (start, heartbeats, endpoint discovery) and as the fallback.

Wire (both directions), one frame::

    u32 length of what follows | u32 request id | u8 kind | u8 len(method) | method | body

The body is JSON of the protocol's pydantic models: a call's arguments as one model
built from ``NodeAgent``'s own signature (``codec``), a result as its return type, an
error as ``NodeCallError`` (same class and details as the Ray path), a stream event as
``ExecEvent``. No pickle. Bytes travel base64.

Auth: the first frame of a connection is HELLO with the agent's token (random per agent
process, handed to the control plane through Ray); a wrong or late token is refused and
the connection closed before anything else is read. Limits: the HELLO may be 1 KiB; a
frame may be ``max_frame`` bytes (checked on the length prefix, before any allocation);
once a frame's length is in, its rest must arrive within ``read_timeout_s``.

Streams (``exec_stream``) keep the protocol's back-pressure with credits: the node sends
at most ``STREAM_WINDOW`` events the reader has not consumed; the reader returns credit
as it consumes. A result too large for one frame stays on the node and is fetched once
through Ray (``VIA_RAY`` + key), so nothing runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import inspect
import itertools
import logging
import secrets
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, PydanticUserError, TypeAdapter, create_model

from dsec import errors
from dsec.models import ExecEvent
from dsec.node.api import NodeAgent

log = logging.getLogger("dsec.cluster.data")

# Frame kinds.
HELLO, WELCOME, CALL, STREAM, CREDIT, CANCEL, OK, ERR, EVENT, END, VIA_RAY = range(1, 12)
_HEAD = struct.Struct(">I")
_META = struct.Struct(">IBB")  # request id, kind, len(method)
HELLO_MAX = 1024
STREAM_WINDOW = 64  # events the node may send ahead of the reader
_BUF = 1 << 20  # StreamReader limit: large frames without pause/resume thrash


class DataEndpoint(BaseModel):
    """Where and how to reach one node agent's data endpoint (handed out through Ray)."""

    host: str
    port: int
    token: str = Field(..., description="Per agent process; refused connections never see a call")
    max_frame: int = Field(..., description="Largest frame either side sends or accepts (bytes)")
    read_timeout_s: float = Field(..., description="Once a frame's length is read, its rest must arrive within this")


class NodeCallError(BaseModel):
    """A DSecError (or any failure) of a remote node call, as a value (both transports)."""

    cls: str
    message: str
    details: dict[str, Any] = {}

    @classmethod
    def of(cls, e: BaseException) -> NodeCallError:
        if isinstance(e, errors.DSecError):
            return cls(cls=type(e).__name__, message=e.message, details=_plain(e.details))
        return cls(cls="SandboxFailure", message=f"node agent error: {type(e).__name__}: {e}")

    def error(self) -> errors.DSecError:
        kind = getattr(errors, self.cls, None)
        if not (isinstance(kind, type) and issubclass(kind, errors.DSecError)):
            kind = errors.SandboxFailure
        return kind(self.message, **self.details)


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v) for k, v in d.items()}


class FrameError(Exception):
    """The peer broke the framing (size over the limit, bad kind, cut short, too slow)."""


class Refused(Exception):
    """The endpoint refused our token."""


# --- framing (pure) --------------------------------------------------------------------------

def frame(rid: int, kind: int, method: str = "", body: bytes = b"") -> bytes:
    m = method.encode("ascii")
    return b"".join((_HEAD.pack(_META.size + len(m) + len(body)), _META.pack(rid, kind, len(m)), m, body))


def frame_size(method: str, body_len: int) -> int:
    """Bytes after the length prefix: what ``max_frame`` bounds."""
    return _META.size + len(method) + body_len


def parse(rest: bytes) -> tuple[int, int, str, bytes]:
    """(request id, kind, method, body) of a frame's bytes after its length prefix."""
    if len(rest) < _META.size:
        raise FrameError(f"frame of {len(rest)} bytes is shorter than its header")
    rid, kind, mlen = _META.unpack_from(rest)
    if not HELLO <= kind <= VIA_RAY or _META.size + mlen > len(rest):
        raise FrameError(f"bad frame header (kind {kind}, method length {mlen})")
    end = _META.size + mlen
    return rid, kind, rest[_META.size:end].decode("ascii", "replace"), rest[end:]


async def read_frame(reader: asyncio.StreamReader, max_frame: int, timeout_s: float,
                     idle_timeout_s: float | None = None) -> tuple[int, int, str, bytes]:
    """One frame; the length is checked before the body is read (no allocation past
    ``max_frame``), the body must follow within ``timeout_s``. EOF -> IncompleteReadError."""
    if idle_timeout_s is None:
        head = await reader.readexactly(_HEAD.size)
    else:
        async with asyncio.timeout(idle_timeout_s):
            head = await reader.readexactly(_HEAD.size)
    (n,) = _HEAD.unpack(head)
    if n > max_frame:
        raise FrameError(f"frame of {n} bytes is over the limit of {max_frame}")
    try:
        async with asyncio.timeout(timeout_s):  # no extra task per frame (as wait_for makes)
            rest = await reader.readexactly(n)
    except TimeoutError:
        raise FrameError(f"frame of {n} bytes not complete within {timeout_s:g}s") from None
    return parse(rest)


# --- codecs: JSON of the protocol's own types ------------------------------------------------

_BYTES64 = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")


def _adapter(tp: Any) -> TypeAdapter[Any]:
    try:
        return TypeAdapter(tp, config=_BYTES64)
    except PydanticUserError:  # a model type carries its own config
        return TypeAdapter(tp)


class Codec:
    """Arguments and result of one ``NodeAgent`` method, derived from its signature, so
    a new parameter (or type) on the protocol travels without touching this module."""

    def __init__(self, method: str, result: Any = None) -> None:
        fn = getattr(NodeAgent, method)
        hints = get_type_hints(fn)
        sig = inspect.signature(fn)
        self.method = method
        self.params = [p for p in sig.parameters.values() if p.name != "self"]
        self.positional = [p.name for p in self.params if p.kind is not p.KEYWORD_ONLY]
        self.keyword = [p.name for p in self.params if p.kind is p.KEYWORD_ONLY]
        self.names = frozenset(p.name for p in self.params)
        fields: dict[str, Any] = {
            p.name: (hints[p.name], ... if p.default is p.empty else p.default) for p in self.params}
        self.args: type[BaseModel] = create_model(f"{method}_args", __config__=_BYTES64, **fields)
        ret = result or hints.get("return")
        self.result = _adapter(type(None) if ret is None else ret)

    def encode_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
        # Python's binding rules, without inspect.Signature.bind's cost on the hot path.
        if len(args) > len(self.positional):
            raise TypeError(f"{self.method}() takes {len(self.positional)} positional arguments, got {len(args)}")
        values = dict(zip(self.positional, args))
        bad = (kwargs.keys() - self.names) | (kwargs.keys() & values.keys())
        if bad:
            raise TypeError(f"{self.method}() got unexpected or repeated arguments {sorted(bad)}")
        values.update(kwargs)
        return self.args(**values).model_dump_json().encode()

    def decode_args(self, body: bytes) -> tuple[tuple[Any, ...], dict[str, Any]]:
        a = self.args.model_validate_json(body)
        return tuple(getattr(a, n) for n in self.positional), {n: getattr(a, n) for n in self.keyword}

    def encode_result(self, value: Any) -> bytes:
        return self.result.dump_json(value)

    def decode_result(self, body: bytes) -> Any:
        return self.result.validate_json(body)


@functools.cache
def codec(method: str) -> Codec:
    """The codec of ``method`` (``exec_stream``: its arguments, and one ``ExecEvent`` as result)."""
    return Codec(method, ExecEvent) if method == "exec_stream" else Codec(method)


# --- the node's side -------------------------------------------------------------------------

Dispatch = Callable[[str, tuple[Any, ...], dict[str, Any]], Awaitable[Any]]
OpenStream = Callable[[str, Any], Awaitable[AsyncIterator[ExecEvent]]]


class DataServer:
    """The endpoint inside the node agent actor. ``dispatch(method, args, kwargs)`` returns
    the result or a ``NodeCallError`` value (``NodeAgentServer.call``);
    ``open_stream(sandbox_id, req)`` gives the exec stream."""

    def __init__(self, dispatch: Dispatch, open_stream: OpenStream, methods: tuple[str, ...], max_frame: int,
                 read_timeout_s: float, token: str | None = None) -> None:
        self.dispatch, self.open_stream, self.methods = dispatch, open_stream, frozenset(methods)
        self.max_frame, self.read_timeout_s = max_frame, read_timeout_s
        self.token = token or secrets.token_urlsafe(32)
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._calls: set[asyncio.Task[None]] = set()
        self._stash: dict[str, tuple[float, Any]] = {}  # results too large for a frame, fetched via Ray

    async def start(self, host: str) -> DataEndpoint:
        self._server = await asyncio.start_server(self._serve, host, 0, limit=_BUF, backlog=256)
        port = self._server.sockets[0].getsockname()[1]
        return DataEndpoint(host=host, port=port, token=self.token, max_frame=self.max_frame,
                            read_timeout_s=self.read_timeout_s)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        self._conns.clear()

    def take(self, key: str) -> Any:
        """A stashed result (once); NotFound when unknown or already taken."""
        hit = self._stash.pop(key, None)
        if hit is None:
            raise errors.NotFound(f"no pending result {key!r} on this node (taken, expired or the agent restarted)")
        return hit[1]

    def _put(self, value: Any) -> str:
        now = time.monotonic()
        for k in [k for k, (t, _) in self._stash.items() if now - t > 300]:  # the caller went away
            del self._stash[k]
        key = secrets.token_hex(12)
        self._stash[key] = (now, value)
        return key

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        streams: dict[int, tuple[asyncio.Task[None], asyncio.Semaphore]] = {}
        try:
            try:
                _, kind, _, body = await read_frame(reader, HELLO_MAX, self.read_timeout_s, self.read_timeout_s)
            except (FrameError, TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                self.refused += 1
                return
            if kind != HELLO or not hmac.compare_digest(body, self.token.encode()):
                self.refused += 1
                log.warning("data endpoint: refused a connection from %s (wrong token)",
                            writer.get_extra_info("peername"))
                writer.write(frame(0, ERR, "", NodeCallError(cls="Unauthorized", message="wrong data endpoint token")
                                   .model_dump_json().encode()))
                return
            writer.write(frame(0, WELCOME))
            while True:
                rid, kind, method, body = await read_frame(reader, self.max_frame, self.read_timeout_s)
                if kind == CALL:
                    # Runs to its end even if the caller goes away (as a Ray task would).
                    t = asyncio.ensure_future(self._call(writer, rid, method, body))
                    self._calls.add(t)  # a strong reference: the loop keeps only weak ones
                    t.add_done_callback(self._calls.discard)
                elif kind == STREAM:
                    credit = asyncio.Semaphore(STREAM_WINDOW)
                    t = asyncio.ensure_future(self._stream(writer, rid, body, credit))
                    streams[rid] = (t, credit)
                    t.add_done_callback(lambda _t, r=rid: streams.pop(r, None))
                elif kind == CREDIT:
                    if rid in streams:
                        for _ in range(min(int(body or b"0"), STREAM_WINDOW)):
                            streams[rid][1].release()
                elif kind == CANCEL:
                    if rid in streams:
                        streams[rid][0].cancel()
                else:
                    raise FrameError(f"unexpected frame kind {kind} from the client")
        except (FrameError, ValueError) as e:
            log.warning("data endpoint: closing a connection: %s", e)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the control plane closed or went away
        except asyncio.CancelledError:
            pass  # close(); not re-raised: asyncio's handler callback (3.11) chokes on a cancelled task
        finally:
            for t, _ in list(streams.values()):
                t.cancel()
            self._conns.discard(task)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if writer.is_closing():
            return
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _call(self, writer: asyncio.StreamWriter, rid: int, method: str, body: bytes) -> None:
        try:
            if method not in self.methods:
                raise errors.InvalidArgument(f"{method!r} is not a NodeAgent method")
            c = codec(method)
            args, kwargs = c.decode_args(body)
            out = await self.dispatch(method, args, kwargs)
            if isinstance(out, NodeCallError):
                await self._send(writer, frame(rid, ERR, "", out.model_dump_json().encode()))
                return
            data = c.encode_result(out)
        except Exception as e:  # noqa: BLE001 - bad arguments or an unencodable answer: the caller's error
            await self._send(writer, frame(rid, ERR, "", _failure(e)))
            return
        if frame_size("", len(data)) > self.max_frame:
            await self._send(writer, frame(rid, VIA_RAY, "", self._put(out).encode()))
            return
        await self._send(writer, frame(rid, OK, "", data))

    async def _stream(self, writer: asyncio.StreamWriter, rid: int, body: bytes, credit: asyncio.Semaphore) -> None:
        try:
            args, _ = codec("exec_stream").decode_args(body)
            async for ev in await self.open_stream(*args):
                await credit.acquire()  # the reader's back-pressure
                data = ev.model_dump_json().encode()
                if frame_size("", len(data)) > self.max_frame:
                    raise errors.PayloadTooLarge(f"exec stream event of {len(data)} bytes over the data frame limit")
                await self._send(writer, frame(rid, EVENT, "", data))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the reader gets it as its last item
            await self._send(writer, frame(rid, ERR, "", _failure(e)))
            return
        await self._send(writer, frame(rid, END))


def _failure(e: BaseException) -> bytes:
    if isinstance(e, ValueError) and not isinstance(e, errors.DSecError):
        # pydantic's ValidationError: the arguments did not fit the protocol's types
        return NodeCallError(cls="InvalidArgument", message=f"bad node call arguments: {e}").model_dump_json().encode()
    return NodeCallError.of(e).model_dump_json().encode()


# --- the control plane's side ----------------------------------------------------------------

LostError = Callable[[str], errors.DSecError]


class DataClient:
    """One kept-alive, multiplexed connection to a node's data endpoint (one event loop).

    Every failure of the connection (reset, EOF, broken framing) fails the calls in
    flight with ``lost(reason)`` (NodeLost) at once; the caller reconnects next time."""

    def __init__(self, ep: DataEndpoint, lost: LostError) -> None:
        self.ep, self.lost = ep, lost
        self.loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._streams: dict[int, asyncio.Queue[tuple[int, bytes] | BaseException]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self.dead: str | None = None

    @property
    def alive(self) -> bool:
        return self.dead is None and self._writer is not None and not self._writer.is_closing()

    async def connect(self, timeout_s: float) -> None:
        """Open and authenticate; OSError/TimeoutError when nothing answers, Refused on a wrong token."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(self.ep.host, self.ep.port, limit=_BUF),
                                                timeout_s)
        try:
            writer.write(frame(0, HELLO, "", self.ep.token.encode()))
            _, kind, _, body = await read_frame(reader, HELLO_MAX, timeout_s, timeout_s)
        except (FrameError, asyncio.IncompleteReadError) as e:
            writer.close()
            raise Refused(f"the data endpoint closed the handshake ({type(e).__name__})") from None
        except BaseException:
            writer.close()
            raise
        if kind != WELCOME:
            writer.close()
            raise Refused(body.decode(errors="replace"))
        self._writer = writer
        self._reader_task = asyncio.ensure_future(self._read_loop(reader))

    def close(self) -> None:
        self._abort("closed by the control plane")

    def abort(self, reason: str) -> None:
        """Fail every call and stream in flight with ``lost(reason)`` and drop the connection."""
        self._abort(reason)

    def _abort(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.lost(self.dead))
        self._pending.clear()
        for q in self._streams.values():
            q.put_nowait(self.lost(self.dead))
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                rid, kind, _, body = await read_frame(reader, self.ep.max_frame, self.ep.read_timeout_s)
                if kind in (EVENT, END) or (kind == ERR and rid in self._streams):
                    q = self._streams.get(rid)
                    if q is not None:
                        q.put_nowait((kind, body))
                    continue
                fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result((kind, body))
        except asyncio.CancelledError:
            self._abort(self.dead or "connection closed")
            raise
        except asyncio.IncompleteReadError:
            self._abort("the data endpoint closed the connection")
        except (FrameError, ConnectionError, OSError) as e:
            self._abort(f"{type(e).__name__}: {e}")

    def _write(self, data: bytes) -> None:
        if not self.alive:
            raise self.lost(self.dead or "connection closed")
        assert self._writer is not None
        self._writer.write(data)

    async def call(self, method: str, body: bytes) -> tuple[int, bytes]:
        """(kind, body) of the answer: OK, ERR or VIA_RAY."""
        rid = next(self._ids) & 0xFFFFFFFF
        fut: asyncio.Future[tuple[int, bytes]] = self.loop.create_future()
        self._pending[rid] = fut
        try:
            self._write(frame(rid, CALL, method, body))
            assert self._writer is not None
            if self._writer.transport.get_write_buffer_size() > _BUF:
                await self._writer.drain()
            return await fut
        finally:
            self._pending.pop(rid, None)

    async def stream(self, method: str, body: bytes) -> AsyncIterator[tuple[int, bytes]]:
        """EVENT bodies as they come, then ends (END) or yields the ERR as last item."""
        rid = next(self._ids) & 0xFFFFFFFF
        q: asyncio.Queue[tuple[int, bytes] | BaseException] = asyncio.Queue()
        self._streams[rid] = q
        done = False
        consumed = 0
        try:
            self._write(frame(rid, STREAM, method, body))
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item[0] == END:
                    done = True
                    return
                if item[0] == ERR:
                    done = True
                    yield item
                    return
                yield item
                consumed += 1
                if consumed >= STREAM_WINDOW // 2:  # hand the credit back in batches
                    self._write(frame(rid, CREDIT, "", str(consumed).encode()))
                    consumed = 0
        finally:
            self._streams.pop(rid, None)
            if not done and self.alive:
                self._write(frame(rid, CANCEL))
