"""Checkpoint layers: tar (OCI whiteout convention) <-> overlay-format directories.

A checkpoint layer is a zstd-compressed tar using the OCI conventions ``.wh.<name>``
(deleted) and ``.wh..wh..opq`` (opaque dir), so it is portable and can be written
without privileges. On a node it is unpacked back into overlay's own format (char
device 0/0 = whiteout, ``trusted.overlay.opaque=y``) to serve as a read-only lower dir.

:func:`squash` merges a chain of layers into one equivalent layer in memory, which is
how a periodic full checkpoint is produced without touching any filesystem.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from dsec import errors

WH_PREFIX = ".wh."
OPQ_NAME = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclass
class Node:
    """One path of a layer: a tar header, file bytes, and overlay markers."""

    info: tarfile.TarInfo | None  # None for a pure whiteout
    data: bytes = b""
    whiteout: bool = False
    opaque: bool = False
    extra: dict = field(default_factory=dict)


def _norm(name: str) -> str:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts) or name.startswith("/"):
        raise errors.CheckpointError(f"checkpoint layer entry {name!r} escapes the layer root")
    return "/".join(parts)


# Tar framing a layer may add on top of its file bytes (headers, pax records, padding):
# per entry at most ~3 KiB; a layer bound is ``max_bytes + LAYER_OVERHEAD``.
LAYER_OVERHEAD = 64 << 20


def too_large(what: str, size: int, limit: int) -> errors.PayloadTooLarge:
    return errors.PayloadTooLarge(
        f"{what} holds {size} bytes of files (apparent size: a sparse file counts at its full length), above "
        f"the limit of {limit} bytes (the sandbox's disk quota, capped by the server's checkpoint_max_bytes); "
        "delete or shrink the large files before checkpointing", size=size, limit=limit)


def _decompress(blob: bytes, max_bytes: int | None) -> bytes:
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob), read_across_frames=True)
    if max_bytes is None:
        return reader.read()
    # Read at most one byte past the bound: a zstd bomb (1 GiB of zeros is ~30 KiB) must
    # never be inflated in memory.
    raw = reader.read(max_bytes + LAYER_OVERHEAD + 1)
    if len(raw) > max_bytes + LAYER_OVERHEAD:
        raise too_large("the checkpoint layer", len(raw), max_bytes)
    return raw


def read_layer(blob: bytes, max_bytes: int | None = None) -> dict[str, Node]:
    """Decode a compressed layer into {path: Node} (paths relative, no leading '/').

    ``max_bytes``: refuse (PayloadTooLarge) a layer whose files hold more than this,
    before inflating more than the bound."""
    raw = _decompress(blob, max_bytes)
    nodes: dict[str, Node] = {}
    total = 0
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        for m in tar:
            path = _norm(m.name)
            parent, _, base = path.rpartition("/")
            if base == OPQ_NAME:
                nodes.setdefault(parent, Node(info=None)).opaque = True
            elif base.startswith(WH_PREFIX):
                target = (parent + "/" if parent else "") + base[len(WH_PREFIX):]
                nodes[target] = Node(info=None, whiteout=True)
            else:
                total += m.size if m.isreg() else 0
                if max_bytes is not None and total > max_bytes:
                    raise too_large("the checkpoint layer", total, max_bytes)
                data = tar.extractfile(m).read() if m.isreg() else b""
                prev = nodes.get(path)
                m.name = path
                nodes[path] = Node(info=m, data=data, opaque=bool(prev and prev.opaque))
    return nodes


def write_layer(nodes: dict[str, Node], level: int = 3) -> bytes:
    """Encode {path: Node} as a zstd tar; parents always precede children.

    The tar is streamed through the compressor: only the compressed layer is held, never
    a second uncompressed copy of every file."""
    buf = io.BytesIO()
    zw = zstandard.ZstdCompressor(level=level).stream_writer(buf, closefd=False)
    with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(nodes, key=lambda p: p.split("/")):
            n = nodes[path]
            parent, _, base = path.rpartition("/")
            if n.whiteout:
                wh = tarfile.TarInfo((parent + "/" if parent else "") + WH_PREFIX + base)
                tar.addfile(wh)
                continue
            if n.info is not None:
                info = n.info
                info.name = path
                tar.addfile(info, io.BytesIO(n.data) if info.isreg() else None)
            if n.opaque:
                tar.addfile(tarfile.TarInfo((path + "/" if path else "") + OPQ_NAME))
    zw.close()
    return buf.getvalue()


def _drop_subtree(nodes: dict[str, Node], path: str) -> None:
    pre = path + "/" if path else ""
    for p in [p for p in nodes if p.startswith(pre)]:
        del nodes[p]


def apply_nodes(base: dict[str, Node], top: dict[str, Node]) -> None:
    """Stack ``top`` over ``base`` in place, with overlay semantics (squash one layer)."""
    for path in sorted(top, key=lambda p: p.split("/")):
        n = top[path]
        old = base.get(path)
        if n.whiteout:
            _drop_subtree(base, path)
            base[path] = Node(info=None, whiteout=True)
            continue
        if n.info is None:  # opaque marker on a dir whose header came in an earlier layer
            _drop_subtree(base, path)
            if old is not None and old.info is not None and old.info.isdir():
                base[path] = Node(info=old.info, opaque=True)
            continue
        is_dir = n.info.isdir()
        if not is_dir or n.opaque:
            _drop_subtree(base, path)
        opaque = n.opaque
        if is_dir and old is not None and (old.whiteout or (old.info is not None and not old.info.isdir())):
            # The old entry hid whatever lies below (the image); a squashed dir must keep hiding it.
            opaque = True
        if is_dir and old is not None and old.opaque:
            opaque = True
        base[path] = Node(info=n.info, data=n.data, opaque=opaque)


def squash(layers: list[bytes], in_image: Callable[[str], bool], level: int = 3) -> bytes:
    """One layer equal to stacking ``layers`` (base first) directly on the image.

    Whiteouts that hide nothing of the image are dropped: overlay does not filter
    whiteouts inside a directory that exists in a single layer, so a useless whiteout
    there would show up as a broken entry.
    """
    merged: dict[str, Node] = {}
    for blob in layers:
        apply_nodes(merged, read_layer(blob))
    for path in [p for p, n in merged.items() if n.whiteout and not in_image(p)]:
        del merged[path]
    return write_layer(merged, level)


def unpack_overlay(blob: bytes, dest: Path, max_bytes: int | None = None) -> None:
    """Unpack a layer into ``dest`` (must not exist) in overlay lower-dir format. Needs root.

    ``max_bytes`` bounds the layer's file bytes (see ``read_layer``); runs of zeros are
    written as holes, so a sparse file stays sparse on disk."""
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir(parents=True)
    try:
        nodes = read_layer(blob, max_bytes)
        dirs: list[tuple[Path, tarfile.TarInfo]] = []
        for path in sorted(nodes, key=lambda p: p.split("/")):
            n = nodes[path]
            target = tmp / path if path else tmp
            if path:
                target.parent.mkdir(parents=True, exist_ok=True)
            if n.whiteout:
                os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                continue
            info = n.info
            if info is not None and path:
                _make(target, info, n.data, tmp)
                if info.isdir():
                    dirs.append((target, info))
            elif info is not None:
                dirs.append((target, info))
            if n.opaque:
                os.setxattr(target, OPAQUE_XATTR, b"y")
        for target, info in reversed(dirs):  # dir metadata last: creating children touches mtime
            os.chown(target, info.uid, info.gid)
            os.chmod(target, info.mode & 0o7777)
            os.utime(target, (info.mtime, info.mtime))
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_BLOCK = 64 * 1024
_ZERO = bytes(_BLOCK)


def write_sparse(fh: io.BufferedWriter, data: bytes) -> None:
    """Write ``data`` leaving every all-zero 64 KiB block as a hole (the file reads the same)."""
    view = memoryview(data)
    for off in range(0, len(data), _BLOCK):
        chunk = view[off:off + _BLOCK]
        if chunk == _ZERO[:len(chunk)]:
            fh.seek(len(chunk), os.SEEK_CUR)
        else:
            fh.write(chunk)
    fh.truncate(len(data))  # a trailing hole still counts in the length


def _make(target: Path, info: tarfile.TarInfo, data: bytes, root: Path) -> None:
    if info.isdir():
        target.mkdir(exist_ok=True)
        return
    if info.isreg():
        with open(target, "wb") as fh:
            write_sparse(fh, data)
    elif info.issym():
        os.symlink(info.linkname, target)
    elif info.islnk():
        os.link(root / _norm(info.linkname), target)
        return
    elif info.ischr() or info.isblk():
        kind = stat.S_IFCHR if info.ischr() else stat.S_IFBLK
        os.mknod(target, kind | (info.mode & 0o7777), os.makedev(info.devmajor, info.devminor))
    elif info.isfifo():
        os.mkfifo(target, info.mode & 0o7777)
    else:
        raise errors.CheckpointError(f"checkpoint layer entry {info.name!r} has unsupported type")
    os.lchown(target, info.uid, info.gid)
    if not info.issym():
        os.chmod(target, info.mode & 0o7777)
        os.utime(target, (info.mtime, info.mtime))
    else:
        os.utime(target, (info.mtime, info.mtime), follow_symlinks=False)
