"""Small crash-safe file helpers and streaming hashers used by the image subsystem."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import BinaryIO

from dsec.durable import atomic_write, fsync_dir  # noqa: F401 - re-exported for images

CHUNK = 1 << 20
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def syncfs(path: Path) -> None:
    """Flush the whole filesystem holding ``path`` (one call instead of an fsync per file)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(data: bytes) -> str:
    return "sha256:" + sha256_hex(data)


def file_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


class HashingReader:
    """Wraps a binary stream; hashes and counts every byte read through it."""

    def __init__(self, raw: BinaryIO, progress: callable | None = None) -> None:  # type: ignore[valid-type]
        self._raw = raw
        self._h = hashlib.sha256()
        self.count = 0
        self._progress = progress

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        if data:
            self._h.update(data)
            self.count += len(data)
            if self._progress is not None:
                self._progress(len(data))
        return data

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self._h.hexdigest()


class HashingWriter:
    """Wraps a binary sink; hashes and counts every byte written through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._h = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes) -> int:
        self._h.update(data)
        self.count += len(data)
        self._raw.write(data)
        return len(data)

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    @property
    def digest(self) -> str:
        return "sha256:" + self._h.hexdigest()


def check_digest(value: str, what: str) -> str:
    """Validate a 'sha256:<64 hex>' digest string (never trust one in a path unchecked)."""
    from dsec.errors import ImageError

    if _DIGEST_RE.fullmatch(value) is None:
        raise ImageError(f"{what}: invalid digest {value!r} (expected sha256:<64 lowercase hex>)")
    return value
