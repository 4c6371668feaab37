"""Helpers for checkpoint integration tests: real overlay mounts and tree comparison."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ckpt_helpers import Overlay


@pytest.fixture
def overlays():
    made: list[Overlay] = []

    def make(base: Path, lowers: list[Path]) -> Overlay:
        ov = Overlay(base, lowers)
        made.append(ov)
        return ov
    yield make
    for ov in made:
        try:
            ov.umount()
        except OSError:
            pass


@pytest.fixture
def image_dir(tmp_path) -> Path:
    """A small 'image' lower dir with nested dirs, files, a symlink."""
    img = tmp_path / "image"
    (img / "etc" / "conf.d").mkdir(parents=True)
    (img / "bin").mkdir()
    (img / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (img / "etc" / "conf.d" / "a.conf").write_text("a=1\n")
    (img / "etc" / "conf.d" / "b.conf").write_text("b=1\n")
    (img / "bin" / "tool").write_bytes(b"\x7fELF" + b"\0" * 100)
    os.chmod(img / "bin" / "tool", 0o755)
    os.symlink("tool", img / "bin" / "alias")
    return img
