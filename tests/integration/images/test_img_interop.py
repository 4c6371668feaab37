"""OCI interop with real skopeo/umoci: our exports are valid, their outputs import."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dsec.images import ImageStore

pytestmark = pytest.mark.integration


def sh(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@pytest.fixture
def exported(store: ImageStore, tmp_path: Path) -> Path:
    store.export("busybox", tmp_path / "oci", tag="v1")
    store.export("busybox", tmp_path / "oci", tag="gz", compression="gzip")  # umoci 0.4.7 reads no zstd
    return tmp_path / "oci"


def test_export_is_accepted_by_skopeo_and_umoci(store: ImageStore, exported: Path, tmp_path: Path) -> None:
    """`skopeo inspect` reads our layout and `umoci unpack` produces a working rootfs."""
    info = json.loads(sh("skopeo", "inspect", f"oci:{exported}:v1"))
    assert info["Layers"] == [li.digest for li in store.resolve("busybox").layers]
    sh("umoci", "unpack", "--image", f"{exported}:gz", str(tmp_path / "bundle"))
    assert (tmp_path / "bundle/rootfs/bin/busybox").is_file()
    assert (tmp_path / "bundle/rootfs/bin/sh").is_symlink()


def test_skopeo_docker_archive_imports(store: ImageStore, exported: Path, tmp_path: Path) -> None:
    """`skopeo copy oci:A docker-archive:B.tar` output imports and yields the same diff_ids."""
    sh("skopeo", "copy", f"oci:{exported}:gz", f"docker-archive:{tmp_path}/b.tar:bb:v2")
    info = store.import_archive(tmp_path / "b.tar")
    assert "bb:v2" in info.names
    assert [li.diff_id for li in info.layers] == [li.diff_id for li in store.resolve("busybox").layers]
    # uncompressed layer: unpacked with kernel copies; a same-size edit is caught by --deep
    passwd = store.layer_dirs(info.id)[0] / "etc/passwd"
    assert store.verify("bb:v2", deep=True) == {info.layers[0].digest: None}
    passwd.write_text(passwd.read_text().replace("root", "toor"))
    assert "content changed" in str(store.verify("bb:v2", deep=True)[info.layers[0].digest])


def test_skopeo_gzip_oci_and_layout_tar_import(store: ImageStore, exported: Path, tmp_path: Path) -> None:
    """A gzip-recompressed OCI layout from skopeo, and the same layout as a tar, import."""
    sh("skopeo", "copy", "--dest-compress", "--dest-compress-format", "gzip", f"oci:{exported}:v1",
       f"oci:{tmp_path}/gz:g")
    store.remove("busybox")  # same config = same image id; drop it so the gzip blobs are the ones used
    info = store.import_archive(tmp_path / "gz", name="gz:1")
    assert info.layers[0].media_type.endswith("tar+gzip")
    from dsec.images.craft import tar_dir
    tar_dir(tmp_path / "gz", tmp_path / "gz.tar")
    info2 = store.import_archive(tmp_path / "gz.tar", name="gz:2")
    assert info2.id == info.id and set(store.resolve("gz:1").names) == {"gz:1", "gz:2"}


def test_umoci_repack_imports(store: ImageStore, exported: Path, tmp_path: Path) -> None:
    """An image modified and repacked by umoci (new layer with a whiteout) imports correctly."""
    work = tmp_path / "work"
    shutil.copytree(exported, work)
    sh("umoci", "unpack", "--image", f"{work}:gz", str(tmp_path / "b"))
    (tmp_path / "b/rootfs/etc/hosts").unlink()
    (tmp_path / "b/rootfs/work/new.txt").write_text("from umoci")
    sh("umoci", "repack", "--image", f"{work}:v2", str(tmp_path / "b"))
    info = store.import_archive(work, name="re:v2")  # imports v1 and v2? --name needs one
    assert len(info.layers) == 2
    top = store.layer_dirs(info.id)[-1]
    assert (top / "work/new.txt").read_text() == "from umoci"
    assert (top / "etc/hosts").is_char_device()  # OCI whiteout -> overlay whiteout


def test_docker_archive_import_can_store_zstd(exported: Path, tmp_path: Path) -> None:
    """With layer_import_compress on, an uncompressed docker-archive layer is stored as a
    zstd blob (same diff_id, new digest) and the image still exports to a valid layout."""
    from dsec.config import load_settings
    sh("skopeo", "copy", f"oci:{exported}:gz", f"docker-archive:{tmp_path}/b.tar:bb:v2")
    home = tmp_path / "z"
    st = ImageStore(home / "images", load_settings(home=home, layer_import_compress=True))
    info = st.import_archive(tmp_path / "b.tar")
    li = info.layers[0]
    assert li.media_type.endswith("tar+zstd") and li.digest != li.diff_id
    assert (st.layer_dirs(info.id)[0] / "bin/busybox").is_file()
    st.export("bb:v2", tmp_path / "out", tag="t")
    assert json.loads(sh("skopeo", "inspect", f"oci:{tmp_path}/out:t"))["Layers"] == [li.digest]
