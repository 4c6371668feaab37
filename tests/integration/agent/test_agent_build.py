"""Building dsec-init: static, content-addressed, atomic, clear errors without a compiler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.errors import SandboxFailure
from dsec.runtime import agent_build

pytestmark = pytest.mark.integration


def test_build_is_static_cached_and_leaves_no_temp_files(tmp_path: Path) -> None:
    """The binary is static (runs in images without libc), reused on the next call, and the
    build directory holds nothing but it."""
    first = agent_build.ensure_agent_binary(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert agent_build.ensure_agent_binary(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [x.name for x in tmp_path.iterdir()] == [first.name]  # no temp files left
    assert first.stat().st_mode & 0o777 == 0o755
    # runs in a root that holds nothing else: no libc, no loader (images without either)
    empty_root = tmp_path / "root"
    empty_root.mkdir()
    shutil.copy2(first, empty_root / "init")
    out = subprocess.run(["chroot", str(empty_root), "/init", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("dsec-init 1 protocol 1")


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without gcc on PATH the error says what is missing and how to install it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxFailure, match="gcc not found on PATH; install gcc and libc6-dev"):
        agent_build.ensure_agent_binary(tmp_path / "out")


def test_compile_error_is_reported_and_nothing_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing compile raises with gcc's message and leaves no partial binary behind."""
    bad = tmp_path / "bad.c"
    bad.write_text("int main(void) { return undefined_symbol; }\n")
    monkeypatch.setattr(agent_build, "SOURCE", bad)
    out = tmp_path / "out"
    with pytest.raises(SandboxFailure, match="undefined_symbol"):
        agent_build.ensure_agent_binary(out)
    assert list(out.iterdir()) == []
