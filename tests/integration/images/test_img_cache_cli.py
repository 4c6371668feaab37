"""Cache budget enforcement on a real store, and the `dsec image` CLI end to end."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsec.config import load_settings
from dsec.images import ImageStore, Snapshotter
from dsec.images.craft import CraftedImage, Entry, layer_tar, tar_dir, write_oci_layout

pytestmark = pytest.mark.integration


def _image(tmp_path: Path, name: str, kb: int) -> Path:
    write_oci_layout(tmp_path / name, CraftedImage([layer_tar([Entry("d", type=tarfile.DIRTYPE, mode=0o755),
                                                               Entry(f"d/{name}", os.urandom(kb * 1024))])]))
    return tmp_path / name


def test_byte_budget_evicts_unleased_layers_only(tmp_path: Path) -> None:
    """Over the byte budget, unpacked layers of unleased images are evicted (blobs stay, so
    the next prepare re-unpacks them); a leased image's layers are never evicted."""
    home = tmp_path / "home"
    st = ImageStore(home / "images", load_settings(home=home, image_cache_max_bytes="300K"))
    snap = Snapshotter(st)
    a = st.import_archive(_image(tmp_path, "a", 200), name="a:1")
    m = snap.prepare("holder", "a:1", tmp_path / "sa")  # lease on a's layers
    b = st.import_archive(_image(tmp_path, "b", 200), name="b:1")
    assert st.layers.present(a.layers[0].diff_id) and st.layers.present(b.layers[0].diff_id)  # a leased, b new
    snap.release("holder")
    st.import_archive(_image(tmp_path, "c", 200), name="c:1")
    present = [st.layers.present(i.layers[0].diff_id) for i in (a, b)]
    assert present.count(False) >= 1
    misses = st.misses
    snap.prepare("again", "a:1", tmp_path / "sa2")
    snap.prepare("again-b", "b:1", tmp_path / "sb2")
    assert st.misses > misses and Path(m.lower_dirs[0]).is_dir()


def test_cli_import_ls_inspect_rm_gc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """import (plain progress log off-terminal), ls --json, inspect, rm, gc and a clear error
    exit for an unknown image, all through the real `dsec image` command."""
    from dsec.cli.main import app
    from dsec.config import get_settings

    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        tar_dir(_image(tmp_path, "x", 64), tmp_path / "x.tar")
        r = runner.invoke(app, ["image", "import", str(tmp_path / "x.tar"), "--name", "x:1"])
        assert r.exit_code == 0, r.output
        assert "imported x:1" in r.output and "100%" in r.output  # plain progress log
        r = runner.invoke(app, ["image", "ls", "--json"])
        listed = json.loads(r.output)
        assert [i["names"] for i in listed] == [["x:1"]] and len(listed[0]["layers"]) == 1
        r = runner.invoke(app, ["image", "inspect", "x:1"])
        assert json.loads(r.output)["config"]["rootfs"]["type"] == "layers"
        r = runner.invoke(app, ["image", "inspect", "nope"])
        assert r.exit_code == 1 and "not found" in r.output and "x:1" in r.output
        r = runner.invoke(app, ["image", "ensure-stock", "--only", "busybox"])
        assert r.exit_code == 0 and "busybox" in r.output
        assert runner.invoke(app, ["image", "rm", "x:1"]).exit_code == 0
        r = runner.invoke(app, ["image", "gc", "--unused-s", "0"])
        report = json.loads(r.output)
        assert report["removed_blobs"] and report["removed_layers"]
        r = runner.invoke(app, ["image", "verify", "busybox", "--deep"])
        assert r.exit_code == 0 and ": ok" in r.output
    finally:
        get_settings.cache_clear()
