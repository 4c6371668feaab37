"""The scheduler benchmark runs end to end on a small cluster and reports ratios."""

from __future__ import annotations

from dsec.bench.scheduler import run


def test_bench_reports_ours_and_baseline() -> None:
    """run() places requests with both policies and returns decisions/s and the speed-up."""
    out = run(requests=300, batch=100, sizes=(30,))
    row = out["sizes"]["30"]
    assert row["ours_decisions_per_s"] > 0 and row["k8s_decisions_per_s"] > 0
    assert row["speedup_vs_k8s"] == row["ours_decisions_per_s"] / row["k8s_decisions_per_s"]
