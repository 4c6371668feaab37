"""Incremental filesystem checkpoints of an overlay upper dir.

Change detection is a stat walk: the signature of every upper entry (type, mode,
owner, size, mtime/ctime ns, inode, rdev, opaque flag) is compared with the walk
taken at the previous checkpoint. Only changed entries are read and hashed, so a step
that changed nothing costs one directory walk and no writes.

The diff layer contains changed entries, OCI whiteouts for entries that vanished from
the upper since the previous checkpoint (an upper-only file deleted: it lives in an
earlier checkpoint layer and must be masked), and overlay whiteouts/opaque dirs
translated to OCI form.

The canonical manifest maps every path the episode changed relative to the image to a
content description (no timestamps, no inode numbers); its digest identifies the
episode's filesystem state independently of how it was layered, so a restored run and
a fault-free run of the same steps get the same digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsec.checkpoints.layers import OPAQUE_XATTR, Node

Sig = tuple  # (mode, uid, gid, size, mtime_ns, ctime_ns, ino, rdev, opaque)


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def walk_signature(upper: Path) -> dict[str, Sig]:
    """Stat-walk ``upper``: {relative path: signature}. Root itself is not included."""
    sigs: dict[str, Sig] = {}
    root = str(upper)
    stack = [("", root)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        with os.scandir(abs_dir) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                is_dir = stat.S_ISDIR(st.st_mode)
                sigs[rel] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                             st.st_ctime_ns, st.st_ino, st.st_rdev, is_dir and _opaque(e.path))
                if is_dir:
                    stack.append((rel, e.path))
    return sigs


@dataclass
class Changes:
    changed: list[str]   # new or modified entries, parents first
    deleted: list[str]   # top-most vanished entries that need a whiteout
    opaque_new: list[str]  # dirs that became opaque (their old children are masked)

    @property
    def empty(self) -> bool:
        return not (self.changed or self.deleted)


def _is_whiteout(sig: Sig) -> bool:
    return stat.S_ISCHR(sig[0]) and sig[7] == 0


def diff_signatures(prev: dict[str, Sig], cur: dict[str, Sig]) -> Changes:
    """Pure: what changed in the upper between two walks."""
    changed = sorted((p for p, s in cur.items() if prev.get(p) != s), key=lambda p: p.split("/"))
    opaque_new = [p for p in changed if cur[p][8] and not (prev.get(p) or (0,) * 9)[8]]
    masked = set(opaque_new)

    def hidden(path: str) -> bool:
        # An ancestor that is now a non-dir, newly opaque, or itself deleted masks this path.
        parts = path.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            s = cur.get(anc)
            if anc in masked or s is None or not stat.S_ISDIR(s[0]):
                return True
        return False

    deleted = sorted((p for p in prev if p not in cur and not hidden(p)), key=lambda p: p.split("/"))
    return Changes(changed=changed, deleted=deleted, opaque_new=opaque_new)


def build_nodes(upper: Path, cur: dict[str, Sig], changes: Changes) -> dict[str, Node]:
    """Read the changed entries of ``upper`` into layer nodes (OCI form)."""
    nodes: dict[str, Node] = {}
    for rel in changes.deleted:
        nodes[rel] = Node(info=None, whiteout=True)
    for rel in changes.changed:
        sig = cur[rel]
        path = upper / rel
        if _is_whiteout(sig):
            nodes[rel] = Node(info=None, whiteout=True)
            continue
        st = os.lstat(path)
        info = tarfile.TarInfo(rel)
        info.mode, info.uid, info.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
        info.mtime = st.st_mtime
        data = b""
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISREG(st.st_mode):
            info.type = tarfile.REGTYPE
            data = path.read_bytes()
            info.size = len(data)
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            info.type = tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else tarfile.BLKTYPE
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        else:
            continue  # sockets are not part of a filesystem's state
        nodes[rel] = Node(info=info, data=data, opaque=bool(sig[8]))
    return nodes


# --- canonical manifest -------------------------------------------------------------------

def node_entry(n: Node) -> list:
    if n.whiteout:
        return ["wh"]
    i = n.info
    assert i is not None
    if i.isreg():
        return ["f", i.mode, i.uid, i.gid, len(n.data), hashlib.sha256(n.data).hexdigest()]
    if i.isdir():
        return ["d", i.mode, i.uid, i.gid, n.opaque]
    if i.issym():
        return ["l", i.linkname, i.uid, i.gid]
    return ["s", int(i.type[0]) if i.type.isdigit() else 0, i.mode, i.devmajor, i.devminor]


def apply_to_manifest(manifest: dict[str, list], nodes: dict[str, Node],
                      in_image: Callable[[str], bool]) -> None:
    """Fold a diff into the canonical manifest (same overlay semantics as layers.apply_nodes).

    Whiteouts and opaque flags are kept only where they hide something of the image; a
    whiteout of a file the episode itself created is the same state as no file at all.
    """
    for path in sorted(nodes, key=lambda p: p.split("/")):
        n = nodes[path]
        pre = path + "/"
        if n.whiteout or n.opaque or (n.info is not None and not n.info.isdir()):
            for p in [p for p in manifest if p.startswith(pre)]:
                del manifest[p]
        if n.whiteout:
            if in_image(path):
                manifest[path] = ["wh"]
            else:
                manifest.pop(path, None)
            continue
        if n.info is None:
            continue
        entry = node_entry(n)
        if entry[0] == "d":
            entry[4] = bool(entry[4]) and in_image(path)
        manifest[path] = entry


def manifest_digest(manifest: dict[str, list]) -> str:
    data = json.dumps(sorted(manifest.items()), separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_lookup(lower_dirs: list[Path]) -> Callable[[str], bool]:
    """A predicate 'does the image have this path' over unpacked image layer dirs."""
    def has(rel: str) -> bool:
        return any(os.path.lexists(d / rel) for d in lower_dirs)
    return has
