"""The node usage probe feeding the overcommit guard reads /proc/stat correctly."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.node.usage import (
    CpuUsageProbe,
    SandboxCpuProbe,
    busy_fraction,
    cgroup_busy_fraction,
    parse_proc_stat,
    read_cgroup_cpu_ns,
)

STAT = "cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 50 0 50 350 50 0 0 0 0 0\nintr 1\n"


def test_parse_counts_iowait_as_idle() -> None:
    """Total spans user..steal; idle includes iowait (a blocked CPU can run other work)."""
    assert parse_proc_stat(STAT) == (1000, 800)


def test_busy_fraction_between_samples() -> None:
    """Busy = 1 - idle delta / total delta, clamped; no elapsed time reads as idle."""
    assert busy_fraction((1000, 800), (2000, 1300)) == pytest.approx(0.5)
    assert busy_fraction((1000, 800), (1000, 800)) == 0.0


def test_missing_cpu_line_is_a_clear_error() -> None:
    """A stat file without the aggregate line names what is missing."""
    with pytest.raises(ValueError, match="'cpu' line"):
        parse_proc_stat("intr 1\n")


def test_probe_reports_delta_since_previous_call(tmp_path: Path) -> None:
    """Each call reports use since the previous call, not since boot."""
    f = tmp_path / "stat"
    f.write_text(STAT)
    probe = CpuUsageProbe(f)
    f.write_text("cpu  400 0 400 1000 200 0 0 0\n")
    assert probe("n") == pytest.approx(1 - 400 / 1000)
    assert probe("n") == 0.0


def test_sandbox_probe_reads_v1_cpuacct_and_v2_cpu_stat(tmp_path: Path) -> None:
    """Sandbox CPU use comes from the dsec parent cgroup (v1 cpuacct.usage in ns, or v2
    cpu.stat usage_usec), as a fraction of the node's CPUs over the elapsed wall time."""
    v1 = tmp_path / "v1"
    (v1 / "cpuacct" / "dsec").mkdir(parents=True)
    (v1 / "cpuacct" / "dsec" / "cpuacct.usage").write_text("0\n")
    assert read_cgroup_cpu_ns("dsec", v1) == 0
    v2 = tmp_path / "v2"
    (v2 / "dsec").mkdir(parents=True)
    (v2 / "dsec" / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    assert read_cgroup_cpu_ns("dsec", v2) == 1_500_000
    assert read_cgroup_cpu_ns("other", v2) is None
    t = [0.0]
    probe = SandboxCpuProbe("dsec", 2.0, v1, clock=lambda: t[0])
    (v1 / "cpuacct" / "dsec" / "cpuacct.usage").write_text(str(10**9))  # 1 CPU-second...
    t[0] = 1.0                                                           # ...in 1 s on 2 CPUs
    assert probe("n") == pytest.approx(0.5)
    assert cgroup_busy_fraction(10**9, 0.0, 2.0) == 0.0


def test_sandbox_probe_refuses_without_accounting(tmp_path: Path) -> None:
    """No cgroup accounting -> a clear error, so the caller falls back to /proc/stat."""
    with pytest.raises(FileNotFoundError, match="dsec"):
        SandboxCpuProbe("dsec", 2.0, tmp_path)


def test_sandbox_probe_counts_a_parent_not_made_yet_as_idle(tmp_path: Path) -> None:
    """A node whose parent cgroup does not exist yet (a fresh DSEC_CGROUP_PARENT, or the
    first serve on a host) still measures its sandboxes, not the whole machine: other jobs'
    load must not stop its admissions. The parent appears with the first sandbox."""
    (tmp_path / "cpuacct").mkdir()
    t = [0.0]
    probe = SandboxCpuProbe("fresh", 2.0, tmp_path, clock=lambda: t[0])
    t[0] = 1.0
    assert probe("n") == 0.0
    (tmp_path / "cpuacct" / "fresh").mkdir()
    (tmp_path / "cpuacct" / "fresh" / "cpuacct.usage").write_text(str(10**9))
    t[0] = 2.0
    assert probe("n") == pytest.approx(0.5)
