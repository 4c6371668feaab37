"""In-place reset of a container-tier sandbox to its pristine state (about 1-2 ms).

What a sandbox can leave behind, and how each is undone without restarting it:

- processes: every task in the sandbox's cgroups but its init (dsec-init) is SIGKILLed,
  re-scanned until none is left (a fork bomb is frozen first, then killed);
- the writable layer: a fresh overlay (same lower dirs, new empty upper/work on the
  sandbox's scratch tmpfs) becomes the root of the sandbox's mount namespace with
  ``pivot_root``; /proc, /dev and /sys and the agent bind are moved over; the old
  overlay is detached and its upper and work dirs deleted (or, if the tenant wrote many
  files, the whole old scratch tmpfs is dropped); the host-side mount at ``rootfs`` is
  swapped too, so the file API sees the new root;
- /dev (a tmpfs writable by the sandbox's root), /dev/shm and /dev/mqueue: everything
  but the standard device nodes and links is removed, and those are re-made;
- SysV IPC objects (shm segments, semaphores, message queues) of its IPC namespace: removed.

The namespace work runs on dedicated reset worker threads that first unshare their
fs_struct (``unshare(CLONE_FS)``): only then may one thread of a multi-threaded process
``setns`` into another mount namespace. They go back to the host's namespaces after
every reset and run nothing else, so no general worker thread is ever inside a
sandbox's namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsec.node import cgroups, syscalls

_libc = syscalls._libc

SYS_UNSHARE = 272
SYS_SETNS = 308
SYS_PIVOT_ROOT = 155
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
CLONE_FS = 0x200
CLONE_NEWNS = 0x20000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
OPEN_TREE_CLONE = 1
AT_EMPTY_PATH = 0x1000
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MS_MOVE = 0x2000
IPC_RMID = 0

# /dev as runc makes it for a non-terminal container: name -> (char major, minor) or link target.
DEV_NODES: dict[str, tuple[int, int]] = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
                                         "urandom": (1, 9), "tty": (5, 0)}
DEV_LINKS: dict[str, str] = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}
DEV_MOUNTS = ("pts", "shm", "mqueue")
# Mounts of the old root carried over to the new one (submounts such as masked /proc
# paths and /dev/pts move with them).
CARRIED_MOUNTS = ("proc", "dev", "sys", ".dsec/init")


class ResetError(RuntimeError):
    """The fast path could not reset this sandbox; the caller falls back to a restart."""


def _sys(nr: int, *args: object) -> int:
    rc = int(_libc.syscall(nr, *args))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syscall {nr}: {os.strerror(err)}")
    return rc


# --- processes -------------------------------------------------------------------------


def kill_all_but_init(parent: str, sandbox_id: str, init_pid: int, timeout: float = 5.0) -> int:
    """SIGKILL every process of the sandbox except its init; return how many were killed.

    Re-scans until the cgroups hold only init: children forked between a scan and the
    kill are caught by the next scan; after a few rounds the sandbox is frozen so a fork
    bomb cannot outrun us (frozen tasks die once thawed).
    """
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    rounds = 0
    # Every v1 hierarchy holds every task: one cgroup.procs read is enough (pids_in
    # reads them all, ~10x slower).
    procs = cgroups.CGROUP_ROOT / "pids" / parent / sandbox_id / "cgroup.procs"
    scan: Callable[[], set[int]] = ((lambda: {int(x) for x in procs.read_bytes().split()}) if procs.exists()
                                    else (lambda: cgroups.pids_in(parent, sandbox_id)))
    while True:
        others = scan() - {init_pid}
        if not others:
            return len(killed)
        if time.monotonic() > deadline:
            raise ResetError(f"sandbox {sandbox_id}: {len(others)} processes survived SIGKILL for {timeout}s")
        rounds += 1
        frozen = rounds > 3 and _freeze(parent, sandbox_id, True)
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        killed |= others
        if frozen:
            _freeze(parent, sandbox_id, False)
        time.sleep(0.0002 if rounds < 5 else 0.002)


def _freeze(parent: str, sandbox_id: str, on: bool) -> bool:
    try:
        cgroups.set_frozen(parent, sandbox_id, on, timeout=1.0)
        return True
    except (OSError, TimeoutError):
        return False


def restore_limits(parent: str, sandbox_id: str, memory: int, cpu: float, pids: int) -> None:
    """Write the sandbox's recorded limits back (cgroup v1 files runc made)."""
    root = cgroups.CGROUP_ROOT
    writes = [(root / "memory" / parent / sandbox_id / "memory.limit_in_bytes", str(memory)),
              (root / "memory" / parent / sandbox_id / "memory.memsw.limit_in_bytes", str(memory)),
              (root / "cpu" / parent / sandbox_id / "cpu.cfs_quota_us", str(max(1000, int(cpu * 100_000)))),
              (root / "pids" / parent / sandbox_id / "pids.max", str(pids))]
    unified = root / "unified" / parent / sandbox_id
    if (unified / "memory.max").exists():
        writes.append((unified / "memory.max", str(memory)))
    for path, value in writes:
        with contextlib.suppress(OSError):  # a controller not mounted here / no swap accounting
            # A read is ~10x cheaper than a write to memory.* (the kernel re-checks usage).
            if path.read_bytes().strip() != value.encode():
                cgroups._write(path, value)


# --- filesystem --------------------------------------------------------------------------


def _clean_dir(d: str) -> None:
    for name in os.listdir(d):
        _remove(os.path.join(d, name))


def _remove(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def clean_dev(dev: str = "/dev") -> None:
    """Put /dev back to exactly what runc made (inside the sandbox's mount namespace)."""
    for name in os.listdir(dev):
        path = os.path.join(dev, name)
        st = os.lstat(path)
        if name in DEV_MOUNTS and stat.S_ISDIR(st.st_mode):
            if name != "pts":  # devpts entries vanish with the ptys (all holders are dead)
                _clean_dir(path)
                _own(path, st, 0o1777)
            continue
        if name in DEV_NODES and stat.S_ISCHR(st.st_mode) and \
                (os.major(st.st_rdev), os.minor(st.st_rdev)) == DEV_NODES[name]:
            _own(path, st, 0o666)
            continue
        if name in DEV_LINKS and stat.S_ISLNK(st.st_mode) and os.readlink(path) == DEV_LINKS[name]:
            continue
        _remove(path)
    for name, (major, minor) in DEV_NODES.items():
        path = os.path.join(dev, name)
        if not os.path.lexists(path):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(path, 0o666)
    for name, target in DEV_LINKS.items():
        if not os.path.lexists(os.path.join(dev, name)):
            os.symlink(target, os.path.join(dev, name))
    _own(dev, os.lstat(dev), 0o755)


def _own(path: str, st: os.stat_result, mode: int) -> None:
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    if st.st_uid or st.st_gid:
        os.chown(path, 0, 0)


def clean_sysv_ipc() -> int:
    """Remove every SysV shm segment, semaphore set and message queue of the caller's
    IPC namespace (they outlive the processes that made them). Returns how many."""
    n = 0
    for kind, fn in (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl")):
        if not _ipc_in_use(kind):
            continue
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            ident = int(line.split()[1])
            args = (ident, 0, IPC_RMID) if kind == "sem" else (ident, IPC_RMID, None)
            if getattr(_libc, fn)(*args) == 0:
                n += 1
    return n


def _ipc_in_use(kind: str) -> bool:
    """How many objects of a kind exist, from one *_INFO syscall (no /proc read)."""
    buf = ctypes.create_string_buffer(128)
    if kind == "shm":  # struct shm_info: int used_ids first
        rc = _libc.shmctl(0, 14, buf)  # SHM_INFO
        return rc < 0 or ctypes.c_int.from_buffer(buf).value > 0
    if kind == "sem":  # struct seminfo, SEM_INFO: semusz (8th int) = sets in use
        rc = _libc.semctl(0, 0, 19, buf)
        return rc < 0 or (ctypes.c_int * 10).from_buffer(buf)[7] > 0
    rc = _libc.msgctl(0, 12, buf)  # MSG_INFO: struct msginfo, msgpool (1st int) = queues in use
    return rc < 0 or (ctypes.c_int * 8).from_buffer(buf)[0] > 0


def prepare_root(root: Path, workdir: str, hosts: bytes | None) -> None:
    """Mount points for the carried mounts, the WORKDIR and /etc/hosts in a new root
    (the same entries runc and the manager made at create). Paths the image already has
    as real directories are left alone; anything else goes through SandboxFS, which
    resolves inside the root (an image's symlink cannot point us at host paths)."""
    from dsec.node.files import SandboxFS

    fs: SandboxFS | None = None
    for d in ("/proc", "/dev", "/sys", "/.dsec") + ((workdir,) if workdir != "/" else ()):
        try:
            if stat.S_ISDIR(os.lstat(f"{root}{d}").st_mode):
                continue
            if d.count("/") == 1:  # a top-level name that is not a dir (file, symlink...)
                raise FileExistsError(d)
        except FileNotFoundError:
            if d.count("/") == 1:  # directly under the new root: mkdir cannot follow anything
                os.mkdir(f"{root}{d}", 0o755)
                continue
        except FileExistsError:
            pass
        fs = fs or SandboxFS(str(root))
        fs.makedirs(d)
    init = root / ".dsec" / "init"
    if stat.S_ISDIR(os.lstat(root / ".dsec").st_mode) and not os.path.lexists(init):
        os.close(os.open(init, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o755))
    if hosts is not None:
        (fs or SandboxFS(str(root))).write("/etc/hosts", hosts)


def _enter(init_pid: int) -> None:
    for ns, flag in (("uts", CLONE_NEWUTS), ("ipc", CLONE_NEWIPC), ("mnt", CLONE_NEWNS)):
        fd = os.open(f"/proc/{init_pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _sys(SYS_SETNS, fd, flag)
        finally:
            os.close(fd)


def _swap_root_in_namespace(init_pid: int, tree_fd: int, hostname: str | None = None) -> int:
    """On a reset worker thread: enter the sandbox's UTS, mount and IPC namespaces, make
    the detached mount ``tree_fd`` its root, clean /dev and SysV IPC (and set the hostname
    when given: a recycled sandbox is named after its new id); then go back to the
    host's namespaces. Returns the IPC objects removed."""
    _enter(init_pid)
    try:
        if hostname is not None:
            name = hostname.encode()
            if _libc.sethostname(name, len(name)) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"sethostname: {os.strerror(err)}")
        # root and cwd are now the sandbox's "/" (the old overlay)
        removed_ipc = clean_sysv_ipc()
        clean_dev("/dev")
        stage = f"/.dsec/reset-{secrets.token_hex(6)}"  # unguessable: nothing can be planted there
        os.mkdir(stage, 0o700)
        _sys(SYS_MOVE_MOUNT, tree_fd, b"", AT_FDCWD, stage.encode(), MOVE_MOUNT_F_EMPTY_PATH)
        for m in CARRIED_MOUNTS:
            syscalls.mount("/" + m, f"{stage}/{m}", "", MS_MOVE)
        os.chdir(stage)
        _sys(SYS_PIVOT_ROOT, b".", b".")
        syscalls.umount(".", syscalls.MNT_DETACH)  # the old root, stacked on top of the new one
        return removed_ipc
    finally:
        _leave()


# --- the reset workers ----------------------------------------------------------------
# Threads that only ever run resets: each unshares its fs_struct once (so it alone may
# setns into a sandbox's mount namespace) and returns to the host's namespaces after every
# reset. One hop from the event loop, no thread start per reset. A worker that cannot get
# back is retired with its executor (its thread ends after that task); a new one serves.

_HOST_NS: dict[str, int] = {}
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _host_ns() -> dict[str, int]:
    if not _HOST_NS:
        for ns in ("uts", "ipc", "mnt"):
            _HOST_NS[ns] = os.open(f"/proc/self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    return _HOST_NS


def _worker_init() -> None:
    _sys(SYS_UNSHARE, CLONE_FS)


def _leave() -> None:
    try:
        fds = _host_ns()
        _sys(SYS_SETNS, fds["mnt"], CLONE_NEWNS)  # root and cwd: the host's "/"
        _sys(SYS_SETNS, fds["ipc"], CLONE_NEWIPC)
        _sys(SYS_SETNS, fds["uts"], CLONE_NEWUTS)
    except OSError:
        _retire_executor()
        raise


def _retire_executor() -> None:
    global _executor
    with _executor_lock:
        old, _executor = _executor, None
    if old is not None:
        old.shutdown(wait=False)


def executor(workers: int = 2) -> ThreadPoolExecutor:
    """The reset workers (created on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _host_ns()
            _executor = ThreadPoolExecutor(workers, thread_name_prefix="dsec-reset", initializer=_worker_init)
        return _executor


# A reset keeps the sandbox's scratch tmpfs when the old writable layer is this small
# (inodes in use: upper + work + what the tenant wrote): deleting a few files is cheaper
# than a new tmpfs mount plus an umount (an RCU grace period). A tenant that wrote more
# gets a new tmpfs, so the reset never spends long deleting a huge tree. The bound also
# bounds the tree's depth: shutil.rmtree recurses and holds a dir fd per level, so a
# tenant's deep chain stays far below the recursion limit (1000) and the fd limit.
REUSE_SCRATCH_MAX_INODES = 512


def scratch_reusable(scratch: Path, max_inodes: int = REUSE_SCRATCH_MAX_INODES) -> bool:
    """Is the old writable layer on ``scratch`` small enough to delete in place?"""
    try:
        st = os.statvfs(scratch)
    except OSError:
        return False
    return st.f_files > 0 and st.f_files - st.f_ffree <= max_inodes


def _rmtree(path: Path) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path)


def reset_container(*, sandbox_id: str, init_pid: int, rootfs: Path, scratch: Path, lower_dirs: list[str],
                    disk: int, workdir: str, hosts: bytes | None, cgroup_parent: str,
                    limits: tuple[int, float, int], kill_timeout: float = 5.0,
                    hostname: str | None = None) -> dict[str, float]:
    """Blocking; runs on a reset worker (``executor()``). Returns per-step timings in ms.

    The new writable layer (empty upper and work dirs) is made next to the old one on the
    same scratch tmpfs; once the new root is in place, the old dirs are deleted and the
    new ones take their names (``scratch/upper`` is what the file API and checkpoints
    read). If the old layer holds many files (``scratch_reusable``), a new scratch tmpfs
    (same size: the disk quota) is mounted instead, and the old one goes in one lazy umount.
    """
    t = [time.perf_counter()]
    times: dict[str, float] = {}

    def lap(name: str) -> None:
        t.append(time.perf_counter())
        times[name] = (t[-1] - t[-2]) * 1000

    kill_all_but_init(cgroup_parent, sandbox_id, init_pid, kill_timeout)
    lap("kill")
    reuse = scratch_reusable(scratch)
    nroot = rootfs.with_name("rootfs.next")
    spare = scratch.with_name("scratch.next")
    nscratch = scratch if reuse else spare
    nupper, nwork = (scratch / "upper.next", scratch / "work.next") if reuse else \
        (nscratch / "upper", nscratch / "work")
    for d in (nroot, spare):
        if os.path.ismount(d):  # left by a reset that failed half-way (either path)
            syscalls.umount(str(d))
    for d in (nroot,) if reuse else (nroot, nscratch):
        d.mkdir(0o700, exist_ok=True)
    if reuse:
        for d in (nupper, nwork):  # left by a reset that failed half-way
            _rmtree(d)
    else:
        syscalls.mount_tmpfs(str(nscratch), disk, mode=0o700)
    tree_fd = -1
    try:
        os.mkdir(nupper, 0o755)
        os.mkdir(nwork, 0o755)
        syscalls.mount_overlay(str(nroot), lower_dirs, str(nupper), str(nwork))
        prepare_root(nroot, workdir, hosts)
        tree_fd = _sys(SYS_OPEN_TREE, AT_FDCWD, str(nroot).encode(), OPEN_TREE_CLONE | os.O_CLOEXEC)
        lap("mount")
        if not threading.current_thread().name.startswith("dsec-reset"):
            raise ResetError("reset_container runs on the reset workers (dsec.node.reset.executor())")
        try:
            _swap_root_in_namespace(init_pid, tree_fd, hostname)
        except OSError as e:
            raise ResetError(f"sandbox {sandbox_id}: root swap failed: {e}") from e
        restore_limits(cgroup_parent, sandbox_id, *limits)
    except BaseException:
        with contextlib.suppress(OSError):
            syscalls.umount(str(nroot))
        if not reuse:
            with contextlib.suppress(OSError):
                syscalls.umount(str(nscratch))
        raise
    finally:
        if tree_fd >= 0:
            os.close(tree_fd)
    lap("pivot")
    # Host side: the file API and checkpoints read <base>/rootfs and <scratch>/upper.
    syscalls.umount(str(rootfs))
    syscalls.mount(str(nroot), str(rootfs), "", MS_MOVE)
    if reuse:
        # The old overlay is unmounted everywhere and every process that could write
        # through it is dead: its upper and work dirs are plain files now. The new
        # overlay holds its dirs by reference, so renaming them does not disturb it.
        try:
            for name, new in (("upper", nupper), ("work", nwork)):
                _rmtree(scratch / name)
                os.rename(new, scratch / name)
        except (OSError, RecursionError) as e:  # the caller re-makes (reset) or tears down (recycle)
            raise ResetError(f"sandbox {sandbox_id}: the old writable layer could not be deleted: {e}") from e
    else:
        syscalls.umount(str(scratch))
        syscalls.mount(str(nscratch), str(scratch), "", MS_MOVE)
    lap("swap")
    times["total"] = (t[-1] - t[0]) * 1000
    times["scratch_reused"] = float(reuse)
    return times


# --- recycling: the same kernel sandbox under a new id, for another tenant ----------------
# A destroyed sandbox of a pool shape can go back to the warm pool instead of being torn
# down (issue 15: teardown + a cold refill were most of a short episode's cost). It gets a
# new id, so nothing keyed by the old one (ownership, audit, dead-id records, the old
# tenant's client) can reach it; its cgroups are renamed with it and their counters
# zeroed. The rest is the in-place reset above, plus the hostname (= the id).

# Counters a new tenant must not inherit, reset by writing 0 (cgroup v1). The rest
# (cpu.stat, memory.stat, pids.events) cannot be reset; they are visible to the host only:
# sandboxes get their own cgroup namespace and no cgroupfs mount.
_ZEROED: tuple[tuple[str, str], ...] = (
    ("cpuacct", "cpuacct.usage"), ("memory", "memory.max_usage_in_bytes"), ("memory", "memory.failcnt"),
    ("memory", "memory.memsw.max_usage_in_bytes"), ("memory", "memory.memsw.failcnt"))


_HIERARCHIES: list[tuple[Path, bool]] = []


def _hierarchies() -> list[tuple[Path, bool]]:
    """The mounted cgroup hierarchies and whether each is cgroup v2 (listed once: a
    recycle's hot path would otherwise stat every one of them per call)."""
    if not _HIERARCHIES and cgroups.CGROUP_ROOT.is_dir():
        _HIERARCHIES.extend((h, (h / "cgroup.controllers").exists()) for h in sorted(cgroups.CGROUP_ROOT.iterdir())
                            if h.is_dir())
    return _HIERARCHIES


def rename_cgroups(parent: str, old_id: str, new_id: str, init_pid: int, timeout: float = 2.0) -> None:
    """Move the sandbox's cgroups (only its init is left in them) to ``new_id`` and zero
    the resettable counters. cgroup v1 renames a populated cgroup in place (limits and
    device rules stay); cgroup v2 cannot rename, so there a new cgroup takes the init and
    the old one is removed (the hybrid unified hierarchy sets no limits here)."""
    for h, v2 in _hierarchies():
        d, new = h / parent / old_id, h / parent / new_id
        if not v2:
            try:
                os.rename(d, new)
            except FileNotFoundError:  # no cgroup of this sandbox in this hierarchy
                pass
            continue
        if not d.is_dir():
            continue
        new.mkdir(0o755, exist_ok=True)
        cgroups._write(new / "cgroup.procs", str(init_pid))
        deadline = time.monotonic() + timeout
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # a killed task still leaving
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)
    root = cgroups.CGROUP_ROOT
    for ctrl, f in _ZEROED:
        with contextlib.suppress(OSError):  # a controller or swap accounting not present here
            cgroups._write(root / ctrl / parent / new_id / f, "0")


def rename_paths(old: tuple[Path, Path, Path], new: tuple[Path, Path, Path]) -> None:
    """(sandbox dir, agent socket, runtime state dir) to their names under the new id. The
    mounts below the sandbox dir move with it; the init keeps its listening socket."""
    for a, b in zip(old, new):
        if os.path.lexists(a):
            os.rename(a, b)


def lower_dirs_of(rootfs: Path) -> list[str]:
    """The overlay lower dirs of the mount at ``rootfs`` (for sandboxes adopted after a
    restart, whose create-time mount options are not in memory)."""
    target = str(rootfs)
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            parts = line.split()
            if parts[4] == target and " - overlay " in line:
                opts = line.rsplit(" ", 1)[-1].strip().split(",")
                for o in opts:
                    if o.startswith("lowerdir="):
                        return [d.replace("\\072", ":") for d in o[len("lowerdir="):].split(":")]
    raise ResetError(f"no overlay mounted at {rootfs}")
