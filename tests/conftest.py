"""Shared test fixtures.

Integration tests need root and real runc/runsc/overlayfs/netns. On a developer machine
without them they are skipped; in CI (CI=true) a missing prerequisite is a failure, so a
green CI always means the real thing ran.
"""

from __future__ import annotations

import os
import shutil

import pytest


def _missing_integration_prereqs() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("runc",):
        if shutil.which(tool) is None:
            missing.append(tool)
    return missing


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing_integration_prereqs()
    if not missing:
        return
    for item in items:
        if "integration" in item.keywords:
            if os.environ.get("CI") == "true":
                item.add_marker(pytest.mark.xfail(reason="", run=False, strict=True))
                raise pytest.UsageError(f"CI lacks integration prerequisites: {missing}")
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}"))
