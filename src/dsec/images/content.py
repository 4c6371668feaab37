"""Content-addressed blob store (sha256), the node-local part of the image subsystem.

Blobs live at ``<root>/sha256/<hex>``. Writes go to ``<root>/ingest`` first and are
renamed into place only after fsync and a digest check, so a blob path that exists is a
complete blob. Because stale caches once ran old code (seed 003 §5.4), a blob found on
disk is re-hashed the first time this process uses it (``verify``); after that the
process trusts its own verification.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Literal

from dsec.errors import DigestMismatch, NotFound
from dsec.images.fsutil import CHUNK, HashingWriter, check_digest, file_digest, fsync_dir

log = logging.getLogger("dsec.images")


class Inflight:
    """A blob this node is receiving now (its bytes NOT verified yet): what the peer blob
    endpoint may serve cut-through, following ``written`` as bytes arrive. It vouches for
    nothing: every receiver hashes what it got and commits only on a digest match; a
    receive that fails here (``state`` ``failed``) ends the streams that follow it short,
    so their receivers fall back to another source."""

    def __init__(self, digest: str, size: int, path: Path) -> None:
        self.digest, self.size, self.path = digest, size, path
        self.written = 0
        self.state: Literal["receiving", "done", "failed"] = "receiving"
        self._cond = threading.Condition()

    def advance(self, n: int) -> None:
        with self._cond:
            self.written += n
            self._cond.notify_all()

    def end(self, ok: bool) -> None:
        with self._cond:
            if self.state == "receiving":
                self.state = "done" if ok else "failed"
            self._cond.notify_all()

    def wait(self, offset: int, timeout: float, batch: int = 1, batch_wait_s: float = 0.01) -> tuple[int, str]:
        """Block until more than ``offset`` bytes are written or the receive ended (or
        ``timeout``); then, for up to ``batch_wait_s``, until ``batch`` bytes past
        ``offset`` are there (fewer, larger reads). Returns (bytes written, state)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.written > offset or self.state != "receiving", timeout):
                return self.written, self.state
            self._cond.wait_for(lambda: self.written - offset >= batch or self.state != "receiving", batch_wait_s)
            return self.written, self.state


class BlobWriter:
    """A blob being written; ``commit()`` hashes, fsyncs and renames it into place.
    With ``expect`` (digest, size), on a node that serves partial blobs to peers (the store
    has ``on_receiving``), the partial file is published as ``Inflight`` while it is
    written (cut-through); elsewhere no one could read it, so a pull pays no flush per
    chunk. Nothing about the commit changes."""

    def __init__(self, store: ContentStore, expect: tuple[str, int] | None = None) -> None:
        self._store = store
        fd, tmp = tempfile.mkstemp(dir=store.ingest_dir, prefix=f"w{os.getpid()}-")
        self.tmp = Path(tmp)
        self._fh = os.fdopen(fd, "wb")
        self._hw = HashingWriter(self._fh)
        self.inflight: Inflight | None = None
        if expect is not None and store.on_receiving is not None:
            self.inflight = store._receiving(Inflight(expect[0], expect[1], self.tmp))

    def write(self, data: bytes) -> int:
        n = self._hw.write(data)
        if self.inflight is not None:
            self._fh.flush()  # readers of the partial file use their own fd: bytes must reach the kernel first
            self.inflight.advance(n)
        return n

    def _end(self, ok: bool) -> None:
        if self.inflight is not None:
            self._store._received(self.inflight, ok)
            self.inflight = None

    def flush(self) -> None:
        self._fh.flush()

    def writable(self) -> bool:
        return True

    @property
    def digest(self) -> str:
        return self._hw.digest

    @property
    def size(self) -> int:
        return self._hw.count

    def commit(self, expected: str | None = None, what: str = "blob") -> tuple[str, int]:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        digest = self._hw.digest
        if expected is not None and digest != expected:
            self.tmp.unlink(missing_ok=True)
            self._end(False)
            raise DigestMismatch(
                f"{what}: content hashes to {digest} but {expected} was expected; the archive is "
                "corrupt or was modified — re-export it from the source", expected=expected, actual=digest)
        self._store._place(self.tmp, digest)
        self._end(True)  # after the rename: a reader that opens the path now finds the blob in the store
        return digest, self._hw.count

    def verified_unsynced(self, expected: str, what: str = "blob") -> Path:
        """Check the digest and close WITHOUT fsync or rename: the verified bytes stay in
        ``ingest/`` and the caller owns the file. It must make them durable and then
        ``ContentStore.place_durable`` them (one syncfs for a whole pull instead of one
        fsync per blob); nothing reaches ``blobs/sha256/`` before its bytes are on disk."""
        self._fh.flush()
        self._fh.close()
        if self._hw.digest != expected:
            self.tmp.unlink(missing_ok=True)
            self._end(False)
            raise DigestMismatch(f"{what}: content hashes to {self._hw.digest} but {expected} was expected",
                                 expected=expected, actual=self._hw.digest)
        self._handed_off = True
        self._end(True)
        return self.tmp

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if not getattr(self, "_handed_off", False):
            self.tmp.unlink(missing_ok=True)
        self._end(False)  # no-op after a commit


class ContentStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blob_dir = root / "sha256"
        self.ingest_dir = root / "ingest"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.ingest_dir.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        self._vlock = threading.Lock()
        # Blobs being received now (digest -> Inflight), for cut-through serving; and the
        # hook a cluster node sets to tell peers (``on_receiving(digest, True/False)``).
        self.inflight: dict[str, Inflight] = {}
        self.on_receiving: Callable[[str, bool], None] | None = None

    def _receiving(self, inf: Inflight) -> Inflight:
        with self._vlock:
            self.inflight.setdefault(inf.digest, inf)  # one writer per digest (the blob lock); keep the first
        if self.on_receiving is not None and self.inflight.get(inf.digest) is inf:
            try:
                self.on_receiving(inf.digest, True)
            except Exception:
                log.debug("announcing a blob being received failed", exc_info=True)
        return inf

    def _received(self, inf: Inflight, ok: bool) -> None:
        mine = False
        with self._vlock:
            if self.inflight.get(inf.digest) is inf:
                del self.inflight[inf.digest]
                mine = True
        inf.end(ok)
        if mine and self.on_receiving is not None:
            try:
                self.on_receiving(inf.digest, False)
            except Exception:
                log.debug("retracting a blob being received failed", exc_info=True)

    def path(self, digest: str) -> Path:
        check_digest(digest, "blob")
        return self.blob_dir / digest.split(":", 1)[1]

    def has(self, digest: str) -> bool:
        return self.path(digest).exists()

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    def _place(self, tmp: Path, digest: str) -> None:
        final = self.path(digest)
        os.chmod(tmp, 0o444)
        os.replace(tmp, final)  # same content either way: a racing writer is harmless
        fsync_dir(self.blob_dir)
        with self._vlock:
            self._verified.add(digest)

    def place_durable(self, items: list[tuple[Path, str]]) -> None:
        """Rename verified ingest files (``BlobWriter.verified_unsynced``) into the store
        once their bytes are durable, then fsync the blob dir once: the crash-safety rule
        of ``commit`` (durable before named) in one pass at the end of a pull. Each file
        is fsynced here rather than per blob while the pull runs (by now the kernel has
        written most of it back); not a syncfs, which on a shared disk would also flush
        every other process's dirty data."""
        if not items:
            return
        for tmp, _ in items:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for tmp, digest in items:
            final = self.path(digest)
            os.chmod(tmp, 0o444)
            os.replace(tmp, final)
        fsync_dir(self.blob_dir)
        with self._vlock:
            self._verified.update(d for _, d in items)

    @contextmanager
    def writer(self, expect: tuple[str, int] | None = None) -> Iterator[BlobWriter]:
        """A ``BlobWriter``; ``expect=(digest, size)``: the blob's partial file may be served
        to peers while it is written (``Inflight``)."""
        w = BlobWriter(self, expect)
        try:
            yield w
        finally:
            w.abort()  # no-op after commit (tmp already renamed)

    def ingest(self, stream: BinaryIO, expected: str | None = None, what: str = "blob",
               progress: callable | None = None) -> tuple[str, int]:  # type: ignore[valid-type]
        """Copy ``stream`` into the store, verifying ``expected`` if given."""
        if expected is not None and self.has(expected):
            self.verify(expected, what)
            return expected, self.size(expected)
        with self.writer() as w:
            while chunk := stream.read(CHUNK):
                w.write(chunk)
                if progress is not None:
                    progress(len(chunk))
            return w.commit(expected, what)

    def put_bytes(self, data: bytes, expected: str | None = None, what: str = "blob") -> str:
        with self.writer() as w:
            w.write(data)
            return w.commit(expected, what)[0]

    def verify(self, digest: str, what: str = "blob") -> None:
        """Re-hash a stored blob once per process; a mismatching blob is deleted."""
        if digest in self._verified:
            return
        p = self.path(digest)
        if not p.exists():
            raise NotFound(f"{what} {digest} is not in the content store at {self.blob_dir}; "
                           "re-import the image that needs it")
        actual, _ = file_digest(p)
        if actual != digest:
            p.unlink(missing_ok=True)
            raise DigestMismatch(f"{what} {digest} on disk hashes to {actual}: the cached blob was "
                                 "corrupt and has been removed; re-import the image",
                                 expected=digest, actual=actual)
        with self._vlock:
            self._verified.add(digest)

    def read_bytes(self, digest: str, what: str = "blob") -> bytes:
        self.verify(digest, what)
        return self.path(digest).read_bytes()

    def open(self, digest: str, what: str = "blob") -> BinaryIO:
        self.verify(digest, what)
        return open(self.path(digest), "rb")

    def delete(self, digest: str) -> int:
        p = self.path(digest)
        try:
            size = p.stat().st_size
            p.unlink()
        except FileNotFoundError:
            return 0
        with self._vlock:
            self._verified.discard(digest)
        return size

    def all_digests(self) -> list[str]:
        return ["sha256:" + p.name for p in self.blob_dir.iterdir() if len(p.name) == 64]
