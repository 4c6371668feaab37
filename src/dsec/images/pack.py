"""Deterministic layer packing: a directory tree -> an OCI layer tar (+ compression).

Same files in, same digest out: entries are sorted by name, mtimes are normalised to a
constant (``mtime``), user/group *names* are dropped, owners are kept numerically (or
forced to 0:0 for host files copied into an image), and compressors write no timestamp.
When packing an overlayfs upper dir (``overlay_upper=True``) overlay whiteouts (char
0/0) become OCI ``.wh.NAME`` files and ``trusted.overlay.opaque=y`` directories get a
``.wh..wh..opq`` marker. Other device nodes and sockets are skipped: a layer never
carries them (see unpack.py), and /dev is provided by the runtime.

Trade-off of normalised mtimes: Python ``.pyc`` files compiled against real source
mtimes look stale and get recompiled on first import (into the sandbox's upper dir).
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dsec.images.fsutil import HashingWriter
from dsec.images.media import COMPRESSION_MT, compressing_writer
from dsec.images.unpack import OPAQUE_XATTR, WH_OPAQUE, WH_PREFIX


@dataclass
class PackResult:
    digest: str
    diff_id: str
    size: int
    media_type: str


def _walk(root: Path, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
    base = os.path.join(root, rel) if rel else str(root)
    names = sorted(os.listdir(base), key=os.fsencode)
    for name in names:
        r = f"{rel}/{name}" if rel else name
        st = os.lstat(os.path.join(root, r))
        yield r, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(root, r)


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def write_tar(root: Path, sink: BinaryIO, *, overlay_upper: bool = False, owner: tuple[int, int] | None = None,
              mtime: int = 0, prefix: str = "", include: Callable[[str], bool] | None = None) -> None:
    """Write ``root``'s tree as a deterministic tar to ``sink``.

    ``prefix`` places the tree under a path (used by COPY steps); ``include`` filters
    entries by relative path (parents of included entries are always written).
    """
    seen_inodes: dict[tuple[int, int], str] = {}
    written_dirs: set[str] = set()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tf:  # type: ignore[call-overload]

        def mk(name: str, st: os.stat_result | None, kind: bytes, mode: int) -> tarfile.TarInfo:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.mode = mode
            ti.mtime = mtime
            ti.uid, ti.gid = owner if owner is not None else ((st.st_uid, st.st_gid) if st else (0, 0))
            ti.uname = ti.gname = ""
            return ti

        pre = prefix.strip("/")

        def ensure_parents(name: str) -> None:
            parts = name.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d in written_dirs:
                    continue
                written_dirs.add(d)
                st = None
                if not pre:
                    st = os.lstat(os.path.join(root, d))
                elif len(d) > len(pre):  # inside the copied tree, not one of the prefix dirs
                    st = os.lstat(os.path.join(root, d[len(pre) + 1:]))
                tf.addfile(mk(d, st, tarfile.DIRTYPE, (st.st_mode & 0o7777) if st else 0o755))

        prefix = pre + "/" if pre else ""
        for rel, st in _walk(root):
            if include is not None and not include(rel):
                continue
            name = prefix + rel
            full = os.path.join(root, rel)
            mode = st.st_mode & 0o7777
            ensure_parents(name)
            if stat.S_ISDIR(st.st_mode):
                if name not in written_dirs:
                    written_dirs.add(name)
                    tf.addfile(mk(name, st, tarfile.DIRTYPE, mode))
                if overlay_upper and _is_opaque(full):
                    tf.addfile(mk(f"{name}/{WH_OPAQUE}", None, tarfile.REGTYPE, 0))
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen_inodes:
                    ti = mk(name, st, tarfile.LNKTYPE, mode)
                    ti.linkname = seen_inodes[key]
                    tf.addfile(ti)
                    continue
                seen_inodes[key] = name
                ti = mk(name, st, tarfile.REGTYPE, mode)
                ti.size = st.st_size
                with open(full, "rb") as fh:
                    tf.addfile(ti, fh)
            elif stat.S_ISLNK(st.st_mode):
                ti = mk(name, st, tarfile.SYMTYPE, 0o777)
                ti.linkname = os.readlink(full)
                tf.addfile(ti)
            elif stat.S_ISCHR(st.st_mode) and overlay_upper and st.st_rdev == 0:
                d, _, base = name.rpartition("/")
                tf.addfile(mk(f"{d}/{WH_PREFIX}{base}" if d else f"{WH_PREFIX}{base}", None, tarfile.REGTYPE, 0))
            elif stat.S_ISFIFO(st.st_mode):
                tf.addfile(mk(name, st, tarfile.FIFOTYPE, mode))
            # other device nodes and sockets: never part of a layer (see module doc)


def pack_layer(root: Path, sink: BinaryIO, compression: str = "zstd", level: int = 3, **kw: object) -> PackResult:
    """Pack ``root`` into ``sink`` compressed; returns digests. ``sink`` is not closed."""
    outer = HashingWriter(sink)
    comp = compressing_writer(outer, compression, level)  # type: ignore[arg-type]
    inner = HashingWriter(comp)  # type: ignore[arg-type]
    write_tar(root, inner, **kw)  # type: ignore[arg-type]
    comp.close()
    return PackResult(outer.digest, inner.digest, outer.count, COMPRESSION_MT[compression])
