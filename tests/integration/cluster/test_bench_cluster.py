"""`dsec bench cluster` runs end to end (tiny): the real scheduler driver places creates
over fake node agents in-process and as Ray actors on a local Ray instance, in one run.
No timing is asserted; the figures must be sane and every counted placement real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")

DSEC = str(Path(sys.executable).parent / "dsec")


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`dsec bench cluster ARGS` in its own process group: on a timeout the whole group
    (the local Ray instance it started included) is killed, so nothing is left behind."""
    p = subprocess.Popen([DSEC, "bench", "cluster", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"dsec bench cluster {' '.join(args)} did not finish in {timeout:g}s: {err[-2000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_bench_cluster_places_through_the_driver_on_both_sides(tmp_path: Path) -> None:
    """3 nodes, 60 placements: both runs place all 60 through the driver, the agents hold
    exactly those sandboxes; the Ray side ran one agent process per node, once over the
    agents' direct data endpoints (as `dsec serve --cluster`) and once with every call an
    actor call, which coalesces control calls (more than one per round trip); the ratio
    and the report file are written; and bad sizes are refused with a message naming the option."""
    r = _bench("--nodes", "3", "--placements", "60", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "cluster-bench.json").read_text())
    for side in ("in_process", "ray", "ray_actor_calls"):
        x = report[side]
        assert x["placements"] == 60 and x["held_by_agents"] == 60 and x["missing"] == [], (side, x)
        assert x["per_s"] > 0 and x["latency_ms"]["p50"] > 0 and x["nodes"] == 3, (side, x)
        assert x["scheduler_stats"]["failed"] == 0, (side, x)
        assert x["driver_cpu_ms_per_placement"] > 0 and x["per_s_per_driver_core"] > 0, (side, x)
    ray, calls = report["ray"], report["ray_actor_calls"]
    assert ray["actor_processes"] == 3
    assert ray["transport"].startswith("direct ") and not ray["transport"].startswith("direct 0 "), ray
    assert calls["transport"].startswith("direct 0 /"), calls
    assert calls["calls_per_round_trip"] > 1, calls  # the actor-call path coalesces
    assert set(ray["cpu_s"]) == {"driver", "agents", "ray_system"}
    assert report["ray_vs_in_process"] == round(ray["per_s"] / report["in_process"]["per_s"], 3)
    assert "| driver + fake agents as Ray actors (direct data endpoint) | 3 | 60 |" in r.stdout

    bad = _bench("--nodes", "2", "--placements", "500", "--no-ray", "--out", str(tmp_path))
    assert bad.returncode != 0 and "--placements 500" in bad.stdout + bad.stderr
