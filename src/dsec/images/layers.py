"""Unpacked-layer cache: one overlayfs lower dir per layer diff_id, sealed and verified.

Layout: ``<root>/<diff_id hex>/{fs/, manifest.json, seal.json}``. A layer is unpacked
into ``<root>/.tmp-*``, (optionally synced, see docs), ``manifest.json`` (every entry: kind,
mode, size, crc32 or blob offset) and then ``seal.json`` (diff_id + sha256 of the manifest) are
written LAST, and only then is the directory renamed into place. So a layer dir that
exists and whose seal names its own diff_id was completely unpacked by this code.

Verification policy (cheap enough for the < 2 ms overlay prepare):
- first use per process: read the seal, check it names this diff_id and that the
  manifest still hashes to the sealed value, then ``lstat``-walk the tree and compare
  every entry's kind/mode/size with the manifest (catches truncation, deletion,
  replaced files, stale trees from older code: a different format version is refused);
- every later use in the same process: one ``stat`` of the seal (the layer still exists);
- ``verify(deep=True)`` (``dsec image verify --deep``): compare every file's content with its manifest ref (crc32, or the source blob's bytes).
A failed check deletes the layer dir; the next ensure re-unpacks it from its verified blob.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from dsec.errors import ImageError
from dsec.images.fsutil import atomic_write, check_digest, fsync_dir, syncfs
from dsec.images.locks import KeyedLock
from dsec.images.unpack import UnpackResult, unpack_stream, unpack_tar_file

SEAL_FORMAT = 2  # 2: per-file refs are crc32 or blob offsets (1 had sha256)
_KINDS = {"f": stat.S_ISREG, "d": stat.S_ISDIR, "l": stat.S_ISLNK, "c": stat.S_ISCHR, "p": stat.S_ISFIFO}

# Opens a layer's blob: returns (stream, compression, expected blob digest or None,
# verified) where verified=True means the blob's digest was already checked (then an
# uncompressed regular file is unpacked with kernel-side copies).
BlobOpener = Callable[[], tuple[BinaryIO, str, str | None, bool]]


class LayerCache:
    def __init__(self, root: Path, locks: KeyedLock, sync: bool = False) -> None:
        self.root = root
        self.sync = sync
        self.root.mkdir(parents=True, exist_ok=True)
        self._locks = locks
        self._trusted: set[str] = set()
        self._tlock = threading.Lock()
        self._dirs: dict[str, Path] = {}

    def dir(self, diff_id: str) -> Path:
        d = self._dirs.get(diff_id)
        if d is None:
            d = self._dirs[diff_id] = self.root / check_digest(diff_id, "layer").split(":", 1)[1]
        return d

    def fs(self, diff_id: str) -> Path:
        return self.dir(diff_id) / "fs"

    def present(self, diff_id: str) -> bool:
        return (self.dir(diff_id) / "seal.json").exists()

    def is_trusted(self, diff_id: str) -> bool:
        """Hot path: trusted this process and still on disk (one stat)."""
        return diff_id in self._trusted and os.path.exists(self.dir(diff_id) / "seal.json")

    def mark_trusted(self, diff_id: str) -> None:
        """Another process of ours unpacked and sealed it moments ago (import workers)."""
        if self.present(diff_id):
            with self._tlock:
                self._trusted.add(diff_id)

    def seal(self, diff_id: str) -> dict[str, object] | None:
        try:
            return json.loads((self.dir(diff_id) / "seal.json").read_text())
        except (OSError, ValueError):
            return None

    def unpacked_size(self, diff_id: str) -> int:
        s = self.seal(diff_id)
        return int(s.get("unpacked_size", 0)) if s else 0  # type: ignore[arg-type]

    def verify(self, diff_id: str, deep: bool = False,
               blob_path: Callable[[str], Path] | None = None) -> str | None:
        """Return None if the layer dir is intact, else the reason it is not. ``blob_path``
        maps a blob digest to its file (deep check of files copied from that blob)."""
        d = self.dir(diff_id)
        seal = self.seal(diff_id)
        if seal is None:
            return "no readable seal.json (unpack never finished)"
        if seal.get("format") != SEAL_FORMAT or seal.get("diff_id") != diff_id:
            return f"seal names {seal.get('diff_id')} format {seal.get('format')}, expected {diff_id} format {SEAL_FORMAT}"
        try:
            raw = (d / "manifest.json").read_bytes()
        except OSError:
            return "manifest.json missing"
        if hashlib.sha256(raw).hexdigest() != seal.get("manifest_sha256"):
            return "manifest.json does not match its seal"
        fs = d / "fs"
        blob = blob_path(str(seal["digest"])) if deep and blob_path is not None else None
        if blob is not None and not blob.exists():
            blob = None  # source blob collected since: sizes/modes only for its files
        expected = {str(r[0]): r for r in json.loads(raw)}
        seen = 0
        for dirpath, dirnames, filenames in os.walk(fs):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, fs)
                rec = expected.get(rel)
                if rec is None:
                    return f"unexpected entry {rel!r}"
                st = os.lstat(full)
                kind = str(rec[1])
                if not _KINDS[kind](st.st_mode):
                    return f"{rel!r} changed type"
                if kind in ("f", "d", "p") and (st.st_mode & 0o7777) != rec[2]:
                    return f"{rel!r} changed mode"
                if kind == "f" and st.st_size != rec[3]:
                    return f"{rel!r} changed size ({st.st_size} != {rec[3]})"
                if deep and kind == "f" and not _content_ok(full, str(rec[4]), blob):
                    return f"{rel!r} content changed"
                seen += 1
        if seen != len(expected):
            return f"{len(expected) - seen} entries missing"
        return None

    def ensure(self, diff_id: str, opener: BlobOpener, what: str,
               progress: Callable[[int], None] | None = None) -> tuple[Path, bool]:
        """Make the layer's lower dir present and verified. Returns (fs dir, was_hit)."""
        if self.is_trusted(diff_id):
            return self.fs(diff_id), True
        with self._locks.hold("layer-" + diff_id):
            if self.present(diff_id):
                reason = self.verify(diff_id)
                if reason is None:
                    with self._tlock:
                        self._trusted.add(diff_id)
                    return self.fs(diff_id), True
                self.remove(diff_id)  # stale or damaged: never trust it, unpack afresh
            self._unpack(diff_id, opener, what, progress)
            with self._tlock:
                self._trusted.add(diff_id)
            return self.fs(diff_id), False

    def _unpack(self, diff_id: str, opener: BlobOpener, what: str,
                progress: Callable[[int], None] | None) -> UnpackResult:
        tmp = self.root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        (tmp / "fs").mkdir(parents=True)
        try:
            stream, compression, expected_digest, verified = opener()
            with stream:
                if compression == "tar" and verified and expected_digest == diff_id and _regular(stream):
                    res = unpack_tar_file(stream, tmp / "fs", what, diff_id)
                    if progress is not None:
                        progress(res.size)
                else:
                    res = unpack_stream(stream, compression, tmp / "fs", what, expected_digest, diff_id, progress)
            if self.sync:
                syncfs(tmp)
            raw = json.dumps(res.manifest, separators=(",", ":")).encode()
            atomic_write(tmp / "manifest.json", raw)
            seal = {"format": SEAL_FORMAT, "diff_id": diff_id, "digest": res.digest,
                    "manifest_sha256": hashlib.sha256(raw).hexdigest(), "entries": len(res.manifest),
                    "unpacked_size": res.unpacked_size}
            atomic_write(tmp / "seal.json", json.dumps(seal).encode())
            os.rename(tmp, self.dir(diff_id))
            fsync_dir(self.root)
            return res
        except BaseException:
            _rmtree(tmp)
            raise

    def remove(self, diff_id: str, still_free: Callable[[], bool] | None = None) -> int:
        """Delete an unpacked layer. ``still_free`` is asked AFTER the dir vanished: if a
        lease appeared meanwhile (a prepare's lock-free fast path), the dir is put back
        and -1 is returned; else the unpacked bytes freed."""
        d = self.dir(diff_id)
        if not d.exists():
            return 0
        size = self.unpacked_size(diff_id)
        trash = self.root / f".trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(d, trash)  # atomic disappearance; the slow delete happens after
        if still_free is not None and not still_free():
            os.rename(trash, d)
            return -1
        with self._tlock:
            self._trusted.discard(diff_id)
        _rmtree(trash)
        return size

    def all_diff_ids(self) -> list[str]:
        return ["sha256:" + p.name for p in self.root.iterdir() if len(p.name) == 64]

    def clean_temp(self) -> int:
        """Remove temp/trash dirs left by dead processes (pid in the name)."""
        n = 0
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-", ".trash-")):
                pid = int(p.name.split("-")[1]) if p.name.split("-")[1].isdigit() else 0
                if pid != os.getpid() and not _alive(pid):
                    _rmtree(p)
                    n += 1
        return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _regular(stream: object) -> bool:
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False


def _content_ok(path: str, ref: str, blob: Path | None) -> bool:
    """Deep check of one file against its manifest ref (crc32 of content, or the byte
    range of the verified uncompressed blob it was copied from)."""
    kind, _, val = ref.partition(":")
    with open(path, "rb") as fh:
        if kind == "crc32":
            crc = 0
            while chunk := fh.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
            return f"{crc:08x}" == val
        if kind == "off" and blob is not None:
            with open(blob, "rb") as b:
                b.seek(int(val))
                while chunk := fh.read(1 << 20):
                    if b.read(len(chunk)) != chunk:
                        return False
            return True
    return kind == "off"  # no blob to compare with: size/mode checks only


def _rmtree(path: Path) -> None:
    def onerror(func, p, exc):  # type: ignore[no-untyped-def]
        # Read-only dirs from a layer (mode 0555) block deletion of their children.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    if path.exists():
        shutil.rmtree(path, onerror=onerror)
        if path.exists():
            raise ImageError(f"could not remove {path}")
