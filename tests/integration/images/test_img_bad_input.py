"""Bad archives fail with a clear error, leave nothing behind and never hurt existing images."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from dsec.errors import DigestMismatch, ImageError, NotFound, UnsafeLayer
from dsec.images import ImageStore
from dsec.images.craft import CraftedImage, Entry, layer_tar, tar_dir, write_oci_layout

pytestmark = pytest.mark.integration

GOOD = [Entry("etc", type=tarfile.DIRTYPE, mode=0o755), Entry("etc/motd", b"hello\n")]


def _state(store: ImageStore) -> tuple[set[str], set[str], list[str]]:
    return (set(store.content.all_digests()), set(store.layers.all_diff_ids()),
            sorted(n for i in store.list() for n in i.names))


def _assert_clean_failure(store: ImageStore, before: tuple, exc_type: type, path: Path, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(exc_type, match=match):
        store.import_archive(path, name="bad:1")
    assert _state(store) == before
    assert [p for p in store.layers.root.iterdir() if p.name.startswith(".tmp")] == []
    assert list(store.content.ingest_dir.iterdir()) == []
    # the existing image still works
    assert store.resolve("busybox").id and store.verify("busybox", deep=True) == {
        li.digest: None for li in store.resolve("busybox").layers}


def test_corrupt_layer_blob(store: ImageStore, tmp_path: Path) -> None:
    """A layer blob whose bytes do not match the manifest digest -> DigestMismatch, no leftovers."""
    d = write_oci_layout(tmp_path / "l", CraftedImage([layer_tar(GOOD)]))
    blob = tmp_path / "l/blobs/sha256" / d["layer0"][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    _assert_clean_failure(store, _state(store), DigestMismatch, tmp_path / "l", "layer 0")


def test_wrong_diff_id(store: ImageStore, tmp_path: Path) -> None:
    """A config whose diff_id does not match the layer content -> DigestMismatch naming diff_id."""
    d = write_oci_layout(tmp_path / "l", CraftedImage([layer_tar(GOOD)], compression="tar"))
    # second good layer in a second image but config lies: rebuild with swapped diff_id
    cfg_path = tmp_path / "l/blobs/sha256" / d["config"][7:]
    cfg = json.loads(cfg_path.read_text())
    cfg["rootfs"]["diff_ids"] = ["sha256:" + "0" * 64]
    new = json.dumps(cfg).encode()
    from dsec.images.fsutil import digest_of
    (tmp_path / "l/blobs/sha256" / digest_of(new)[7:]).write_bytes(new)
    man_path = tmp_path / "l/blobs/sha256" / d["manifest"][7:]
    man = json.loads(man_path.read_text())
    man["config"] = {"mediaType": man["config"]["mediaType"], "digest": digest_of(new), "size": len(new)}
    mraw = json.dumps(man).encode()
    (tmp_path / "l/blobs/sha256" / digest_of(mraw)[7:]).write_bytes(mraw)
    idx = json.loads((tmp_path / "l/index.json").read_text())
    idx["manifests"][0].update(digest=digest_of(mraw), size=len(mraw))
    (tmp_path / "l/index.json").write_text(json.dumps(idx))
    _assert_clean_failure(store, _state(store), DigestMismatch, tmp_path / "l", "diff_id")


def test_truncated_archive(store: ImageStore, tmp_path: Path) -> None:
    """An OCI layout tar cut in half -> ImageError naming the archive."""
    write_oci_layout(tmp_path / "l", CraftedImage([layer_tar(GOOD + [Entry("big", os.urandom(300_000))])]))
    tar_dir(tmp_path / "l", tmp_path / "l.tar")
    raw = (tmp_path / "l.tar").read_bytes()
    (tmp_path / "t.tar").write_bytes(raw[: len(raw) * 2 // 3])
    _assert_clean_failure(store, _state(store), ImageError, tmp_path / "t.tar", "t.tar")


def test_unknown_media_type(store: ImageStore, tmp_path: Path) -> None:
    """A layer with an unknown media type -> ImageError naming the media type."""
    write_oci_layout(tmp_path / "l", CraftedImage([layer_tar(GOOD)], media_type="application/x-weird"))
    _assert_clean_failure(store, _state(store), ImageError, tmp_path / "l", "application/x-weird")


def test_missing_blob(store: ImageStore, tmp_path: Path) -> None:
    """A manifest naming a layer blob the archive lacks -> ImageError naming the digest."""
    d = write_oci_layout(tmp_path / "l", CraftedImage([layer_tar(GOOD)]))
    (tmp_path / "l/blobs/sha256" / d["layer0"][7:]).unlink()
    _assert_clean_failure(store, _state(store), ImageError, tmp_path / "l", d["layer0"][7:19])


@pytest.mark.parametrize("entries", [
    [Entry("../../escape", b"x")],
    [Entry("ln", type=tarfile.SYMTYPE, linkname="/"), Entry("ln/tmp/escape", b"x")],
    [Entry("null", type=tarfile.CHRTYPE, devmajor=1, devminor=3)],
], ids=["dotdot", "through-symlink", "device"])
def test_malicious_layer_in_archive(store: ImageStore, tmp_path: Path, entries: list[Entry]) -> None:
    """A malicious layer inside an otherwise valid image -> UnsafeLayer; the good layer is not kept."""
    write_oci_layout(tmp_path / "l", CraftedImage([layer_tar(GOOD), layer_tar(entries)]))
    _assert_clean_failure(store, _state(store), UnsafeLayer, tmp_path / "l", "refus|not allowed")
    assert not Path("/tmp/escape").exists()


def test_not_an_archive(store: ImageStore, tmp_path: Path) -> None:
    """Random bytes / an empty dir / a missing path give clear errors naming the path."""
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    _assert_clean_failure(store, _state(store), ImageError, tmp_path / "junk.tar", "junk.tar")
    (tmp_path / "empty").mkdir()
    _assert_clean_failure(store, _state(store), ImageError, tmp_path / "empty", "neither an OCI layout")
    with pytest.raises(NotFound, match="nope"):
        store.import_archive(tmp_path / "nope")


def test_unknown_image_name_lists_available(store: ImageStore) -> None:
    """Resolving an unknown image names it and lists what exists."""
    with pytest.raises(NotFound, match=r"'pyhton'.*busybox:latest"):
        store.resolve("pyhton")


def test_parallel_unpack_failure_leaves_nothing(home: Path, tmp_path: Path) -> None:
    """With layers unpacked by worker processes, a bad layer still fails the import cleanly:
    the good layers the other workers finished are removed too; a good image imports."""
    from dsec.config import load_settings
    from dsec.images.stock import ensure_busybox
    st = ImageStore(home / "images", load_settings(home=home, image_parallel_unpack_min_bytes=0))
    ensure_busybox(st, log=lambda m: None)
    good = [layer_tar(GOOD), layer_tar([Entry(f"f{i}", os.urandom(5000)) for i in range(50)])]
    write_oci_layout(tmp_path / "bad", CraftedImage(good + [layer_tar([Entry("../../escape", b"x")])]))
    _assert_clean_failure(st, _state(st), UnsafeLayer, tmp_path / "bad", "refus")
    write_oci_layout(tmp_path / "ok", CraftedImage(good, compression="tar"))
    before = st.misses
    info = st.import_archive(tmp_path / "ok", name="ok:1")
    assert st.misses - before == 2 and [p.is_dir() for p in st.layer_dirs(info.id)] == [True, True]
    assert (st.layer_dirs(info.id)[0] / "etc/motd").read_text() == "hello\n"
