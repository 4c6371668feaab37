"""Reading a sandbox's real counters and folding samples into totals.

I/O (cgroup files, statvfs of the writable layer's tmpfs) is in ``read_counters``;
everything else is pure, so the integration rules are unit-tested without a kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsec.models.usage import GIB
from dsec.node.usage import parse_int, read_cgroup_cpu_ns, read_small_file

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Counters:
    """One sample of a sandbox. ``None``: not readable (cgroup gone, not mounted)."""

    t: float
    cpu_ns: int | None
    memory: int | None
    disk_used: int | None


@dataclass
class Accum:
    """Running totals of one sandbox and the sample they were last advanced to."""

    cpu_seconds: float = 0.0
    memory_gb_seconds: float = 0.0
    bytes_written: int = 0
    last: Counters | None = None


def counter_delta(prev: int | None, now: int | None) -> int:
    """Growth of a monotonic counter; a counter that went backwards was re-created (a
    gVisor reset re-makes the cgroup), so all of ``now`` is new."""
    if now is None:
        return 0
    if prev is None:
        return 0  # the first reading is the baseline (use before hand-over is not billed)
    return now - prev if now >= prev else now


def advance(acc: Accum, now: Counters, ramp_s: float | None = None) -> tuple[float, float, int]:
    """Fold sample ``now`` into ``acc``; returns the (cpu s, GiB s, bytes) it added.

    Memory: trapezoid between samples (both readable) — a steady sandbox is exact, a
    changing one is off by at most the change within one interval. ``ramp_s``: the
    sampling interval of a busy sandbox. An idle one is sampled less often (it was steady
    at the last reading, and a command brings it back to ``ramp_s`` at once), so a longer
    gap holds the last reading and ramps only over its final ``ramp_s``: a 30 s idle gap
    ended by a burst is not billed as 30 s of half the burst. Bytes written: growth of the
    writable layer's used space (a shrink is not negative writing)."""
    prev = acc.last
    if prev is None:
        acc.last = now
        return 0.0, 0.0, 0
    if now.t <= prev.t:
        # Read before the sample already folded (two samplers raced: the loop and a quota
        # check): stale. Folding it would take its lower counter for a re-created cgroup.
        return 0.0, 0.0, 0
    cpu = counter_delta(prev.cpu_ns, now.cpu_ns) / 1e9
    dt = max(0.0, now.t - prev.t)
    if prev.memory is not None and now.memory is not None:
        ramp = dt if ramp_s is None else min(dt, ramp_s)
        mem = (prev.memory * (dt - ramp) + (prev.memory + now.memory) / 2 * ramp) / GIB
    elif now.memory is not None or prev.memory is not None:
        mem = (now.memory if now.memory is not None else prev.memory or 0) * dt / GIB
    else:
        mem = 0.0
    written = 0
    if prev.disk_used is not None and now.disk_used is not None and now.disk_used > prev.disk_used:
        written = now.disk_used - prev.disk_used
    acc.cpu_seconds += cpu
    acc.memory_gb_seconds += mem
    acc.bytes_written += written
    # Keep the last readable value of each counter: a final sample taken while the cgroup
    # is already half gone must not restart the baseline.
    acc.last = Counters(t=now.t, cpu_ns=now.cpu_ns if now.cpu_ns is not None else prev.cpu_ns,
                        memory=now.memory, disk_used=now.disk_used if now.disk_used is not None
                        else prev.disk_used)
    return cpu, mem, written


def next_interval(prev: Counters | None, now: Counters, interval: float, base: float, cap: float) -> float:
    """Seconds until a sandbox is sampled again: ``base`` while its counters move (or on
    the first reading), else double the last interval up to ``cap``.

    Why: an idle sandbox's CPU, memory and disk do not change, so reading its cgroup every
    ``base`` seconds only costs the server (1,000 idle sandboxes = thousands of file reads
    a second competing with the event loop for the GIL). Memory integration stays exact for
    a steady sandbox over any interval (the trapezoid of two equal readings)."""
    if prev is None or (now.cpu_ns, now.memory, now.disk_used) != (prev.cpu_ns, prev.memory, prev.disk_used):
        return base
    return min(cap, max(base, interval * 2))


def read_cpu_ns(parent: str, sandbox_id: str, root: Path = CGROUP_ROOT) -> int | None:
    """CPU time (ns) of one sandbox's cgroup: v1 cpuacct.usage, else v2 cpu.stat usage_usec."""
    return read_cgroup_cpu_ns(f"{parent}/{sandbox_id}", root)


def read_memory(parent: str, sandbox_id: str, root: Path = CGROUP_ROOT) -> int | None:
    """Current memory cgroup usage in bytes (v1 memory.usage_in_bytes, v2 memory.current)."""
    got = parse_int(read_small_file(f"{root}/memory/{parent}/{sandbox_id}/memory.usage_in_bytes"))
    if got is not None:
        return got
    return parse_int(read_small_file(f"{root}/{parent}/{sandbox_id}/memory.current"))


def read_disk_used(scratch: Path) -> int | None:
    """Bytes used on the sandbox's writable-layer tmpfs (its upper dir lives there)."""
    try:
        st = os.statvfs(scratch)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def read_counters(parent: str, sandbox_id: str, scratch: Path, t: float, root: Path = CGROUP_ROOT) -> Counters:
    if not os.path.ismount(scratch):
        disk = None  # torn down (or never made): an unmounted dir would read the host's disk
    else:
        disk = read_disk_used(scratch)
    return Counters(t=t, cpu_ns=read_cpu_ns(parent, sandbox_id, root),
                    memory=read_memory(parent, sandbox_id, root), disk_used=disk)
