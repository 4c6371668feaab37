"""`dsec demo` end to end on a fresh DSEC_HOME: starts its own server, ensures the python
stock image, runs real coding-agent episodes, writes the report, leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from e2e_server import DSEC, reap_home

pytestmark = pytest.mark.integration


def test_demo_runs_real_episodes(tmp_path: Path) -> None:
    """Two episodes pass (one after fixing a failing test), both start from the warm pool
    the demo declared first (counted by the scheduler), the report is written, and the
    demo's server is gone with no sandbox mount left under DSEC_HOME."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
    env["DSEC_HOME"] = str(home)
    try:
        r = subprocess.run([DSEC, "demo", "-n", "2", "--json", "--report-dir", str(tmp_path / "reports")],
                           env=env, capture_output=True, text=True, timeout=900, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        s = json.loads(r.stdout)
        assert (s["episodes"], s["passed"], s["fixed_after_failing_test"]) == (2, 2, 1)
        assert s["tool_calls"] == 14 and s["start_ms"]["p50"] > 0 and s["exec_ms"]["p99"] > 0
        assert s["warm_pool"]["ready"] == 2 and s["warm_pool"]["hits"] == 2
        report = json.loads((tmp_path / "reports" / f"{s['run_id']}.json").read_text())
        assert len(report["episodes_detail"]) == 2
        assert "| episodes passed | 2/2 |" in (tmp_path / "reports" / f"{s['run_id']}.md").read_text()
        assert not (home / "server.json").exists()
        mounts = [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines()
                  if ln.split()[1].startswith(str(home / "sandboxes"))]
        assert mounts == []
    finally:
        reap_home(home)
