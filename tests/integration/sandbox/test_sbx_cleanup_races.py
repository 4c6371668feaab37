"""Cleanup must survive resources vanishing under it: an orphaned `runc run` (its
manager was SIGKILLed) removes its own cgroups while the restarted manager is removing
them. The random-SIGKILL tests hit this rarely; this pins the exact interleaving."""

from __future__ import annotations

import os
import pathlib
from unittest import mock

import pytest

from dsec.node import cgroups
from dsec.ids import new_sandbox_id

pytestmark = pytest.mark.integration


def test_cgroup_removed_concurrently_is_not_an_error():
    """kill_and_remove treats a real cgroup dir that disappears between listing and
    scanning as removed, instead of failing the whole reconcile with ENOENT."""
    sid = new_sandbox_id()
    d = cgroups.CGROUP_ROOT / "pids" / "dsec" / sid
    d.mkdir(parents=True)
    real_scandir = pathlib.Path._scandir  # type: ignore[attr-defined]

    def vanish_first(self):  # the other party wins the race right before our scan
        if self == d and d.exists():
            os.rmdir(d)
        return real_scandir(self)

    try:
        with mock.patch.object(pathlib.Path, "_scandir", vanish_first):
            cgroups.kill_and_remove("dsec", sid)
    finally:
        if d.exists():
            d.rmdir()
    assert not d.exists()
