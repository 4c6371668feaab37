"""Live clones: freeze a sandbox's writable layer into a read-only layer its clones stack
on (copy-on-write through overlayfs), pausing the sandbox only for a few syscalls.

Fast path (container tier, "freeze and stack"), with the sandbox frozen (cgroup freezer):

1. its scratch tmpfs (the overlay upper and work dirs) is *moved* (MS_MOVE, no copy) to
   ``HOME/clones/<layer>``: its upper dir is the frozen layer from now on;
2. a new scratch tmpfs (same size: the disk quota) and a new overlay are made, lower dirs =
   [frozen layer] + the sandbox's lowers, and the new overlay becomes the sandbox's root
   in its mount namespace with ``pivot_root`` (/proc, /dev, /sys and the agent bind are
   moved over, as ``dsec.node.reset`` does, but nothing is killed or cleaned);
3. the sandbox is thawed. It sees the same files; its next writes copy up into its new
   upper, so the frozen layer never changes again. Clones are ordinary creates with the
   frozen layer as an extra lower dir: no byte is copied, whatever the sandbox wrote.

A process of the sandbox that holds a file of the old root open for writing, a shared
writable mapping of one, or a working directory below the old root would go on writing
into the frozen layer. When one exists (and on the gVisor tier, whose gofer holds the old
root open), the slow path runs instead: the upper dir is copied (``cp -a``, whiteouts and
overlay xattrs kept) into a new tmpfs layer while the sandbox is frozen, and the sandbox
keeps its root. Either way clones see the files as they were at the freeze.

A frozen layer lives while any mount uses it: ``gc_layers`` unmounts the ones no overlay
in the mount table names (after teardowns and at start, so a crash leaks nothing).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec.node import cgroups, syscalls
from dsec.node.reset import (
    AT_FDCWD,
    CARRIED_MOUNTS,
    CLONE_FS,
    CLONE_NEWNS,
    MOVE_MOUNT_F_EMPTY_PATH,
    MS_MOVE,
    OPEN_TREE_CLONE,
    SYS_MOVE_MOUNT,
    SYS_OPEN_TREE,
    SYS_PIVOT_ROOT,
    SYS_SETNS,
    SYS_UNSHARE,
    _sys,
    prepare_root,
)

O_ACCMODE = 0o3
# mount(2) passes overlay options in one page: the lowerdir list must stay below it.
MAX_LOWERDIR = 3800


class CloneError(RuntimeError):
    """The layer could not be frozen (the sandbox is left as it was)."""


@dataclass
class FrozenLayer:
    """The read-only layer clones stack on, and what freezing it cost."""

    path: Path  # the dir to pass as the top extra lower dir of every clone
    mode: str  # "stack" (moved, no copy) or "copy"
    paused_ms: float  # how long the sandbox was frozen
    reason: str = ""  # why the copy path ran
    times: dict[str, float] = field(default_factory=dict)


def new_layer_name() -> str:
    return "ly-" + secrets.token_hex(8)


def layers_root(home: Path) -> Path:
    return home / "clones"


# --- deciding: can the sandbox's root be swapped under its processes? ---------------------


def writers_outside_root(pids: set[int], root_dev: int, init_pid: int) -> list[str]:
    """Why swapping the root would let the frozen layer change later ([] = safe): a
    process with a file on the old root open for writing, a shared writable mapping of
    one, or a cwd on it below "/" (pivot_root only moves cwds AT the old root)."""
    why: list[str] = []
    for pid in sorted(pids):
        proc = f"/proc/{pid}"
        try:
            if pid != init_pid:
                cwd, top = os.stat(f"{proc}/cwd"), os.stat(f"{proc}/root")
                if cwd.st_dev == root_dev and (cwd.st_dev, cwd.st_ino) != (top.st_dev, top.st_ino):
                    why.append(f"pid {pid} has its working directory on the root")
                    continue
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    st = os.stat(f"{proc}/fd/{fd}")
                    if st.st_dev != root_dev:
                        continue
                    with open(f"{proc}/fdinfo/{fd}") as fh:
                        flags = int(fh.readline().split()[1], 8)
                except (OSError, ValueError, IndexError):
                    continue
                if flags & O_ACCMODE:
                    why.append(f"pid {pid} has a file open for writing")
                    break
            else:
                with open(f"{proc}/maps") as fh:
                    dev = f"{os.major(root_dev):02x}:{os.minor(root_dev):02x}"
                    if any(len(p := ln.split()) > 3 and p[1][1] == "w" and p[1][3] == "s" and p[3] == dev
                           for ln in fh):
                        why.append(f"pid {pid} has a shared writable mapping of a file")
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile: nothing of it can write any more
    return why


# --- the fast path -------------------------------------------------------------------------


def _swap_root(init_pid: int, tree_fd: int, out: list[BaseException | str]) -> None:
    """On its own OS thread: enter the sandbox's mount namespace and make ``tree_fd`` its
    root, carrying its mounts over. Unlike a reset, nothing inside is touched."""
    try:
        _sys(SYS_UNSHARE, CLONE_FS)
        fd = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _sys(SYS_SETNS, fd, CLONE_NEWNS)
        finally:
            os.close(fd)
        stage = f"/.dsec/clone-{secrets.token_hex(6)}"
        os.mkdir(stage, 0o700)
        _sys(SYS_MOVE_MOUNT, tree_fd, b"", AT_FDCWD, stage.encode(), MOVE_MOUNT_F_EMPTY_PATH)
        for m in CARRIED_MOUNTS:
            syscalls.mount("/" + m, f"{stage}/{m}", "", MS_MOVE)
        os.chdir(stage)
        _sys(SYS_PIVOT_ROOT, b".", b".")
        syscalls.umount(".", syscalls.MNT_DETACH)
        os.chdir("/")
        out.append(stage)
    except BaseException as e:  # noqa: BLE001 - reported to the caller's thread
        out.append(e)


def _swap_root_on_thread(sandbox_id: str, init_pid: int, tree_fd: int, thread_name: str) -> str:
    """``_swap_root`` on a fresh OS thread (its setns must not touch ours); the stage dir it
    used, or CloneError naming the sandbox and the cause."""
    out: list[BaseException | str] = []
    th = threading.Thread(target=_swap_root, args=(init_pid, tree_fd, out), name=thread_name, daemon=True)
    th.start()
    th.join()
    if not out or not isinstance(out[0], str):
        raise CloneError(f"sandbox {sandbox_id}: root swap failed: {out[0] if out else 'thread died'}")
    return out[0]


def stack_layer(*, sandbox_id: str, init_pid: int, rootfs: Path, scratch: Path, lower_dirs: list[str],
                disk: int, workdir: str, layer_dir: Path) -> dict[str, float]:
    """Fast path, blocking; the sandbox must be frozen. Moves ``scratch`` to ``layer_dir``
    and gives the sandbox a new writable layer over it. Rolls back on failure."""
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    nscratch, nroot = scratch.with_name("scratch.next"), rootfs.with_name("rootfs.next")
    for d in (nroot, nscratch):
        if os.path.ismount(d):  # left by a reset or clone that failed half-way
            syscalls.umount(str(d))
        d.mkdir(0o700, exist_ok=True)
    layer_dir.mkdir(0o700)
    syscalls.mount(str(scratch), str(layer_dir), "", MS_MOVE)  # the old upper: frozen from here on
    moved = True
    tree_fd = -1
    try:
        syscalls.mount_tmpfs(str(nscratch), disk, mode=0o700)
        os.mkdir(nscratch / "upper", 0o755)
        os.mkdir(nscratch / "work", 0o755)
        syscalls.mount_overlay(str(nroot), [str(layer_dir / "upper"), *lower_dirs], str(nscratch / "upper"),
                               str(nscratch / "work"))
        prepare_root(nroot, workdir, None)
        tree_fd = _sys(SYS_OPEN_TREE, AT_FDCWD, str(nroot).encode(), OPEN_TREE_CLONE | os.O_CLOEXEC)
        times["mount"] = (time.perf_counter() - t0) * 1000
        stage = _swap_root_on_thread(sandbox_id, init_pid, tree_fd, f"dsec-clone-{sandbox_id}")
        # The stage dir was made in the old root, i.e. in the frozen layer: leave no trace.
        with contextlib.suppress(OSError):
            os.rmdir(f"{layer_dir}/upper{stage}")
        times["pivot"] = (time.perf_counter() - t0) * 1000
    except BaseException:
        for d in (nroot, nscratch):
            with contextlib.suppress(OSError):
                syscalls.umount(str(d))
        if moved:
            with contextlib.suppress(OSError):
                syscalls.mount(str(layer_dir), str(scratch), "", MS_MOVE)
            with contextlib.suppress(OSError):
                layer_dir.rmdir()
        raise
    finally:
        if tree_fd >= 0:
            os.close(tree_fd)
    # Host side: the file API, checkpoints and accounting read <base>/rootfs and <base>/scratch.
    syscalls.umount(str(rootfs))
    syscalls.mount(str(nroot), str(rootfs), "", MS_MOVE)
    syscalls.mount(str(nscratch), str(scratch), "", MS_MOVE)
    times["total"] = (time.perf_counter() - t0) * 1000
    return times


def reroot_fresh(*, sandbox_id: str, init_pid: int, rootfs: Path, scratch: Path, lower_dirs: list[str],
                 disk: int, workdir: str, hosts: bytes | None) -> dict[str, float]:
    """A fresh sandbox (just created or handed over from a warm pool: nothing ran in it)
    gets a root over ``lower_dirs`` (a clone's frozen layer on top): a new scratch tmpfs
    and overlay swapped in with pivot_root. Unlike a reset nothing needs killing or
    cleaning, so only the mounts are made. Blocking."""
    t0 = time.perf_counter()
    nscratch, nroot = scratch.with_name("scratch.next"), rootfs.with_name("rootfs.next")
    for d in (nroot, nscratch):
        if os.path.ismount(d):
            syscalls.umount(str(d))
        d.mkdir(0o700, exist_ok=True)
    tree_fd = -1
    try:
        syscalls.mount_tmpfs(str(nscratch), disk, mode=0o700)
        os.mkdir(nscratch / "upper", 0o755)
        os.mkdir(nscratch / "work", 0o755)
        syscalls.mount_overlay(str(nroot), lower_dirs, str(nscratch / "upper"), str(nscratch / "work"))
        prepare_root(nroot, workdir, hosts)
        tree_fd = _sys(SYS_OPEN_TREE, AT_FDCWD, str(nroot).encode(), OPEN_TREE_CLONE | os.O_CLOEXEC)
        _swap_root_on_thread(sandbox_id, init_pid, tree_fd, f"dsec-reroot-{sandbox_id}")
    except BaseException:
        for d in (nroot, nscratch):
            with contextlib.suppress(OSError):
                syscalls.umount(str(d))
        raise
    finally:
        if tree_fd >= 0:
            os.close(tree_fd)
    for old, new in ((rootfs, nroot), (scratch, nscratch)):
        syscalls.umount(str(old))
        syscalls.mount(str(new), str(old), "", MS_MOVE)
    return {"total": (time.perf_counter() - t0) * 1000}


# --- the slow path -------------------------------------------------------------------------


def copy_layer(upper: Path, layer_dir: Path, disk: int) -> None:
    """The sandbox's upper dir copied into a new tmpfs at ``layer_dir`` (whiteouts, overlay
    xattrs, owners and times kept). Blocking; the sandbox must be frozen."""
    layer_dir.mkdir(0o700)
    syscalls.mount_tmpfs(str(layer_dir), disk, mode=0o700)
    try:
        r = subprocess.run(["cp", "-a", "--preserve=all", "--", str(upper), str(layer_dir / "upper")],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise CloneError(f"copying the writable layer failed: {r.stderr.strip()[:500]}")
    except BaseException:
        with contextlib.suppress(OSError):
            syscalls.umount(str(layer_dir))
        with contextlib.suppress(OSError):
            layer_dir.rmdir()
        raise


def freeze_layer(*, home: Path, cgroup_parent: str, sandbox_id: str, isolation: str, init_pid: int | None,
                 rootfs: Path, scratch: Path, lower_dirs: list[str], disk: int, workdir: str,
                 layer_name: str | None = None) -> FrozenLayer:
    """Freeze the sandbox, turn its writable layer into a read-only layer (stacked when
    safe, else copied), thaw it. Blocking: call from a worker thread."""
    root = layers_root(home)
    root.mkdir(parents=True, exist_ok=True)
    layer_dir = root / (layer_name or new_layer_name())
    t0 = time.perf_counter()
    cgroups.set_frozen(cgroup_parent, sandbox_id, True)
    try:
        t_frozen = time.perf_counter()
        why: list[str] = ["gVisor tier"] if isolation == "gvisor" or not init_pid else []
        if not why:
            why = writers_outside_root(cgroups.pids_in(cgroup_parent, sandbox_id), os.stat(rootfs).st_dev,
                                       init_pid or 0)
        if not why:
            times = stack_layer(sandbox_id=sandbox_id, init_pid=init_pid or 0, rootfs=rootfs, scratch=scratch,
                                lower_dirs=lower_dirs, disk=disk, workdir=workdir, layer_dir=layer_dir)
            mode = "stack"
        else:
            copy_layer(scratch / "upper", layer_dir, disk)
            times, mode = {}, "copy"
    finally:
        cgroups.set_frozen(cgroup_parent, sandbox_id, False)
    paused = (time.perf_counter() - t_frozen) * 1000
    times["freeze"] = (t_frozen - t0) * 1000
    return FrozenLayer(path=layer_dir / "upper", mode=mode, paused_ms=paused, times=times,
                       reason="; ".join(why[:3]))


# --- lifetime ------------------------------------------------------------------------------


def layers_in_use(home: Path) -> set[str]:
    """Frozen layer dirs that some overlay in this mount namespace names (lower or upper)."""
    prefix = str(layers_root(home)) + "/"
    used: set[str] = set()
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            if " - overlay " not in line or prefix not in line:
                continue
            for opt in line.rsplit(" ", 1)[-1].strip().split(","):
                for d in opt.partition("=")[2].split(":"):
                    d = d.replace("\\072", ":")
                    if d.startswith(prefix):
                        used.add(d[len(prefix):].split("/", 1)[0])
    return used


def gc_layers(home: Path, keep: set[str] | frozenset[str] = frozenset()) -> int:
    """Unmount and remove frozen layers no mounted overlay uses (``keep``: being made).
    A lazy unmount: a mount detached earlier that still holds one keeps it alive."""
    root = layers_root(home)
    if not root.is_dir():
        return 0
    used = layers_in_use(home) | set(keep)
    removed = 0
    for d in root.iterdir():
        if d.name in used:
            continue
        with contextlib.suppress(OSError):
            if os.path.ismount(d):
                syscalls.umount(str(d))
            d.rmdir()
            removed += 1
    return removed
