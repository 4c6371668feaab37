"""Overcommit: usage windows and the admission rule."""

from __future__ import annotations

import pytest

from dsec.control.overcommit import UsageWindow, could_ever_fit, fits
from dsec.control.types import Node

from .helpers import GIB, req


def node(**kw: object) -> Node:
    n = Node("n", 10.0, 10 * GIB, 100 * GIB)
    for k, v in kw.items():
        setattr(n, k, v)
    return n


def test_predicted_is_long_mean_times_factor() -> None:
    """Predicted load = 10-min mean x 1.5 once the spike window has passed."""
    w = UsageWindow(30, 600, 1.5)
    for t in range(0, 600, 10):
        w.add(float(t), 0.4)
    assert w.long_mean() == pytest.approx(0.4)
    assert w.predicted() == pytest.approx(0.6)


def test_recent_spike_raises_prediction_at_once() -> None:
    """A spike in the last 30 s blocks admission before it moves the 10-min mean."""
    w = UsageWindow(30, 600, 1.5)
    for t in range(0, 600, 10):
        w.add(float(t), 0.1)
    for t in range(600, 630, 10):
        w.add(float(t), 0.95)
    assert w.long_mean() * 1.5 < 0.3
    assert w.predicted() == w.recent_mean() > 0.7


def test_old_samples_leave_both_windows() -> None:
    """Samples older than the windows no longer count (sliding)."""
    w = UsageWindow(30, 600, 1.5)
    w.add(0.0, 1.0)
    w.add(1000.0, 0.2)
    assert w.recent_mean() == pytest.approx(0.2)
    assert w.long_mean() == pytest.approx(0.2)


def test_bad_windows_rejected() -> None:
    """A predict window shorter than the usage window is a configuration error."""
    with pytest.raises(ValueError, match="overcommit_window_s"):
        UsageWindow(30, 10, 1.5)


def test_admit_up_to_ratio_of_capacity() -> None:
    """Below the threshold a node admits up to 1.3x its CPU, and not a bit more."""
    assert fits(node(used_cpu=11.0), req("a", cpu=2), 1.3, 0.85)
    assert not fits(node(used_cpu=11.5), req("a", cpu=2), 1.3, 0.85)


def test_nothing_admitted_above_threshold() -> None:
    """Predicted load at or above 85 % admits nothing, even on an empty node."""
    assert not fits(node(predicted=0.85), req("a", cpu=0.5), 1.3, 0.85)
    assert fits(node(predicted=0.84), req("a", cpu=0.5), 1.3, 0.85)


def test_disk_gpu_and_count_never_overcommitted() -> None:
    """Disk, GPU slices and the sandbox count are hard limits."""
    assert not fits(node(used_disk=95 * GIB), req("a"), 1.3, 0.85)
    assert not fits(node(count=5, max_sandboxes=5), req("a"), 1.3, 0.85)
    g = node(gpus={"mig-1g.10gb": 1}, gpu_used={"mig-1g.10gb": 1})
    assert not fits(g, req("a", gpu="mig-1g.10gb"), 1.3, 0.85)
    assert fits(node(gpus={"mig-1g.10gb": 1}), req("a", gpu="mig-1g.10gb"), 1.3, 0.85)
    assert not fits(node(), req("a", gpu="mig-1g.10gb"), 1.3, 0.85)


def test_could_ever_fit() -> None:
    """Impossible requests are recognised regardless of current load."""
    n = node(used_cpu=100.0)
    assert could_ever_fit(n, req("a", cpu=13), 1.3)
    assert not could_ever_fit(n, req("a", cpu=14), 1.3)
    assert not could_ever_fit(n, req("a", isolation="gvisor"), 1.3)
    assert not could_ever_fit(n, req("a", selector={"zone": "b"}), 1.3)
