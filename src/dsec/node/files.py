"""Host-side file operations on a sandbox's root, safe against anything the sandbox did.

Every path is resolved with openat2(RESOLVE_IN_ROOT) relative to the sandbox's root
directory fd, so absolute symlinks, ``..`` chains and symlink swaps planted by code in
the sandbox resolve *inside* the sandbox, never on the host. Directory walks use fds
(``os.fwalk``, ``shutil.rmtree(dir_fd=...)``) and never follow symlinks.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import os
import shutil
import stat
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import IO

from dsec.errors import Conflict, InvalidArgument, NotFound, PayloadTooLarge
from dsec.models import FileEntry
from dsec.node.syscalls import openat2

_O_PATH_DIR = os.O_PATH | os.O_DIRECTORY
CHUNK = 1 << 20  # bytes per read/write step: bounds what one file operation holds in memory
_BLOCK = tarfile.BLOCKSIZE


def _kind(mode: int) -> str:
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "symlink" if stat.S_ISLNK(mode) else "other")


def _special(mode: int) -> str:
    return ("a fifo" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _require_regular(st: os.stat_result, path: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise Conflict(f"{path} is a directory; use list or download", path=path)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path} is {_special(st.st_mode)}: the files API reads and writes regular "
                              "files only", path=path)


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


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


class OpenFile:
    """An fd used from worker threads one step at a time.

    A step that overran its deadline may still be running when the request gives up:
    ``close`` waits for it (same lock) instead of closing the fd under it, where the
    number could be reused by another tenant's open and the late step hit that file."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self._lock = threading.Lock()

    def read(self, n: int = CHUNK) -> bytes:
        with self._lock:
            return os.read(self.fd, n) if self.fd >= 0 else b""

    def read_all(self, size: int) -> bytes:
        out = bytearray()
        while len(out) < size and (chunk := self.read(min(CHUNK, size - len(out)))):
            out += chunk
        return bytes(out)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        with self._lock:
            if self.fd < 0:
                raise InvalidArgument(f"{self.path}: the upload was abandoned", path=self.path)
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError as e:
                raise _errno_to_error(e, self.path) from None

    def finish(self, mode: int) -> None:
        """Set the mode and close (a completed upload)."""
        with self._lock:
            try:
                os.fchmod(self.fd, mode & 0o777)
            except OSError as e:
                raise _errno_to_error(e, self.path) from None
            finally:
                os.close(self.fd)
                self.fd = -1

    def abandon(self) -> None:
        """A failed upload leaves an empty file, never a silently cut one."""
        with self._lock:
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, 0)
                self.close_locked()

    def close(self) -> None:
        with self._lock:
            self.close_locked()

    def close_locked(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LockedIter:
    """A generator advanced from worker threads: ``close`` waits for a step in progress."""

    def __init__(self, it: Iterator[bytes]) -> None:
        self._it = it
        self._lock = threading.Lock()

    def next(self) -> bytes | None:
        with self._lock:
            return next(self._it, None)

    def close(self) -> None:
        with self._lock:
            close = getattr(self._it, "close", None)
            if close is not None:
                close()


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

    def _open_regular(self, root_fd: int, rel: str, flags: int, display: str, create_mode: int | None = None,
                      nofollow: bool = False) -> int:
        """Open a regular file (creating it if ``create_mode`` is given) and nothing else.

        Why not openat2 with the real flags: opening a fifo blocks until a peer opens the
        other end (a host thread stuck for good; issue 18 #2), and opening a device node
        can have side effects. An O_PATH open does neither; its type is checked, then the
        very same inode is re-opened through /proc/self/fd (no second lookup to race).
        """
        try:
            pfd = openat2(root_fd, rel or ".", os.O_PATH | (os.O_NOFOLLOW if nofollow else 0))
        except FileNotFoundError:
            if create_mode is None:
                raise NotFound(f"no such file or directory in the sandbox: {display}", path=display) from None
            # O_NONBLOCK: should a fifo appear here meanwhile, the open fails (ENXIO) or
            # returns at once; the type check below refuses it either way.
            fd = self._open(root_fd, rel, flags | os.O_CREAT | os.O_NONBLOCK, create_mode, display=display)
            try:
                _require_regular(os.fstat(fd), display)
            except BaseException:
                os.close(fd)
                raise
            return fd
        except OSError as e:
            raise _errno_to_error(e, display) from None
        try:
            _require_regular(os.fstat(pfd), display)
            try:
                return os.open(f"/proc/self/fd/{pfd}", flags | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                raise _errno_to_error(e, display) from None
        finally:
            os.close(pfd)

    # --- read ---------------------------------------------------------------------

    def open_read(self, path: str, max_bytes: int) -> tuple[OpenFile, int]:
        """(file, size) of a regular file; 413 when its *apparent* size is over ``max_bytes``.

        Checked before a byte is read: a sparse file (``truncate -s 1G``) costs no disk
        but would cost its full size in memory and on the wire (issue 18 #3)."""
        rel = normalize(path)
        with self._root_fd() as root:
            fd = self._open_regular(root, rel, os.O_RDONLY, path)
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise PayloadTooLarge(f"{path} is {size} bytes (apparent size: holes of sparse files count); "
                                      f"the limit is {max_bytes} (Settings.max_upload_bytes)", path=path,
                                      size=size, limit=max_bytes)
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(fd, path), size

    def read(self, path: str, max_bytes: int) -> bytes:
        f, size = self.open_read(path, max_bytes)
        try:
            return f.read_all(size)
        finally:
            f.close()

    # --- write --------------------------------------------------------------------

    def open_write(self, path: str, mode: int = 0o644) -> OpenFile:
        """Regular file ``path`` opened for writing (parents made, truncated); fifos,
        sockets and devices are refused with 422 instead of being opened."""
        parent, name = _split(normalize(path))
        with self._root_fd() as root:
            os.close(self._mkdirs(root, parent))
            fd = self._open_regular(root, f"{parent}/{name}" if parent else name, os.O_WRONLY, path,
                                    create_mode=mode & 0o7777)
        try:
            os.ftruncate(fd, 0)
        except OSError as e:
            os.close(fd)
            raise _errno_to_error(e, path) from None
        return OpenFile(fd, path)

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        f = self.open_write(path, mode)
        try:
            f.write(data)
        except BaseException:
            f.abandon()
            raise
        f.finish(mode)

    # --- list -----------------------------------------------------------------------

    def list(self, path: str) -> list[FileEntry]:
        """Every entry (node-internal callers; the API pages with ``list_page``)."""
        return self.list_page(path, None, None)[0]

    def list_page(self, path: str, limit: int | None, after: str | None) -> tuple[list[FileEntry], str | None]:
        """Up to ``limit`` entries named after ``after`` (name order) and the cursor of the
        next page (None: this was the last one).

        Memory is O(limit) whatever the directory holds: names stream through a bounded
        heap (issue 18 #11). Entries renamed or removed while we look (the sandbox runs
        concurrently) are left out, never a 500 (issue 18 #13)."""
        rel = normalize(path)
        with self._root_fd() as root:
            fd = self._open(root, rel, os.O_RDONLY | os.O_DIRECTORY, display=path)
            try:
                try:
                    with os.scandir(fd) as it:
                        names = (de.name for de in it if after is None or de.name > after)
                        picked = sorted(names) if limit is None else heapq.nsmallest(limit + 1, names)
                except OSError as e:
                    raise _errno_to_error(e, path) from None
                more = limit is not None and len(picked) > limit
                if more:
                    picked = picked[:limit]
                base = "/" + rel if rel else ""
                entries = []
                for name in picked:
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except (FileNotFoundError, NotADirectoryError):
                        continue  # gone since the directory was read: not part of the answer
                    except OSError as e:
                        raise _errno_to_error(e, f"{base}/{name}") from None
                    entries.append(FileEntry(name=name, path=f"{base}/{name}", size=st.st_size,
                                             mode=stat.S_IMODE(st.st_mode), type=_kind(st.st_mode),
                                             mtime=st.st_mtime))
                return entries, (picked[-1] if more else None)
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
        return self.upload_tar_from(path, io.BytesIO(tar_bytes))

    def upload_tar_from(self, path: str, src: IO[bytes]) -> int:
        """Extract a tar stream (read sequentially from ``src``) under directory ``path``;
        returns files written. Members are copied in chunks, never held whole."""
        base = normalize(path)
        count = 0
        try:
            tf = tarfile.open(fileobj=src, mode="r|*")  # noqa: SIM115 - closed by the `with` below
        except tarfile.TarError as e:
            raise InvalidArgument(f"upload is not a readable tar stream: {e}") from None
        with tf, self._root_fd() as root:
            try:
                for m in tf:
                    name = normalize("/" + m.name.lstrip("/"))
                    if ".." in name.split("/"):
                        raise InvalidArgument(f"tar entry {m.name!r} contains '..'")
                    rel = "/".join(p for p in (base, name) if p)
                    if m.isdir():
                        os.close(self._mkdirs(root, rel))
                    elif m.isreg():
                        self._extract_file(tf, m, "/" + rel)
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
            except tarfile.TarError as e:
                raise InvalidArgument(f"upload is not a readable tar stream: {e}") from None
        return count

    def _extract_file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> None:
        src = tf.extractfile(m)
        f = self.open_write(path, m.mode & 0o777)
        try:
            while src is not None and (chunk := src.read(CHUNK)):
                f.write(chunk)
        except BaseException:
            f.abandon()
            raise
        f.finish(m.mode)

    # --- download -------------------------------------------------------------------

    def _tar_entries(self, path: str) -> Iterator[tuple[tarfile.TarInfo, int, str]]:
        """(header, dir fd, name) of every entry under directory ``path``, depth first,
        symlinks never followed; fifos, sockets and devices are left out."""
        rel = normalize(path)
        with self._root_fd() as root:
            fd = self._open(root, rel, os.O_RDONLY | os.O_DIRECTORY, display=path)
            try:
                for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=fd):
                    for name in sorted(dirnames) + sorted(filenames):
                        try:
                            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # removed while we walk
                        info = tarfile.TarInfo(os.path.normpath(os.path.join(dirpath, name)))
                        info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
                        if stat.S_ISDIR(st.st_mode):
                            info.type = tarfile.DIRTYPE
                        elif stat.S_ISLNK(st.st_mode):
                            try:
                                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dfd)
                            except FileNotFoundError:
                                continue
                        elif stat.S_ISREG(st.st_mode):
                            info.size = st.st_size
                        else:
                            continue
                        yield info, dfd, name
            finally:
                os.close(fd)

    @staticmethod
    def _header(info: tarfile.TarInfo) -> bytes:
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def tar_size(self, path: str, max_bytes: int) -> int:
        """Bytes the tar of ``path`` will take, counting apparent sizes (a sparse file's
        holes are sent as zeros); 413 as soon as it passes ``max_bytes``. Nothing is read
        but metadata, so the check costs the same for a 1 GiB hole as for 1 byte."""
        total = 2 * _BLOCK
        for info, _, _ in self._tar_entries(path):
            total += len(self._header(info)) + _padded(info.size)
            if total > max_bytes:
                raise PayloadTooLarge(f"{path} is larger than {max_bytes} bytes as a tar (apparent sizes: holes of "
                                      "sparse files count; Settings.max_upload_bytes)", path=path, limit=max_bytes)
        return total

    def iter_tar(self, path: str, max_bytes: int) -> Iterator[bytes]:
        """The tar of ``path`` in pieces of about ``CHUNK`` bytes (memory stays O(CHUNK)).

        Call ``tar_size`` first for a clean 413; files that grew since are cut to the size
        their header announced, and a tree that grew past ``max_bytes`` stops the stream."""
        sent = 0
        buf = bytearray()

        def emit(data: bytes) -> None:
            nonlocal sent
            sent += len(data)
            if sent > max_bytes:
                raise PayloadTooLarge(f"{path} grew past {max_bytes} bytes while being archived", path=path)
            buf.extend(data)

        for info, dfd, name in self._tar_entries(path):
            fd = -1
            if info.type == tarfile.REGTYPE:
                try:
                    # never a fifo or a symlink swapped in since the walk looked
                    fd = self._open_regular(dfd, name, os.O_RDONLY, path, nofollow=True)
                except (NotFound, InvalidArgument, Conflict):
                    continue
            try:
                emit(self._header(info))
                left = info.size if fd >= 0 else 0
                while left > 0:
                    chunk = os.read(fd, min(CHUNK, left)) or bytes(min(CHUNK, left))  # shrank: pad with zeros
                    left -= len(chunk)
                    emit(chunk)
                    if len(buf) >= CHUNK:
                        yield bytes(buf)
                        buf.clear()
                if fd >= 0:
                    emit(bytes(_padded(info.size) - info.size))
            finally:
                if fd >= 0:
                    os.close(fd)
            if len(buf) >= CHUNK:
                yield bytes(buf)
                buf.clear()
        emit(bytes(2 * _BLOCK))
        yield bytes(buf)

    def download_tar(self, path: str, max_bytes: int) -> bytes:
        self.tar_size(path, max_bytes)
        return b"".join(self.iter_tar(path, max_bytes))
