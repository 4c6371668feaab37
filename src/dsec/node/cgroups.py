"""Cgroup v1/v2-hybrid helpers used from the host side.

runc manages its own cgroups for the container tier. gVisor runs with
``--ignore-cgroups`` here (runsc cannot drive hybrid hierarchies), so its limits are
applied by putting the runsc sandbox processes into cgroups we create. The freezer is
used to pause a sandbox for a consistent filesystem checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cpuacct: no limit, but usage accounting (dsec.accounting) reads CPU time there, as for runc.
_LIMIT_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer")


def sandbox_cgroup_dirs(parent: str, sandbox_id: str) -> list[Path]:
    """Every existing cgroup dir of a sandbox across mounted hierarchies."""
    if not CGROUP_ROOT.is_dir():
        return []
    return [d for h in CGROUP_ROOT.iterdir() if (d := h / parent / sandbox_id).is_dir()]


def all_sandbox_cgroup_ids(parent: str) -> set[str]:
    ids: set[str] = set()
    if CGROUP_ROOT.is_dir():
        for h in CGROUP_ROOT.iterdir():
            base = h / parent
            if base.is_dir():
                ids.update(p.name for p in base.iterdir() if p.is_dir())
    return ids


def _write(path: Path, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def create_limited(parent: str, sandbox_id: str, memory: int, cpu: float, pids: int) -> list[Path]:
    """Create host-side cgroups with the sandbox's limits (gVisor tier)."""
    made = []
    for ctrl in _LIMIT_CONTROLLERS:
        d = CGROUP_ROOT / ctrl / parent / sandbox_id
        if not (CGROUP_ROOT / ctrl).is_dir():
            continue
        d.mkdir(parents=True, exist_ok=True)
        made.append(d)
    mem = CGROUP_ROOT / "memory" / parent / sandbox_id
    if mem.is_dir():
        _write(mem / "memory.limit_in_bytes", str(memory))
        try:
            _write(mem / "memory.memsw.limit_in_bytes", str(memory))
        except OSError:
            pass  # swap accounting off on this kernel: memory limit alone holds
    cpu_dir = CGROUP_ROOT / "cpu" / parent / sandbox_id
    if cpu_dir.is_dir():
        _write(cpu_dir / "cpu.cfs_period_us", "100000")
        _write(cpu_dir / "cpu.cfs_quota_us", str(max(1000, int(cpu * 100000))))
    pids_dir = CGROUP_ROOT / "pids" / parent / sandbox_id
    if pids_dir.is_dir():
        _write(pids_dir / "pids.max", str(pids))
    return made


def add_pid(parent: str, sandbox_id: str, pid: int) -> None:
    for d in sandbox_cgroup_dirs(parent, sandbox_id):
        try:
            _write(d / "cgroup.procs", str(pid))
        except OSError:
            pass  # the process may have exited already


def pids_in(parent: str, sandbox_id: str) -> set[int]:
    found: set[int] = set()
    for d in sandbox_cgroup_dirs(parent, sandbox_id):
        try:
            found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return found


def set_frozen(parent: str, sandbox_id: str, frozen: bool, timeout: float = 5.0) -> None:
    d = CGROUP_ROOT / "freezer" / parent / sandbox_id
    if not d.is_dir():
        raise FileNotFoundError(f"no freezer cgroup for sandbox {sandbox_id}")
    want = "FROZEN" if frozen else "THAWED"
    _write(d / "freezer.state", want)
    deadline = time.monotonic() + timeout
    while (d / "freezer.state").read_text().strip() != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sandbox {sandbox_id} did not become {want}")
        time.sleep(0.001)


def thaw(parent: str, sandbox_id: str) -> None:
    """Best effort: let a sandbox left frozen (a server killed mid-capture) run again, so
    its processes can be killed (a frozen task ignores SIGKILL until thawed)."""
    try:
        _write(CGROUP_ROOT / "freezer" / parent / sandbox_id / "freezer.state", "THAWED")
    except OSError:
        pass


def kill_and_remove(parent: str, sandbox_id: str, timeout: float = 5.0) -> int:
    """SIGKILL everything left in the sandbox's cgroups, then remove them. Returns dirs removed."""
    deadline = time.monotonic() + timeout
    removed = 0
    thaw(parent, sandbox_id)  # first: frozen tasks cannot die, whichever hierarchy is emptied first
    for d in sorted(sandbox_cgroup_dirs(parent, sandbox_id), key=lambda p: -len(p.parts)):
        while True:
            try:
                subs = sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            except FileNotFoundError:
                break  # removed under us: a runtime (e.g. an orphaned `runc run`) cleaned it up
            for sub in subs:
                try:
                    sub.rmdir()
                except OSError:
                    pass
            try:
                procs = [int(x) for x in (d / "cgroup.procs").read_text().split()]
            except OSError:
                procs = []
            for pid in procs:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            if (d / "freezer.state").exists() and procs:
                try:
                    _write(d / "freezer.state", "THAWED")  # frozen tasks cannot die
                except OSError:
                    pass
            try:
                d.rmdir()
                removed += 1
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.002)
    return removed
