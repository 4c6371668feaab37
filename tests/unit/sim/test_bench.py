"""The scheduler benchmark runs end to end on a small cluster and reports ratios that
follow what it measured (not a ratio compared with itself)."""

from __future__ import annotations

import time

import pytest

from dsec.bench.scheduler import run
from dsec.control.scheduler import Scheduler

DELAY_S = 0.2  # added to every next_batch of one policy


def _slow(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    real = Scheduler.next_batch

    def next_batch(self: Scheduler, now: float):  # type: ignore[no-untyped-def]
        if getattr(self.policy, "name", None) == policy:
            time.sleep(DELAY_S)
        return real(self, now)

    monkeypatch.setattr(Scheduler, "next_batch", next_batch)


@pytest.mark.parametrize("slowed", ["ours", "k8s"])
def test_bench_times_placement_and_ratio_follows_it(monkeypatch: pytest.MonkeyPatch, slowed: str) -> None:
    """Only time inside next_batch counts, per policy, and speedup_vs_k8s is ours over the
    baseline: slowing one policy's placement by DELAY_S per batch caps its decisions/s at
    placed / (batches x DELAY_S) whatever the machine's load, and turns the speed-up
    against it (a bench timing the wrong thing, or a ratio the wrong way up, fails)."""
    _slow(monkeypatch, slowed)
    requests, batch = 300, 100
    row = run(requests=requests, batch=batch, sizes=(30,))["sizes"]["30"]
    k8s_requests = max(1000, requests // 10)  # what run() gives the baseline
    bound = {"ours": requests / ((requests // batch) * DELAY_S),
             "k8s": k8s_requests / ((k8s_requests // batch) * DELAY_S)}[slowed]
    assert 0 < row[f"{slowed}_decisions_per_s"] <= bound
    assert row["ours_decisions_per_s"] > 0 and row["k8s_decisions_per_s"] > 0
    if slowed == "ours":
        assert row["speedup_vs_k8s"] < 1
    else:
        assert row["speedup_vs_k8s"] > 1
