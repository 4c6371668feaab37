"""`dsec bench cli` runs end to end: the CLI and `podman run --rm` measured in one run."""

from __future__ import annotations

import shutil

import pytest

from dsec.bench.cli import TARGETS_MS, run

pytestmark = pytest.mark.integration


@pytest.mark.skipif(shutil.which("podman") is None, reason="needs podman (scripts/setup.sh installs it)")
def test_cli_bench_measures_both_sides() -> None:
    """Every case is timed each round (real processes: a server answering `ps`, a sandbox
    per `run`, a podman container per baseline) and each target gets a verdict."""
    r = run(rounds=2, progress=lambda _: None)
    for case in ("python_startup", "dsec_help", "dsec_ps", "dsec_run_true", "podman_run_rm_true"):
        assert r[case]["n"] == 2 and r[case]["min_ms"] > 0, case
    # No Python CLI starts faster than the interpreter alone; a sandbox run costs more than a listing.
    assert r["dsec_help"]["min_ms"] > r["python_startup"]["min_ms"]
    assert set(r["targets_met"]) == set(TARGETS_MS)
