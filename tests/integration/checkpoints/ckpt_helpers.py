"""Helpers for checkpoint integration tests: real overlay mounts and tree comparison."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from dsec.node import syscalls


class Overlay:
    def __init__(self, base: Path, lowers: list[Path]) -> None:
        self.upper, self.work, self.merged = base / "upper", base / "work", base / "merged"
        for d in (self.upper, self.work, self.merged):
            d.mkdir(parents=True)
        syscalls.mount_overlay(str(self.merged), [str(p) for p in lowers], str(self.upper), str(self.work))

    def umount(self) -> None:
        syscalls.umount(str(self.merged))


def tree(root: Path, mtimes: bool = True) -> dict[str, tuple]:
    """Everything a program in the sandbox can observe about a tree (minus dir mtimes)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            base = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISREG(st.st_mode):
                out[rel] = base + (hashlib.sha256(p.read_bytes()).hexdigest(),) + ((int(st.st_mtime),) if mtimes else ())
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = base + (os.readlink(p),)
            else:
                out[rel] = base
    return out


