"""Trajectory log: per-step records as zstd-compressed JSONL.

Encoding: every record is one independent zstd frame holding one JSON line, and a
segment is the concatenation of frames. The result is a valid multi-frame zstd stream
(``zstd -dc seg | jq`` works, and so does concatenating segments for export), and a
reader can stop cleanly at the first incomplete frame: a torn tail loses at most the
record being written, never an earlier one.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path

import zstandard
from pydantic import BaseModel, Field

SCHEMA_VERSION = 1
_ZLEVEL = 3  # records are small; level 3 is the zstd default speed/ratio point


class StepRecord(BaseModel):
    """One executed command of an episode, exactly as the agent saw it."""

    schema_version: int = SCHEMA_VERSION
    step: int = Field(..., ge=0)
    command: str | list[str]
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin_sha256: str | None = None
    timeout: float | None = None
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    truncated: bool = False
    started_at: float
    duration: float = Field(..., description="Wall time of the command (s)")
    checkpoint_s: float = Field(0.0, description="Time spent checkpointing after the command (s)")
    fs_changed: bool = False
    fs_bytes: int = Field(0, description="Compressed bytes of the fs diff written for this step")
    fs_digest: str = Field("", description="Canonical digest of the episode filesystem after the step")

    def same_command(self, command: str | list[str], cwd: str | None, env: dict[str, str] | None,
                     stdin_sha256: str | None) -> bool:
        return (self.command, self.cwd, self.env or None, self.stdin_sha256) == \
            (command, cwd, env or None, stdin_sha256)


_cctx = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_cctx, "c", None)
    if c is None:
        c = _cctx.c = zstandard.ZstdCompressor(level=_ZLEVEL, write_checksum=True)
    return c


def encode_record(rec: BaseModel | dict) -> bytes:
    line = rec.model_dump_json() if isinstance(rec, BaseModel) else json.dumps(rec, sort_keys=True)
    return _compressor().compress(line.encode() + b"\n")


def encode_segment(records: Iterable[BaseModel | dict]) -> bytes:
    return b"".join(encode_record(r) for r in records)


def iter_lines(data: bytes) -> Iterator[bytes]:
    """Yield the JSON lines of a multi-frame segment; stop silently at a torn/corrupt tail."""
    rest = data
    while rest:
        d = zstandard.ZstdDecompressor().decompressobj()
        try:
            out = d.decompress(rest)
        except zstandard.ZstdError:
            return
        if not d.eof:
            return  # incomplete last frame: the record being written when we crashed
        for line in out.splitlines():
            if line.strip():
                yield line
        rest = d.unused_data


def decode_segment(data: bytes) -> list[StepRecord]:
    out = []
    for line in iter_lines(data):
        try:
            out.append(StepRecord.model_validate_json(line))
        except ValueError:
            return out
    return out


class JournalWriter:
    """Append-only local journal of step records, encoded and made durable off the caller.

    ``append`` only queues the record and returns a future; a background thread
    compresses it into its own frame, writes it and fsyncs, then resolves the future with
    the frame's bytes (so the caller can reuse them as the checkpoint unit's trajectory
    segment instead of encoding twice). ``flush`` waits until everything appended so far
    is durable: call it at a step boundary, before the unit's metadata is written. After
    a crash, :func:`read_journal` returns every flushed record plus whatever complete
    records followed; a torn last frame (the record being written) is dropped.
    """

    def __init__(self, path: Path, initial: bytes | None = None) -> None:
        """Open ``path`` for appending; with ``initial``, first replace its content atomically
        (a restored episode's journal restarts from its checkpoint's trajectory)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if initial is not None:
            from dsec.durable import atomic_write
            atomic_write(path, initial)
        self._fh = open(path, "ab")  # noqa: SIM115 - held open for the journal's lifetime
        self._cv = threading.Condition()
        self._queue: list[tuple[BaseModel | dict, Future[bytes]]] = []
        self._durable = self._queued = 0
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"journal-{path.name}", daemon=True)
        self._thread.start()

    def append(self, rec: BaseModel | dict) -> Future[bytes]:
        fut: Future[bytes] = Future()
        with self._cv:
            if self._error:
                raise self._error
            if self._closed:
                raise ValueError(f"journal {self.path} is closed")
            self._queue.append((rec, fut))
            self._queued += 1
            self._cv.notify_all()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                batch, self._queue = self._queue, []
                if not batch and self._closed:
                    return
            try:
                frames = [encode_record(rec) for rec, _ in batch]
                self._fh.write(b"".join(frames))
                self._fh.flush()
                os.fsync(self._fh.fileno())  # one fsync per batch: appends racing in share it
            except BaseException as exc:  # noqa: BLE001 - surfaced to every waiter and the next caller
                with self._cv:
                    self._error = exc
                    self._cv.notify_all()
                for _, fut in batch:
                    fut.set_exception(exc)
                return
            with self._cv:
                self._durable += len(batch)
                self._cv.notify_all()
            for (_, fut), frame in zip(batch, frames):
                fut.set_result(frame)

    def flush(self) -> None:
        """Block until every record appended so far is written and fsynced."""
        with self._cv:
            target = self._queued
            while self._durable < target and not self._error:
                self._cv.wait()
            if self._error:
                raise self._error

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()
            self._fh.close()


def read_journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in iter_lines(path.read_bytes())]
