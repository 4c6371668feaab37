"""The README's commands as a non-root user: setup and test refuse at once and say what to run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from doc_blocks import ROOT

pytestmark = pytest.mark.integration  # switching to an unprivileged uid needs root


@pytest.mark.parametrize("script", ["setup.sh", "test.sh"])
def test_non_root_is_told_what_to_run(script: str, tmp_path: Path) -> None:
    """Run as uid 65534 (a copy of the script, so the user can read it): exit 1 before
    touching anything, naming root and the exact command (sudo when it exists, else su)."""
    (tmp_path / "scripts").mkdir()
    for name in ("setup.sh", "test.sh"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    tmp_path.chmod(0o755)
    (tmp_path / "scripts").chmod(0o755)
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash",
                        f"scripts/{script}", "--no-images"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert f"scripts/{script} must run as root" in r.stderr
    want = f"sudo scripts/{script} --no-images" if shutil.which("sudo") else f"su -c 'scripts/{script} --no-images'"
    assert want in r.stderr
    assert not (tmp_path / ".venv").exists()
