"""Node CPU use, sampled from /proc/stat, for the scheduler's usage-based overcommit guard."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CpuTimes = tuple[int, int]  # (total jiffies, idle jiffies incl. iowait)


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat -> (total, idle)."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:]]
            # user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
            total = sum(fields[:8])
            return total, fields[3] + (fields[4] if len(fields) > 4 else 0)
    raise ValueError("/proc/stat has no aggregate 'cpu' line")


def busy_fraction(before: CpuTimes, after: CpuTimes) -> float:
    """Fraction of all CPUs busy between two samples (0 when no time passed)."""
    total = after[0] - before[0]
    if total <= 0:
        return 0.0
    idle = after[1] - before[1]
    return min(1.0, max(0.0, 1.0 - idle / total))


class CpuUsageProbe:
    """Callable ``node_id -> busy fraction since the previous call`` for the local node."""

    def __init__(self, stat_path: Path = Path("/proc/stat")) -> None:
        self.path = stat_path
        self._last = parse_proc_stat(self.path.read_text())

    def __call__(self, _node_id: str) -> float:
        now = parse_proc_stat(self.path.read_text())
        frac = busy_fraction(self._last, now)
        self._last = now
        return frac


def cgroup_busy_fraction(used_ns: int, wall_s: float, cpus: float) -> float:
    """CPU time a cgroup used over a wall interval, as a fraction of ``cpus`` CPUs."""
    if wall_s <= 0 or cpus <= 0:
        return 0.0
    return min(1.0, max(0.0, used_ns / 1e9 / (wall_s * cpus)))


def read_small_file(path: str) -> bytes | None:
    """A small cgroup/proc file (None if unreadable), with plain os calls: the usage
    ledger reads these for every sampled sandbox, and pathlib's objects cost ~6x the
    syscalls in held GIL time."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_int(data: bytes | None) -> int | None:
    try:
        return int(data) if data is not None else None
    except ValueError:
        return None


def read_cgroup_cpu_ns(parent: str, root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Total CPU time (ns) used by every cgroup under ``parent`` (v1 cpuacct.usage, else v2
    cpu.stat usage_usec); None when neither is readable (then the node-wide probe is used)."""
    got = parse_int(read_small_file(f"{root}/cpuacct/{parent}/cpuacct.usage"))
    if got is not None:
        return got
    for line in (read_small_file(f"{root}/{parent}/cpu.stat") or b"").splitlines():
        if line.startswith(b"usage_usec "):
            usec = parse_int(line.split()[1])
            return usec * 1000 if usec is not None else None
    return None


class SandboxCpuProbe:
    """Callable ``node_id -> fraction of the node's CPUs the sandboxes used since the last
    call``. The overcommit guard is about what sandboxes really use against what they
    reserved, so load outside them (the host's own jobs) does not stop admissions."""

    def __init__(self, parent: str, cpus: float, root: Path = Path("/sys/fs/cgroup"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.parent, self.cpus, self.root, self.clock = parent, cpus, root, clock
        first = read_cgroup_cpu_ns(parent, root)
        if first is None:
            # A parent not made yet (this node's first sandbox is still to come) has used no
            # CPU; only a host without CPU accounting at all falls back to /proc/stat.
            # (Before, a fresh parent meant whole-machine load: other jobs stopped admissions.)
            if not ((root / "cpuacct").is_dir() or (root / "cgroup.controllers").is_file()):
                raise FileNotFoundError(f"no CPU accounting for cgroup {parent!r} under {root}")
            first = 0
        self._last = (self.clock(), first)

    def __call__(self, _node_id: str) -> float:
        now, used = self.clock(), read_cgroup_cpu_ns(self.parent, self.root)
        if used is None:  # the parent cgroup was removed: nothing runs in it
            used = self._last[1]
        frac = cgroup_busy_fraction(used - self._last[1], now - self._last[0], self.cpus)
        self._last = (now, used)
        return frac


def local_usage_probe(parent: str, cpus: float) -> Callable[[str], float]:
    """The sandboxes' own CPU use when cgroup accounting is readable, else node-wide use."""
    try:
        return SandboxCpuProbe(parent, cpus)
    except (OSError, ValueError):
        return CpuUsageProbe()


def cgroup_cpu_seconds(parent: str, sandbox_id: str, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPU seconds one sandbox's cgroup used so far (v1 cpuacct or v2 cpu.stat); None if
    it has no accounting (already gone)."""
    ns = read_cgroup_cpu_ns(f"{parent}/{sandbox_id}", root)
    return None if ns is None else ns / 1e9


def mean_cpu_used(cpu_seconds: float, lifetime_s: float) -> float:
    """Average CPUs a sandbox kept busy over its life (its right-sizing sample)."""
    return cpu_seconds / lifetime_s if lifetime_s > 0 else 0.0
