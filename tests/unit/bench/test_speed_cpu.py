"""The episodes bench's CPU accounting (``dsec.bench.speed.cpu_per_episode``): issue 15 asks
where an episode's time goes on a shared 2-core box, so the row reports each party's CPU
per episode, the client's share and what the rest of the box used."""

from __future__ import annotations

import pytest

from dsec.bench.speed import cpu_per_episode


def test_cpu_per_episode_splits_server_client_sandboxes_and_the_rest() -> None:
    a = {"wall": 0.0, "server": 1.0, "server_children": 0.5, "client": 2.0, "sandboxes": 0.0, "machine": 10.0}
    b = {"wall": 10.0, "server": 6.0, "server_children": 0.5, "client": 3.0, "sandboxes": 2.0, "machine": 28.0}
    out = cpu_per_episode(a, b, 500, 2)
    assert out["ms_per_episode"] == {"server": 10.0, "server_children": 0.0, "client": 2.0, "sandboxes": 4.0}
    assert out["ours_ms_per_episode"] == 16.0
    assert out["other_ms_per_episode"] == pytest.approx(20.0)  # 18 s busy / 500 episodes = 36 ms, 16 ours
    assert out["client_share"] == 0.125
    assert out["machine_busy_cores"] == 1.8
    assert out["episodes_per_s_if_all_cores_ours"] == 125.0


def test_cpu_per_episode_without_cgroup_accounting_counts_no_sandbox_cpu() -> None:
    a = {"wall": 0.0, "server": 0.0, "server_children": 0.0, "client": 0.0, "sandboxes": None, "machine": 0.0}
    b = {"wall": 1.0, "server": 1.0, "server_children": 0.0, "client": 0.0, "sandboxes": None, "machine": 1.0}
    out = cpu_per_episode(a, b, 100, 2)
    assert out["ms_per_episode"]["sandboxes"] == 0.0 and out["other_ms_per_episode"] == 0.0
