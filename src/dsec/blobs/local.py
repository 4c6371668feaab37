"""Local-directory BlobStore: one file per key, written temp + fsync + rename + dir fsync."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from dsec import errors
from dsec.blobs.base import BlobStat, check_key
from dsec.durable import fsync_dir
from dsec.testing.faults import fault_point

_TMP = ".tmp"


def _makedirs_durable(root: Path, rel_dir: Path) -> None:
    """Create ``root/rel_dir`` and fsync every parent whose entry list changed."""
    cur = root
    for part in rel_dir.parts:
        nxt = cur / part
        if not nxt.is_dir():
            try:
                nxt.mkdir()
            except FileExistsError:
                pass
            fsync_dir(cur)
        cur = nxt


def _storage_error(exc: OSError, root: Path, key: str) -> errors.DSecError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.StorageFull(
            f"blob store {root} is full while writing {key!r}: free space on that disk or "
            "configure another DSEC_CHECKPOINT_ROOTS entry; the previous checkpoint is intact",
            root=str(root), key=key)
    return errors.CheckpointError(f"blob store {root}: writing {key!r} failed: {exc}", root=str(root), key=key)


class LocalBlobStore:
    """Blobs as files under ``root``. Crash-safe: a torn write leaves only a temp file."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.name = f"local:{self.root}"
        (self.root / _TMP).mkdir(parents=True, exist_ok=True)
        self._clean_tmp()

    def _clean_tmp(self) -> None:
        # Temp files only survive a crash mid-put; they were never visible, so drop them.
        for p in (self.root / _TMP).iterdir():
            p.unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        tmp = self.root / _TMP / f"{uuid.uuid4().hex}"
        try:
            _makedirs_durable(self.root, Path(key).parent)
            with open(tmp, "wb") as fh:
                half = len(data) // 2
                fh.write(data[:half])
                fh.flush()
                fault_point("blob.local.mid_write")
                fh.write(data[half:])
                fh.flush()
                os.fsync(fh.fileno())
            fault_point("blob.local.before_rename")
            os.replace(tmp, dest)
            fsync_dir(dest.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _storage_error(exc, self.root, key) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise errors.NotFound(f"blob {key!r} not found in {self.name}", key=key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def stat(self, key: str) -> BlobStat:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise errors.NotFound(f"blob {key!r} not found in {self.name}", key=key) from None
        return BlobStat(size=st.st_size, mtime=st.st_mtime)

    def touch(self, key: str) -> None:
        try:
            os.utime(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            raise errors.NotFound(f"blob {key!r} not found in {self.name}", key=key) from None

    def delete(self, key: str) -> None:
        path = self._path(key)
        # No dir fsync: a delete that a crash undoes resurrects an old, still-valid object
        # (or one whose parts were collected, which readers then ignore) - never a torn one.
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return

    def list(self, prefix: str) -> list[str]:
        # Walk only the directory the prefix names, not the whole store.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base if base else self.root
        if not start.is_dir():
            return []
        out = []
        for dirpath, dirnames, filenames in os.walk(start):
            rel_dir = os.path.relpath(dirpath, self.root)
            if rel_dir == ".":
                dirnames[:] = [d for d in dirnames if d != _TMP]
                rel_dir = ""
            for f in filenames:
                key = f"{rel_dir}/{f}" if rel_dir else f
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)
