"""Thin ctypes wrappers for the few syscalls Python's stdlib lacks.

Calling mount(2)/umount2(2) directly instead of spawning mount(8) is what keeps
preparing an overlay root under a millisecond; openat2(2) with RESOLVE_IN_ROOT is what
makes host-side file access to a sandbox's tree safe against symlinks it planted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

MNT_FORCE = 1
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8

_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long


def _raise(what: str, path: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what} {path}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    rc = _libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                     data.encode() if data is not None else None)
    if rc != 0:
        _raise(f"mount {fstype}", target)


def umount(target: str, flags: int = MNT_DETACH | UMOUNT_NOFOLLOW) -> None:
    if _libc.umount2(target.encode(), flags) != 0:
        _raise("umount", target)


def mount_overlay(target: str, lower_dirs: list[str], upper_dir: str | None, work_dir: str | None,
                  flags: int = MS_NODEV) -> None:
    """Mount overlayfs at ``target``. ``lower_dirs`` is top-most first (overlay order)."""
    opts = "lowerdir=" + ":".join(lower_dirs)
    if upper_dir:
        opts += f",upperdir={upper_dir},workdir={work_dir}"
    # index/metacopy off: predictable semantics for commit and checkpoint diffs.
    opts += ",index=off,metacopy=off,xino=off"
    if not upper_dir:
        flags |= MS_RDONLY
    mount("overlay", target, "overlay", flags, opts)


def mount_tmpfs(target: str, size_bytes: int, mode: int = 0o755, flags: int = MS_NODEV | MS_NOSUID) -> None:
    mount("tmpfs", target, "tmpfs", flags, f"size={max(size_bytes, 4096)},mode={mode:o}")


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix``, deepest first (the order to unmount them)."""
    prefix = prefix.rstrip("/")
    found: list[str] = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == prefix or mp.startswith(prefix + "/"):
                found.append(mp)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


# --- openat2 ---------------------------------------------------------------------------

SYS_openat2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0,
            resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    """open ``path`` relative to ``dir_fd`` as if ``dir_fd`` were ``/`` (symlinks cannot escape)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(SYS_openat2, dir_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        _raise("open", path)
    return int(fd)
