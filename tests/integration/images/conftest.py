"""Fixtures for image integration tests: a fresh store (tmp DSEC_HOME) with busybox, and a
real docker-registry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from registry_env import Registry

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


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """A real docker-registry on a free loopback port, stopped on the way out."""
    reg = Registry(tmp_path)
    yield reg
    reg.stop()


def snapshot_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}
