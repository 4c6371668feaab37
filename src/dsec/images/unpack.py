"""Safe OCI layer unpacking into an overlayfs lower directory.

Safety model (a malicious layer never writes outside ``dest``):
- entry names are normalised lexically; absolute names and any ``..`` component are
  rejected with ``UnsafeLayer``;
- the tree starts empty and every path this layer created is tracked in memory, so a
  parent that is not a real directory *created by this layer* (e.g. a symlink planted by
  an earlier entry) is refused instead of followed; files are created with
  ``O_NOFOLLOW|O_EXCL`` as a second line of defence;
- hard links must point at an earlier non-directory entry of the same layer; relative
  symlink targets may not climb above the layer root (absolute targets are fine: the
  kernel resolves them inside the sandbox root, and we never follow them on the host);
- device nodes are refused except char 0/0 (already overlay whiteout form);
- setuid/setgid bits are stripped (sandboxes run with no_new_privs anyway; stripping
  means a layer can never ship a privilege-raising binary to the host side either);
- xattrs from the tar (e.g. security.capability) are not applied, for the same reason.
OCI whiteouts become overlayfs whiteouts: ``.wh.NAME`` -> char device 0/0 ``NAME``,
``.wh..wh..opq`` -> ``trusted.overlay.opaque=y`` on the directory.
"""

from __future__ import annotations

import gzip
import io
import os
import posixpath
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import zstandard

from dsec.errors import DigestMismatch, ImageError, UnsafeLayer
from dsec.images.fsutil import CHUNK, HashingReader
from dsec.images.media import decompressing_reader

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once at import (before threads start): umask has no getter

WH_PREFIX = ".wh."
WH_OPAQUE = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclass
class UnpackResult:
    digest: str          # sha256 of the (compressed) stream as read
    diff_id: str         # sha256 of the uncompressed tar
    size: int            # compressed bytes read
    unpacked_size: int   # bytes of regular file content written
    manifest: list[list[object]] = field(default_factory=list)  # [path, kind, mode, size, sha256|target]


def safe_name(name: str, what: str) -> str:
    """Normalise a tar entry name; refuse absolute paths and parent references."""
    if "\x00" in name:
        raise UnsafeLayer(f"{what}: entry {name!r} contains a NUL byte")
    if name.startswith("/"):
        raise UnsafeLayer(f"{what}: entry {name!r} has an absolute path; layers must use relative paths")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayer(f"{what}: entry {name!r} contains '..' (path traversal); refusing the layer")
    return "/".join(parts)


def _symlink_ok(rel: str, target: str) -> bool:
    if target.startswith("/"):
        return True
    depth = 0
    for part in posixpath.join(posixpath.dirname(rel), target).split("/"):
        if part in ("", "."):
            continue
        depth += -1 if part == ".." else 1
        if depth < 0:
            return False
    return True


class _Unpacker:
    def __init__(self, dest: Path, what: str) -> None:
        self.dest = dest
        self.what = what
        self.kinds: dict[str, str] = {"": "d"}
        self.dirs: dict[str, tarfile.TarInfo | None] = {}
        self.opaque: set[str] = set()
        self.files: dict[str, list[object]] = {}
        self.root = os.geteuid() == 0
        self.src_fd: int | None = None
        self.ids = (os.geteuid(), os.getegid())
        self.unpacked = 0

    def _full(self, rel: str) -> str:
        return os.path.join(self.dest, rel)

    def _parent(self, rel: str) -> None:
        """Ensure every parent of ``rel`` is a real directory this layer created."""
        parts = rel.split("/")[:-1]
        cur = ""
        for part in parts:
            cur = f"{cur}/{part}" if cur else part
            kind = self.kinds.get(cur)
            if kind is None:
                os.mkdir(self._full(cur), 0o755)
                self.kinds[cur] = "d"
                self.dirs.setdefault(cur, None)
            elif kind != "d":
                raise UnsafeLayer(f"{self.what}: entry {rel!r} would be written through {cur!r}, which "
                                  f"is not a directory (a symlink or file); refusing the layer")

    def _clear(self, rel: str) -> None:
        kind = self.kinds.pop(rel, None)
        if kind is None:
            return
        full = self._full(rel)
        if kind == "d":
            shutil.rmtree(full)
            prefix = rel + "/"
            for k in [k for k in self.kinds if k.startswith(prefix)]:
                del self.kinds[k]
            for k in [k for k in self.dirs if k == rel or k.startswith(prefix)]:
                del self.dirs[k]
            self.opaque = {o for o in self.opaque if o != rel and not o.startswith(prefix)}
            for k in [k for k in self.files if k.startswith(prefix)]:
                del self.files[k]
        else:
            os.unlink(full)
        self.files.pop(rel, None)

    def _meta(self, full: str, ti: tarfile.TarInfo, fd: int | None = None, created_mode: int = -1) -> None:
        mode = ti.mode & 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
        # Skip syscalls that would change nothing (most entries are root-owned 0644/0755).
        if self.root and (ti.uid, ti.gid) != self.ids:
            if fd is not None:
                os.fchown(fd, ti.uid, ti.gid)
            else:
                os.lchown(full, ti.uid, ti.gid)
        if fd is not None:
            if created_mode != mode:
                os.fchmod(fd, mode)
            os.utime(fd, (ti.mtime, ti.mtime))
        else:
            os.utime(full, (ti.mtime, ti.mtime), follow_symlinks=False)

    def whiteout(self, rel: str, base: str) -> None:
        parent = posixpath.dirname(rel)
        if base == WH_OPAQUE:
            if parent:
                self._parent(rel)
            self.opaque.add(parent)
            return
        name = base[len(WH_PREFIX):]
        if name in ("", ".", "..") or name.startswith(WH_PREFIX):
            raise UnsafeLayer(f"{self.what}: malformed whiteout {rel!r}")
        target = f"{parent}/{name}" if parent else name
        self._mknod_whiteout(target)

    def _mknod_whiteout(self, target: str) -> None:
        self._parent(target)
        self._clear(target)
        os.mknod(self._full(target), stat.S_IFCHR | 0o000, os.makedev(0, 0))
        self.kinds[target] = "c"
        self.files[target] = [target, "c", 0, 0, ""]

    def entry(self, ti: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
        rel = safe_name(ti.name, self.what)
        if not rel:
            return  # the layer root itself: its metadata is not part of the overlay view
        base = posixpath.basename(rel)
        if base.startswith(WH_PREFIX):
            self.whiteout(rel, base)
            return
        self._parent(rel)
        full = self._full(rel)
        mode = ti.mode & 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
        if ti.isdir():
            if self.kinds.get(rel) != "d":
                self._clear(rel)
                os.mkdir(full, 0o700)
                self.kinds[rel] = "d"
            self.dirs[rel] = ti
            return
        self._clear(rel)
        if ti.isreg():
            # Create with the final mode when the umask lets it through (saves an fchmod).
            create = mode if mode & 0o7000 == 0 and mode & _UMASK == 0 else 0o600
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, create)
            try:
                if self.src_fd is not None:
                    # Seekable, already-verified uncompressed blob: the kernel copies the
                    # bytes (no Python per byte); deep verify compares against this range.
                    ref = f"off:{ti.offset_data}"
                    off, left = ti.offset_data, ti.size
                    while left:
                        n = os.copy_file_range(self.src_fd, fd, left, off)
                        if n <= 0:
                            raise ImageError(f"{self.what}: entry {rel!r} is truncated (tar ends early)")
                        off += n
                        left -= n
                else:
                    crc = 0
                    src = tf.extractfile(ti)
                    assert src is not None
                    while chunk := src.read(CHUNK):
                        crc = zlib.crc32(chunk, crc)
                        _write_all(fd, chunk)
                    ref = f"crc32:{crc:08x}"
                self._meta(full, ti, fd, create)
            finally:
                os.close(fd)
            self.kinds[rel] = "f"
            self.unpacked += ti.size
            self.files[rel] = [rel, "f", mode, ti.size, ref]
        elif ti.issym():
            if not _symlink_ok(rel, ti.linkname):
                raise UnsafeLayer(f"{self.what}: symlink {rel!r} -> {ti.linkname!r} points outside the "
                                  "layer root; refusing the layer")
            os.symlink(ti.linkname, full)
            self._meta(full, ti)
            self.kinds[rel] = "l"
            self.files[rel] = [rel, "l", 0, 0, ti.linkname]
        elif ti.islnk():
            target = safe_name(ti.linkname, self.what)
            if self.kinds.get(target) not in ("f", "l", "p"):
                raise UnsafeLayer(f"{self.what}: hard link {rel!r} -> {ti.linkname!r} does not point at an "
                                  "earlier file of the same layer; refusing the layer")
            os.link(self._full(target), full, follow_symlinks=False)
            self.kinds[rel] = self.kinds[target]
            rec = list(self.files[target])
            rec[0] = rel
            self.files[rel] = rec
        elif ti.ischr() and ti.devmajor == 0 and ti.devminor == 0:
            self._mknod_whiteout(rel)
        elif ti.isfifo():
            os.mkfifo(full, 0o600)
            self._meta(full, ti)
            os.chmod(full, mode)
            self.kinds[rel] = "p"
            self.files[rel] = [rel, "p", mode, 0, ""]
        elif ti.ischr() or ti.isblk():
            raise UnsafeLayer(f"{self.what}: device node {rel!r} ({ti.devmajor}:{ti.devminor}) is not allowed "
                              "in a layer; only overlay whiteouts (char 0:0) are")
        else:
            raise UnsafeLayer(f"{self.what}: entry {rel!r} has unsupported tar type {ti.type!r}")

    def finish(self) -> list[list[object]]:
        for rel in self.opaque:
            os.setxattr(self._full(rel) if rel else str(self.dest), OPAQUE_XATTR, b"y")
        records = list(self.files.values())
        # Deepest first: setting a parent's mtime before its children would be undone.
        for rel in sorted(self.dirs, key=lambda r: r.count("/"), reverse=True):
            ti = self.dirs[rel]
            full = self._full(rel)
            if ti is None:
                records.append([rel, "d", 0o755, 0, ""])
                continue
            mode = ti.mode & 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
            if self.root:
                os.lchown(full, ti.uid, ti.gid)
            os.chmod(full, mode)
            os.utime(full, (ti.mtime, ti.mtime))
            records.append([rel, "d", mode, 0, ""])
        records.sort(key=lambda r: str(r[0]))
        return records


def unpack_tar_file(fh: BinaryIO, dest: Path, what: str, digest: str) -> UnpackResult:
    """Unpack an uncompressed layer from a seekable file whose sha256 (``digest``, which is
    also its diff_id) the caller has ALREADY verified: headers are parsed in Python, file
    data is copied by the kernel (copy_file_range). Same safety rules as unpack_stream."""
    u = _Unpacker(dest, what)
    u.src_fd = fh.fileno()
    size = os.fstat(u.src_fd).st_size
    try:
        with tarfile.open(fileobj=fh, mode="r:", errorlevel=2) as tf:  # type: ignore[call-overload]
            for ti in tf:
                if ti.offset_data + (ti.size if ti.isreg() else 0) > size:
                    raise ImageError(f"{what}: entry {ti.name!r} runs past the end of the layer (truncated)")
                u.entry(ti, tf)
    except (tarfile.TarError, EOFError) as exc:
        raise ImageError(f"{what}: corrupt or truncated layer ({type(exc).__name__}: {exc}); "
                         "re-export the image", reason=str(exc)) from exc
    return UnpackResult(digest, digest, size, u.unpacked, u.finish())


class _Raw(io.RawIOBase):
    def __init__(self, src: HashingReader) -> None:
        self._src = src

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        data = self._src.read(len(b))
        n = len(data)
        b[:n] = data
        return n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def unpack_stream(raw: BinaryIO, compression: str, dest: Path, what: str,
                  expected_digest: str | None = None, expected_diff_id: str | None = None,
                  progress: callable | None = None) -> UnpackResult:  # type: ignore[valid-type]
    """Unpack one layer stream into the empty directory ``dest``; verify both digests."""
    outer = HashingReader(raw, progress)
    try:
        # Uncompressed: blob digest == diff_id, so hash the bytes once, not twice.
        inner = outer if compression == "tar" else HashingReader(decompressing_reader(outer, compression))  # type: ignore[arg-type]
        u = _Unpacker(dest, what)
        # tarfile's stream mode reads 10 KiB at a time; a C-level 1 MiB buffer in between
        # keeps hashing/decompression/tee work in big chunks (much less Python per byte).
        buffered = io.BufferedReader(_Raw(inner), buffer_size=1 << 20)  # type: ignore[arg-type]
        with tarfile.open(fileobj=buffered, mode="r|", errorlevel=2) as tf:  # type: ignore[call-overload]
            for ti in tf:
                u.entry(ti, tf)
        inner.drain()
        if inner is not outer:
            outer.drain()
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zstandard.ZstdError, zlib.error) as exc:
        raise ImageError(f"{what}: corrupt or truncated layer ({type(exc).__name__}: {exc}); "
                         "re-export the image", reason=str(exc)) from exc
    if expected_digest is not None and outer.digest != expected_digest:
        raise DigestMismatch(f"{what}: blob hashes to {outer.digest}, manifest says {expected_digest}",
                             expected=expected_digest, actual=outer.digest)
    if expected_diff_id is not None and inner.digest != expected_diff_id:
        raise DigestMismatch(f"{what}: uncompressed content hashes to {inner.digest}, image config says "
                             f"diff_id {expected_diff_id}", expected=expected_diff_id, actual=inner.digest)
    return UnpackResult(outer.digest, inner.digest, outer.count, u.unpacked, u.finish())
