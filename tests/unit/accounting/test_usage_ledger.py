"""Accounting rules without a kernel: sample folding, SQLite aggregation by label and
tenant, bounded Prometheus values, per-label quota admission (issue 16)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsec.accounting.ledger import BoundedValues, UsageLedger, parse_labels, prom_label_name
from dsec.accounting.meter import Accum, Counters, advance, counter_delta
from dsec.accounting.store import UsageStore
from dsec.config import Settings
from dsec.errors import InvalidArgument, NotFound, QuotaExceeded
from dsec.models.usage import GIB, LabelQuota, SandboxUsage
from dsec.state.store import TenantRecord

MIB = 1 << 20


def test_advance_integrates_memory_and_counts_growth_only() -> None:
    """First sample is the baseline; CPU is the counter delta; memory the trapezoid; bytes
    written only the writable layer's growth (a delete is not negative writing)."""
    acc = Accum()
    assert advance(acc, Counters(t=0.0, cpu_ns=5_000_000_000, memory=GIB // 2, disk_used=100)) == (0.0, 0.0, 0)
    cpu, mem, written = advance(acc, Counters(t=2.0, cpu_ns=6_500_000_000, memory=int(GIB * 1.5), disk_used=300))
    assert cpu == pytest.approx(1.5) and mem == pytest.approx(2.0) and written == 200
    cpu, mem, written = advance(acc, Counters(t=3.0, cpu_ns=6_500_000_000, memory=None, disk_used=50))
    assert (cpu, written) == (0.0, 0) and mem == pytest.approx(1.5)
    assert acc.bytes_written == 200 and acc.cpu_seconds == pytest.approx(1.5)
    # A final sample with the cpu cgroup already gone keeps the last reading as baseline.
    advance(acc, Counters(t=4.0, cpu_ns=None, memory=None, disk_used=None))
    assert acc.last is not None and acc.last.cpu_ns == 6_500_000_000


def test_a_long_idle_gap_ramps_memory_only_over_the_last_interval() -> None:
    """An idle sandbox is sampled up to 30 s apart; a command at the end of such a gap
    brings it back to the 1 s interval. Its burst is billed over that last second, not as
    half the burst for the whole gap (that was ~9x too much); a gap no longer than the
    interval is still the plain trapezoid."""
    acc = Accum()
    advance(acc, Counters(t=0.0, cpu_ns=0, memory=10 * MIB, disk_used=0), ramp_s=1.0)
    _, mem, _ = advance(acc, Counters(t=26.0, cpu_ns=1, memory=510 * MIB, disk_used=0), ramp_s=1.0)
    assert mem * GIB == pytest.approx(10 * MIB * 25 + 260 * MIB * 1)
    _, mem, _ = advance(acc, Counters(t=26.5, cpu_ns=2, memory=110 * MIB, disk_used=0), ramp_s=1.0)
    assert mem * GIB == pytest.approx((510 + 110) / 2 * MIB * 0.5)


def test_a_stale_sample_is_ignored() -> None:
    """A sample read before the last folded one (two samplers raced) adds nothing: its
    lower CPU counter must not be taken for a re-created cgroup (all of it counted again)."""
    acc = Accum()
    advance(acc, Counters(t=1.0, cpu_ns=1_000_000_000, memory=GIB, disk_used=0))
    advance(acc, Counters(t=3.0, cpu_ns=3_000_000_000, memory=GIB, disk_used=0))
    assert advance(acc, Counters(t=2.0, cpu_ns=2_000_000_000, memory=GIB, disk_used=0)) == (0.0, 0.0, 0)
    assert acc.cpu_seconds == pytest.approx(2.0) and acc.memory_gb_seconds == pytest.approx(2.0)


def test_counter_delta_survives_a_recreated_cgroup() -> None:
    """A counter that went backwards (gVisor reset re-made the cgroup) counts from zero."""
    assert counter_delta(None, 10) == 0 and counter_delta(10, 15) == 5 and counter_delta(15, 4) == 4


def test_bounded_values_cap_distinct_values() -> None:
    """Past the cap, new values share '_other'; known values keep theirs; keys not exported
    never appear; label names are valid Prometheus identifiers."""
    b = BoundedValues(["run", "tenant"], cap=2)
    assert b.key_of({"run": "a"}, "t") == ("a", "t")
    assert b.key_of({"run": "b"}, "t") == ("b", "t")
    assert b.key_of({"run": "c", "task": "x"}, "t") == ("_other", "t")
    assert b.key_of({"run": "a"}, "t") == ("a", "t")
    assert b.key_of({}, "t") == ("", "t")
    assert prom_label_name("run.id") == "run_id" and prom_label_name("9x") == "l_9x"
    assert prom_label_name("__x") == "l_x"


def _usage(sid: str, labels: dict[str, str], cpu: float, ended: float | None = None) -> SandboxUsage:
    return SandboxUsage(sandbox_id=sid, labels=labels, started_at=1.0, ended_at=ended, sandboxes=1, cpu_seconds=cpu,
                        memory_gb_seconds=cpu * 2, exec_count=1, bytes_written=10, sandbox_seconds=5.0)


def test_store_totals_groups_and_tenancy(tmp_path: Path) -> None:
    """Totals match every label of the filter, an unknown label matches nothing, groups
    total per value, and another tenant's rows are never counted; rows persist."""
    path = tmp_path / "state.db"
    st = UsageStore(path)
    st.upsert([("u1", "t1", _usage("a", {"run": "r1", "task": "x"}, 1.0)),
               ("u1", "t1", _usage("b", {"run": "r1", "task": "y"}, 2.0, ended=9.0)),
               ("u1", "t1", _usage("c", {"run": "r2"}, 4.0)),
               ("u2", "t2", _usage("d", {"run": "r1"}, 8.0))])
    st.upsert([("u1", "t1", _usage("a", {"run": "r1", "task": "x"}, 1.5))])  # a later flush of a live one
    st.close()
    st = UsageStore(path)
    assert st.totals("u1", {"run": "r1"}).cpu_seconds == pytest.approx(3.5)
    assert st.totals("u1", {"run": "r1", "task": "y"}).sandboxes == 1
    assert st.totals("u1", {"nope": "x"}).sandboxes == 0
    assert st.totals("u2", {}).cpu_seconds == pytest.approx(8.0)
    assert [(g.value, g.totals.sandboxes) for g in st.groups("u1", {}, "task")] == [("", 1), ("x", 1), ("y", 1)]
    assert {s.sandbox_id for s in st.sandboxes("u1", {"run": "r1"}, 10)} == {"a", "b"}
    assert sorted(st.open_sandboxes()) == ["a", "c", "d"]
    assert st.prune(ended_before=10.0) == 1 and st.totals("u1", {"run": "r1"}).sandboxes == 1


def test_parse_labels_names_the_bad_item() -> None:
    assert parse_labels(["run=r1", "a=b=c"]) == {"run": "r1", "a": "b=c"}
    with pytest.raises(InvalidArgument, match="'novalue'"):
        parse_labels(["novalue"])


def test_quota_model_needs_a_limit() -> None:
    with pytest.raises(ValueError, match="max_sandboxes"):
        LabelQuota(label="run=r1")
    with pytest.raises(ValueError):
        LabelQuota(label="run", max_sandboxes=1)


async def test_quota_admission_counts_live_and_pending(tmp_path: Path) -> None:
    """max_sandboxes counts live sandboxes with the label plus admitted creates not live
    yet (two racing creates cannot both take the last place); release frees the place;
    max_cpu_seconds refuses once the label's recorded CPU-seconds reach it; another
    tenant's quota or label value is independent."""
    settings = Settings(home=tmp_path)
    state: Any = SimpleNamespace(get_tenant=lambda name: None)  # owners come from the service's map
    ledger = UsageLedger(settings, state, UsageStore(tmp_path / "state.db"))
    t1 = TenantRecord(name="t1", uid="u1", token_hash="h1")
    t2 = TenantRecord(name="t2", uid="u2", token_hash="h2")
    await ledger.set_quota(t1, LabelQuota(label="run=r1", max_sandboxes=2))
    await ledger.admit(t1, {"run": "r1"}, "s1")
    await ledger.admit(t1, {"run": "r1", "task": "a"}, "s2")
    with pytest.raises(QuotaExceeded) as ei:
        await ledger.admit(t1, {"run": "r1"}, "s3")
    assert ei.value.details["quota"] == "max_sandboxes" and ei.value.details["label"] == "run=r1"
    await ledger.admit(t1, {"run": "r2"}, "s4")
    await ledger.admit(t2, {"run": "r1"}, "s5")
    ledger.release("s1")
    await ledger.admit(t1, {"run": "r1"}, "s3")
    ledger.store.upsert([("u1", "t1", _usage("old", {"run": "r9"}, 5.0, ended=2.0))])
    await ledger.set_quota(t1, LabelQuota(label="run=r9", max_cpu_seconds=5.0))
    with pytest.raises(QuotaExceeded) as ei:
        await ledger.admit(t1, {"run": "r9"}, "s6")
    assert ei.value.details["quota"] == "max_cpu_seconds" and "run=r9" in ei.value.message
    await ledger.set_quota(t1, LabelQuota(label="run=r9", max_cpu_seconds=6.0))
    await ledger.admit(t1, {"run": "r9"}, "s6")
    assert [q.label for q in ledger.quotas(t1)] == ["run=r1", "run=r9"] and ledger.quotas(t2) == []
    await ledger.delete_quota(t1, "run=r9")
    with pytest.raises(NotFound):
        await ledger.delete_quota(t1, "run=r9")
    # Quotas are persisted: a new ledger (server restart) enforces them.
    again = UsageLedger(settings, state, UsageStore(tmp_path / "state.db"))
    again._quotas = await asyncio.to_thread(again.store.quotas)
    assert [q.label for q in again.quotas(t1)] == ["run=r1"]
    ledger.store.close()
    again.store.close()


def test_exec_counts_only_tracked_sandboxes(tmp_path: Path) -> None:
    """count_exec of an unknown sandbox is ignored (no entry is invented)."""
    ledger = UsageLedger(Settings(home=tmp_path), SimpleNamespace(), UsageStore(":memory:"))  # type: ignore[arg-type]
    ledger.count_exec("sb-unknown")
    assert ledger.live == {} and ledger.collector.values == {}


async def test_idle_sandboxes_are_sampled_rarely_busy_ones_every_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Density (issue 15): with 1,000 idle sandboxes, reading every cgroup each interval
    kept a worker thread busy ~30 % of a core and slowed every exec (GIL). Sampling is
    O(sandboxes whose counters move): an idle one backs off to ``usage_idle_sample_max_s``,
    a busy one is read every interval, an exec brings an idle one back at once, and its
    memory GiB-s stay exact (steady memory over a long interval); a report is up to date."""
    from dsec.accounting import ledger as ledger_mod
    from dsec.accounting.ledger import _Entry

    now = [0.0]
    reads: dict[str, int] = {}

    def fake_read(parent: str, sid: str, scratch: Path, t: float) -> Counters:
        reads[sid] = reads.get(sid, 0) + 1
        busy = sid.startswith("busy")
        return Counters(t=now[0], cpu_ns=int(now[0] * 1e6) if busy else 5, memory=GIB, disk_used=0)

    monkeypatch.setattr(ledger_mod, "read_counters", fake_read)
    settings = Settings(home=tmp_path, usage_sample_interval_s=1.0, usage_idle_sample_max_s=8.0)
    ledger = UsageLedger(settings, SimpleNamespace(), UsageStore(":memory:"))  # type: ignore[arg-type]
    ledger.clock = lambda: now[0]
    for i in range(100):
        sid = f"busy-{i}" if i < 10 else f"idle-{i}"
        e = _Entry(sandbox_id=sid, tenant_uid="u1", tenant_name="t1", labels={}, started_at=0.0, scratch=tmp_path)
        e.acc.last, e.interval = fake_read("", sid, tmp_path, 0.0), 1.0
        e.due = 1.0
        ledger.live[sid] = e
    reads.clear()
    for step in range(1, 61):
        now[0] = float(step)
        await ledger.sample()
    assert all(reads[f"busy-{i}"] == 60 for i in range(10))
    idle_reads = sum(n for s, n in reads.items() if s.startswith("idle"))
    assert idle_reads <= 90 * 12, idle_reads  # 1, 2, 4, 8, 8, ... s apart: ~11 each, not 60
    # Exact memory GiB-s over the backed-off intervals (1 GiB held, sampled up to t=57).
    last = ledger.live["idle-50"].acc.last
    assert last is not None and ledger.live["idle-50"].acc.memory_gb_seconds == pytest.approx(last.t)
    # An exec makes an idle sandbox due at the base interval again.
    ledger.count_exec("idle-50")
    before = reads["idle-50"]
    now[0] = 61.0
    await ledger.sample()
    assert reads["idle-50"] == before + 1
    # A report samples the tenant's live sandboxes first: totals are those of now.
    now[0] = 62.5
    tenant = TenantRecord(name="t1", uid="u1", token_hash="h1")
    rep = await ledger.report(tenant, {})
    assert rep.totals.memory_gb_seconds == pytest.approx(100 * 62.5)
    ledger.store.close()


def test_cgroup_counters_read_v1_then_v2(tmp_path: Path) -> None:
    """The sampler's plain-os readers (issue 15: cheap enough for 1,000 sandboxes) read
    cgroup v1 files first, else v2 (cpu.stat usage_usec -> ns), and None when the cgroup
    is gone or a file is junk."""
    from dsec.accounting.meter import read_cpu_ns, read_memory

    v1 = tmp_path / "v1"
    (v1 / "cpuacct" / "dsec" / "sb-1").mkdir(parents=True)
    (v1 / "memory" / "dsec" / "sb-1").mkdir(parents=True)
    (v1 / "cpuacct" / "dsec" / "sb-1" / "cpuacct.usage").write_text("123456789\n")
    (v1 / "memory" / "dsec" / "sb-1" / "memory.usage_in_bytes").write_text("4096\n")
    assert (read_cpu_ns("dsec", "sb-1", v1), read_memory("dsec", "sb-1", v1)) == (123456789, 4096)
    v2 = tmp_path / "v2"
    (v2 / "dsec" / "sb-2").mkdir(parents=True)
    (v2 / "dsec" / "sb-2" / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    (v2 / "dsec" / "sb-2" / "memory.current").write_text("8192\n")
    assert (read_cpu_ns("dsec", "sb-2", v2), read_memory("dsec", "sb-2", v2)) == (1_500_000, 8192)
    (v2 / "dsec" / "sb-2" / "memory.current").write_text("junk\n")
    assert read_memory("dsec", "sb-2", v2) is None
    assert (read_cpu_ns("dsec", "sb-gone", v2), read_memory("dsec", "sb-gone", v1)) == (None, None)


async def test_cpu_quota_check_reads_only_the_sandboxes_it_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A create under a max_cpu_seconds quota samples the tenant's sandboxes with that
    label only (issue 15: with 1,000 live sandboxes it read all 1,000 cgroups per create)."""
    from dsec.accounting import ledger as ledger_mod
    from dsec.accounting.ledger import _Entry

    reads: list[str] = []

    def fake_read(parent: str, sid: str, scratch: Path, t: float) -> Counters:
        reads.append(sid)
        return Counters(t=t, cpu_ns=10**9, memory=0, disk_used=0)

    monkeypatch.setattr(ledger_mod, "read_counters", fake_read)
    ledger = UsageLedger(Settings(home=tmp_path), SimpleNamespace(), UsageStore(":memory:"))  # type: ignore[arg-type]
    for i in range(50):
        sid = f"sb-{i}"
        labels = {"run": "r9"} if i < 3 else {"run": "other"}
        ledger.live[sid] = _Entry(sandbox_id=sid, tenant_uid="u1" if i != 2 else "u2", tenant_name="t",
                                  labels=labels, started_at=0.0, scratch=tmp_path)
    t1 = TenantRecord(name="t1", uid="u1", token_hash="h1")
    await ledger.set_quota(t1, LabelQuota(label="run=r9", max_cpu_seconds=100.0))
    await ledger.admit(t1, {"run": "r9"}, "sb-new")
    assert sorted(reads) == ["sb-0", "sb-1"]
    ledger.store.close()
