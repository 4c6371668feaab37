"""A small ``dsec drill --host node``: real runc sandboxes, real SIGKILLs, real restarts.

The full drill (1,000 faults) runs from the CLI; this keeps the same machinery honest in
CI with a handful of faults of every kind.
"""

from __future__ import annotations

import pytest

from dsec.bench.drill import FAULT_KINDS
from dsec.bench.drill_run import DrillConfig, run_drill, summary

pytestmark = pytest.mark.integration


def test_node_drill_recovers_every_episode_exactly(tmp_path):
    """Under every fault kind (server SIGKILL/restart with its node agent, SIGKILL of a
    runc sandbox's processes, full checkpoint disk, corrupt replica, write cut half-way)
    every episode resumes and ends with the trajectory of its fault-free run, no
    acknowledged step re-executed, and no sandbox or mount left behind."""
    cfg = DrillConfig(work=tmp_path / "work", episodes=2, steps=8, faults=len(FAULT_KINDS), seed=7,
                      fault_interval_s=0.3, host_kind="node", deadline_s=240)
    res = run_drill(cfg)
    s = summary(cfg, res)
    assert set(s["faults_by_kind"]) == set(FAULT_KINDS), s["faults_by_kind"]
    assert s["episodes"] >= 2 and s["episodes_verified"] == s["episodes"], s["mismatched"]
    assert s["steps_reexecuted"] == 0
