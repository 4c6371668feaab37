"""Pure helpers behind the CLI and demo: percentiles, labels, report summary."""

from __future__ import annotations

import pytest
import typer

from dsec.cli.common import human_bytes, parse_labels, percentile
from dsec.cli.demo import summarize
from dsec.cli.demo_tasks import TASKS, EpisodeResult, solution_file, unittest_file


def test_percentile_nearest_rank() -> None:
    """Nearest-rank percentiles: p50 of 1..100 is 50, p99 is 99, empty is 0."""
    xs = [float(i) for i in range(1, 101)]
    assert (percentile(xs, 50), percentile(xs, 99), percentile(xs, 100)) == (50.0, 99.0, 100.0)
    assert percentile([], 50) == 0.0 and percentile([3.0], 99) == 3.0


def test_parse_labels_and_sizes() -> None:
    """k=v labels parse (values may contain '='); malformed ones are refused by name."""
    assert parse_labels(["run=r1", "expr=a=b"]) == {"run": "r1", "expr": "a=b"}
    with pytest.raises(typer.BadParameter, match="nokey"):
        parse_labels(["nokey"])
    assert (human_bytes(512 * 2**20), human_bytes(8 * 2**30)) == ("512M", "8G")


def test_demo_summary_counts_failures_and_fixes() -> None:
    """The demo report counts passes, fixes after a failing test, failures and latency percentiles."""
    rs = [EpisodeResult(index=0, task="fib", start_s=0.1, tool_calls=5, exec_s=[0.01, 0.02], attempts=1, passed=True),
          EpisodeResult(index=1, task="fib", start_s=0.3, tool_calls=9, exec_s=[0.03], attempts=2, passed=True),
          EpisodeResult(index=2, task="fib", error="SandboxFailure: boom")]
    s = summarize(rs, 2.0, "python", "demo-x")
    assert (s["passed"], s["failed"], s["fixed_after_failing_test"], s["tool_calls"]) == (2, 1, 1, 14)
    assert s["start_ms"]["p50"] == 100.0 and s["exec_ms"]["max"] == 30.0
    assert s["errors"] == [{"episode": 2, "task": "fib", "error": "SandboxFailure: boom"}]


def test_demo_tasks_buggy_versions_differ() -> None:
    """Each task has a good and a buggy solution that really differ (so the fix loop is real)."""
    for task in TASKS:
        good, bad = solution_file(task, False), solution_file(task, True)
        assert good != bad and "def solve" in good and "unittest" in unittest_file(task)
        ns: dict = {}
        exec(compile(good.replace("if __name__ == '__main__':", "if False:"), task, "exec"), ns)  # noqa: S102
        assert callable(ns["solve"])
