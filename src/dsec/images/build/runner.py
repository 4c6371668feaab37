"""RUN-step backends. ``BuildRunner`` runs argv in a fresh sandbox whose root is an
overlay of given lower dirs and returns the exit code, output and the upper dir.

``UnshareRunner`` (first backend): ``unshare --mount --pid --fork --uts --ipc [--net]``
runs a host script that mounts the overlay, /proc and a minimal /dev (null, zero, full,
random, urandom, tty bind-mounted onto a tmpfs) inside the new mount namespace, then
``unshare --root R --wd WD`` chroots into it. All mounts die with the namespace, so
nothing leaks if the step is killed. Isolation is weaker than a runc sandbox (root in
the chroot, no seccomp/cgroups): fine for admin-authored build specs, and
``ManagerRunner`` (the node's SandboxManager) is the stronger backend.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dsec.config import Settings
from dsec.errors import InvalidArgument

DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass
class RunResult:
    exit_code: int
    output: str
    upper_dir: Path          # valid until ``release()``: the builder commits it first
    timed_out: bool = False
    release: Callable[[], None] = field(default=lambda: None)


class BuildRunner(Protocol):
    def run(self, lower_dirs: list[Path], argv: list[str], *, env: list[str], workdir: str, network: bool,
            timeout_s: float, scratch: Path, base_ref: str, extra_lower_dirs: list[Path]) -> RunResult:
        """Run ``argv`` in a fresh sandbox whose root is overlay(lower_dirs, top-most first),
        which is the same tree as image ``base_ref`` with ``extra_lower_dirs`` (the layers
        built so far, top-most first) on top; a backend uses whichever form it needs.
        ``scratch`` is an empty dir owned by the caller (removed by it afterwards)."""
        ...


_SCRIPT = r"""
set -e
R="$1"; LOWER="$2"; UPPER="$3"; WORK="$4"; WD="$5"; shift 5
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$UPPER,workdir=$WORK,index=off,metacopy=off,xino=off" "$R"
[ -d "$R/proc" ] || mkdir "$R/proc"
[ -d "$R/dev" ] || mkdir "$R/dev"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -t tmpfs -o nosuid,mode=755,size=65536k dev "$R/dev"
for d in DEVNODES; do : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mkdir -p "$R/dev/shm" "$R/dev/pts"; ln -s /proc/self/fd "$R/dev/fd"
hostname dsec-build 2>/dev/null || true
[ -n "$NETWORK" ] || ip link set lo up 2>/dev/null || true
exec unshare --root "$R" --wd "$WD" -- "$@"
""".replace("DEVNODES", " ".join(DEV_NODES))


class UnshareRunner:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def run(self, lower_dirs: list[Path], argv: list[str], *, env: list[str], workdir: str, network: bool,
            timeout_s: float, scratch: Path, base_ref: str = "", extra_lower_dirs: list[Path] | None = None
            ) -> RunResult:
        root, upper, work = scratch / "root", scratch / "upper", scratch / "work"
        for d in (root, upper, work):
            d.mkdir(parents=True, exist_ok=True)
        flags = ["--mount", "--pid", "--fork", "--uts", "--ipc", "--propagation", "private"]
        if not network:
            flags.append("--net")
        cmd = ["unshare", *flags, "--", "/bin/sh", "-c", _SCRIPT, "build-step", str(root),
               ":".join(str(p) for p in lower_dirs), str(upper), str(work), workdir or "/", *argv]
        child_env = dict(e.split("=", 1) for e in env if "=" in e)
        child_env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        # The host script itself needs host tools on PATH (mount, ip, unshare).
        child_env["PATH"] = child_env["PATH"] + ":/usr/sbin:/usr/bin:/sbin:/bin"
        if network:
            child_env["NETWORK"] = "1"
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, start_new_session=True)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # our own process group: the step's pid ns dies with it
            out, _ = proc.communicate()
        limit = self.settings.image_build_output_max_bytes
        text = out[-limit:].decode(errors="replace")
        return RunResult(proc.returncode if not timed_out else -9, text, upper, timed_out)


def make_runner(kind: str, store: object) -> BuildRunner:
    settings: Settings = store.settings  # type: ignore[attr-defined]
    if kind == "unshare":
        return UnshareRunner(settings)
    if kind == "manager":
        try:
            from dsec.images.build.manager_runner import ManagerRunner
        except ImportError:
            raise InvalidArgument("build backend 'manager' needs dsec.node.manager (not available in this "
                                  "build); use --backend unshare") from None
        return ManagerRunner(settings, store)  # type: ignore[call-arg]
    raise InvalidArgument(f"unknown build backend {kind!r}; use 'unshare' or 'manager'")
