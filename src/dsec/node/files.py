"""Host-side file operations on a sandbox's root, safe against anything the sandbox did.

Every path is resolved with openat2(RESOLVE_IN_ROOT) relative to the sandbox's root
directory fd, so absolute symlinks, ``..`` chains and symlink swaps planted by code in
the sandbox resolve *inside* the sandbox, never on the host. Directory walks use fds
(``os.fwalk``, ``shutil.rmtree(dir_fd=...)``) and never follow symlinks.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath

from dsec.errors import Conflict, InvalidArgument, NotFound, PayloadTooLarge
from dsec.models import FileEntry
from dsec.node.syscalls import openat2

_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY


def normalize(path: str) -> str:
    """Sandbox path -> path relative to its root ('' for the root itself)."""
    if not path or "\0" in path:
        raise InvalidArgument(f"invalid path {path!r}: expected an absolute path like /work/a.py")
    if not path.startswith("/"):
        raise InvalidArgument(f"path {path!r} must be absolute (start with /)")
    parts = [p for p in PurePosixPath(path).parts[1:] if p not in ("", ".")]
    return "/".join(parts)


def _split(rel: str) -> tuple[str, str]:
    if not rel:
        raise InvalidArgument("the sandbox root itself cannot be used here")
    parent, _, name = rel.rpartition("/")
    if name == "..":
        raise InvalidArgument(f"path /{rel} must name an entry, not '..'")
    return parent, name


def _errno_to_error(e: OSError, path: str) -> Exception:
    import errno
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(f"no such file or directory in the sandbox: {path}", path=path)
    if e.errno == errno.EISDIR:
        return Conflict(f"{path} is a directory", path=path)
    if e.errno == errno.ENOTEMPTY:
        return Conflict(f"directory {path} is not empty; pass recursive=true", path=path)
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        from dsec.errors import StorageFull
        return StorageFull(f"the sandbox's disk quota is full while writing {path}", path=path)
    if e.errno == errno.EXDEV:
        return InvalidArgument(f"{path} resolves outside the sandbox's root", path=path)
    return InvalidArgument(f"{path}: {os.strerror(e.errno or 0)}", path=path)


class SandboxFS:
    def __init__(self, root: str) -> None:
        self.root = root

    @contextmanager
    def _root_fd(self) -> Iterator[int]:
        fd = os.open(self.root, _O_PATH_DIR | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open(self, root_fd: int, rel: str, flags: int, mode: int = 0, display: str = "") -> int:
        try:
            return openat2(root_fd, rel or ".", flags, mode)
        except OSError as e:
            raise _errno_to_error(e, display or "/" + rel) from None

    def _mkdirs(self, root_fd: int, rel_dir: str) -> int:
        """Open (creating as needed) directory ``rel_dir``; returns an O_PATH fd.

        Each prefix is resolved from the sandbox root, so a symlinked component means
        what it means inside the sandbox and still cannot leave it.
        """
        fd = os.dup(root_fd)
        done = ""
        for part in [p for p in rel_dir.split("/") if p]:
            done = f"{done}/{part}" if done else part
            try:
                nfd = openat2(root_fd, done, _O_PATH_DIR)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nfd = openat2(root_fd, done, _O_PATH_DIR)
                except OSError as e:
                    os.close(fd)
                    raise _errno_to_error(e, "/" + done) from None
            except OSError as e:
                os.close(fd)
                raise _errno_to_error(e, "/" + done) from None
            os.close(fd)
            fd = nfd
        return fd

    def makedirs(self, path: str) -> None:
        with self._root_fd() as root:
            os.close(self._mkdirs(root, normalize(path)))

    def read(self, path: str, max_bytes: int) -> bytes:
        rel = normalize(path)
        with self._root_fd() as root:
            fd = self._open(root, rel, os.O_RDONLY | os.O_NONBLOCK, display=path)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise Conflict(f"{path} is a directory; use list or download", path=path)
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidArgument(f"{path} is not a regular file", path=path)
                if st.st_size > max_bytes:
                    raise PayloadTooLarge(f"{path} is {st.st_size} bytes; the limit is {max_bytes}", path=path)
                with os.fdopen(os.dup(fd), "rb") as fh:
                    return fh.read(max_bytes + 1)[:max_bytes]
            finally:
                os.close(fd)

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        parent, name = _split(normalize(path))
        with self._root_fd() as root:
            os.close(self._mkdirs(root, parent))
            fd = self._open(root, f"{parent}/{name}" if parent else name,
                            os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode & 0o7777, display=path)
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fchmod(fd, mode & 0o777)
            except OSError as e:
                raise _errno_to_error(e, path) from None
            finally:
                os.close(fd)

    def list(self, path: str) -> list[FileEntry]:
        rel = normalize(path)
        with self._root_fd() as root:
            fd = self._open(root, rel, os.O_RDONLY | os.O_DIRECTORY, display=path)
            try:
                entries = []
                base = "/" + rel if rel else ""
                for de in os.scandir(fd):
                    st = de.stat(follow_symlinks=False)
                    kind = ("dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                            else "symlink" if stat.S_ISLNK(st.st_mode) else "other")
                    entries.append(FileEntry(name=de.name, path=f"{base}/{de.name}", size=st.st_size,
                                             mode=stat.S_IMODE(st.st_mode), type=kind, mtime=st.st_mtime))
                return sorted(entries, key=lambda e: e.name)
            finally:
                os.close(fd)

    def remove(self, path: str, recursive: bool = False) -> None:
        parent, name = _split(normalize(path))
        with self._root_fd() as root:
            pfd = self._open(root, parent, os.O_RDONLY | os.O_DIRECTORY, display=path)
            try:
                try:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except OSError as e:
                    raise _errno_to_error(e, path) from None
                try:
                    if stat.S_ISDIR(st.st_mode):
                        if recursive:
                            shutil.rmtree(name, dir_fd=pfd)
                        else:
                            os.rmdir(name, dir_fd=pfd)
                    else:
                        os.unlink(name, dir_fd=pfd)
                except OSError as e:
                    raise _errno_to_error(e, path) from None
            finally:
                os.close(pfd)

    def upload_tar(self, path: str, tar_bytes: bytes) -> int:
        """Extract a tar stream under directory ``path``; returns files written."""
        base = normalize(path)
        count = 0
        try:
            tf = tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:*")
        except tarfile.TarError as e:
            raise InvalidArgument(f"upload is not a readable tar stream: {e}") from None
        with tf, self._root_fd() as root:
            for m in tf:
                name = normalize("/" + m.name.lstrip("/"))
                if ".." in name.split("/"):
                    raise InvalidArgument(f"tar entry {m.name!r} contains '..'")
                rel = "/".join(p for p in (base, name) if p)
                if m.isdir():
                    os.close(self._mkdirs(root, rel))
                elif m.isreg():
                    src = tf.extractfile(m)
                    self.write("/" + rel, src.read() if src else b"", m.mode & 0o777)
                    count += 1
                elif m.issym():
                    parent, leaf = _split(rel)
                    pfd = self._mkdirs(root, parent)
                    try:
                        os.symlink(m.linkname, leaf, dir_fd=pfd)
                    except FileExistsError:
                        os.unlink(leaf, dir_fd=pfd)
                        os.symlink(m.linkname, leaf, dir_fd=pfd)
                    finally:
                        os.close(pfd)
                else:
                    raise InvalidArgument(f"tar entry {m.name!r}: only files, dirs and symlinks are accepted")
        return count

    def download_tar(self, path: str, max_bytes: int) -> bytes:
        rel = normalize(path)
        buf = io.BytesIO()
        with self._root_fd() as root, tarfile.open(fileobj=buf, mode="w") as tf:
            fd = self._open(root, rel, os.O_RDONLY | os.O_DIRECTORY, display=path)
            try:
                for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=fd):
                    for name in sorted(dirnames) + sorted(filenames):
                        arc = os.path.normpath(os.path.join(dirpath, name))
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        info = tarfile.TarInfo(arc)
                        info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
                        if stat.S_ISDIR(st.st_mode):
                            info.type = tarfile.DIRTYPE
                            tf.addfile(info)
                        elif stat.S_ISLNK(st.st_mode):
                            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dfd)
                            tf.addfile(info)
                        elif stat.S_ISREG(st.st_mode):
                            ffd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                            with os.fdopen(ffd, "rb") as fh:
                                info.size = st.st_size
                                tf.addfile(info, fh)
                        if buf.tell() > max_bytes:
                            raise PayloadTooLarge(f"{path} is larger than {max_bytes} bytes as a tar")
            finally:
                os.close(fd)
        return buf.getvalue()
