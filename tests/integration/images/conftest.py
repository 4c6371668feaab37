"""Fixtures for image integration tests: a fresh store (tmp DSEC_HOME) with busybox."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.config import load_settings
from dsec.images import ImageStore
from dsec.images.stock import ensure_busybox


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def store(home: Path) -> ImageStore:
    s = load_settings(home=home)
    st = ImageStore(home / "images", s)
    ensure_busybox(st, log=lambda m: None)
    return st


def snapshot_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
