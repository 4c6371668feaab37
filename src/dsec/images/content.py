"""Content-addressed blob store (sha256), the node-local part of the image subsystem.

Blobs live at ``<root>/sha256/<hex>``. Writes go to ``<root>/ingest`` first and are
renamed into place only after fsync and a digest check, so a blob path that exists is a
complete blob. Because stale caches once ran old code (seed 003 §5.4), a blob found on
disk is re-hashed the first time this process uses it (``verify``); after that the
process trusts its own verification.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from dsec.errors import DigestMismatch, NotFound
from dsec.images.fsutil import CHUNK, HashingWriter, check_digest, file_digest, fsync_dir


class BlobWriter:
    """A blob being written; ``commit()`` hashes, fsyncs and renames it into place."""

    def __init__(self, store: ContentStore) -> None:
        self._store = store
        fd, tmp = tempfile.mkstemp(dir=store.ingest_dir, prefix=f"w{os.getpid()}-")
        self.tmp = Path(tmp)
        self._fh = os.fdopen(fd, "wb")
        self._hw = HashingWriter(self._fh)

    def write(self, data: bytes) -> int:
        return self._hw.write(data)

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
            raise DigestMismatch(
                f"{what}: content hashes to {digest} but {expected} was expected; the archive is "
                "corrupt or was modified — re-export it from the source", expected=expected, actual=digest)
        self._store._place(self.tmp, digest)
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
            raise DigestMismatch(f"{what}: content hashes to {self._hw.digest} but {expected} was expected",
                                 expected=expected, actual=self._hw.digest)
        self._handed_off = True
        return self.tmp

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if not getattr(self, "_handed_off", False):
            self.tmp.unlink(missing_ok=True)


class ContentStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blob_dir = root / "sha256"
        self.ingest_dir = root / "ingest"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.ingest_dir.mkdir(parents=True, exist_ok=True)
        self._verified: set[str] = set()
        self._vlock = threading.Lock()

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
    def writer(self) -> Iterator[BlobWriter]:
        w = BlobWriter(self)
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
