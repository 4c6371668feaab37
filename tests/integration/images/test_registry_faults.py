"""Registry pulls with bad input and faults: unknown reference, registry down, a
manifest whose layer is missing, bytes that do not match their digest (a fake registry
serving corrupt, truncated or oversized blobs), a lying manifest digest, unknown media
types. Each is a clear error naming what was wrong, and the content store is left
exactly as it was (no blob, no unpacked layer, no ingest temp file, no name), while the
images already there keep verifying."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from registry_env import FakeRegistry, Registry, free_port, image_blobs, run, sha, store_files

from dsec.config import load_settings
from dsec.errors import DigestMismatch, ImageError, NotFound, TransientError
from dsec.images import ImageStore
from dsec.images.craft import Entry, compress, layer_tar
from dsec.images.registry_ops import pull, push

pytestmark = pytest.mark.integration

DSEC = str(Path(__file__).resolve().parents[3] / ".venv/bin/dsec")


def empty_store(tmp_path: Path) -> ImageStore:
    home = tmp_path / "empty"
    return ImageStore(home / "images", load_settings(home=home))


def assert_untouched(st: ImageStore, before: set[str]) -> None:
    assert store_files(st.root) == before
    assert not any(st.content.ingest_dir.iterdir()), "a half-written blob was left in ingest/"
    assert not list(st.layers.root.glob(".tmp-*")), "a half-unpacked layer was left behind"


def test_unknown_reference(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """A tag or repository the registry does not have: NotFound naming the reference."""
    push(store, "busybox", f"{registry.host}/known:v1")
    st = empty_store(tmp_path)
    before = store_files(st.root)
    with pytest.raises(NotFound) as ei:
        pull(st, f"{registry.host}/known:nope")
    assert f"{registry.host}/known:nope" in ei.value.message and "MANIFEST_UNKNOWN" in ei.value.message
    with pytest.raises(NotFound, match="no-such-repo"):
        pull(st, f"{registry.host}/no-such-repo:v1")
    assert_untouched(st, before)
    assert st.list() == []
    # the CLI: exit 1, one line naming it, no traceback
    proc = run([DSEC, "image", "pull", f"{registry.host}/known:nope"], check=False,
               env={"DSEC_HOME": str(tmp_path / "cli")})
    assert proc.returncode == 1 and "known:nope" in proc.stderr and "Traceback" not in proc.stderr


def test_registry_down(store: ImageStore, tmp_path: Path) -> None:
    """Nothing listening on the port: TransientError naming the registry, nothing stored."""
    host = f"127.0.0.1:{free_port()}"
    st = empty_store(tmp_path)
    before = store_files(st.root)
    with pytest.raises(TransientError) as ei:
        pull(st, f"{host}/x:v1")
    assert f"registry {host} is not reachable" in ei.value.message
    with pytest.raises(TransientError, match=host):
        push(store, "busybox", f"{host}/x:v1")
    assert_untouched(st, before)


def test_manifest_whose_layer_is_missing(store: ImageStore, registry: Registry, tmp_path: Path) -> None:
    """The registry lost a layer blob the manifest names: NotFound naming the layer
    digest; the config already fetched is rolled back."""
    push(store, "busybox", f"{registry.host}/lost:v1")
    layer = store.resolve("busybox").layers[0].digest
    registry.blob_data(layer).unlink()
    st = empty_store(tmp_path)
    before = store_files(st.root)
    with pytest.raises(NotFound) as ei:
        pull(st, f"{registry.host}/lost:v1")
    assert layer in ei.value.message and "missing from registry" in ei.value.message
    assert_untouched(st, before)
    assert st.list() == []


def _corrupt(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]


@pytest.mark.parametrize("fault", ["flipped", "truncated", "oversized", "config"])
def test_blob_digest_mismatch(store: ImageStore, tmp_path: Path, fault: str) -> None:
    """A registry serving bytes that do not hash to the manifest's digest (a flipped
    byte, a short body, extra bytes, a bad config): DigestMismatch naming the blob;
    no blob, layer, temp file or name is left."""
    manifests, blobs = image_blobs(store, "busybox")
    info = store.resolve("busybox")
    layer = info.layers[0].digest
    fake = FakeRegistry(manifests, blobs)
    try:
        target = info.id if fault == "config" else layer
        data = blobs[target]
        fake.blob_override[target] = {"flipped": _corrupt(data), "truncated": data[:-100],
                                      "oversized": data + b"x" * 10, "config": _corrupt(data)}[fault]
        st = empty_store(tmp_path)
        before = store_files(st.root)
        with pytest.raises(DigestMismatch) as ei:
            pull(st, f"{fake.host}/bb:v1")
        msg = ei.value.message
        assert target in msg and fake.host in msg if fault in ("flipped", "config") else target in msg
        if fault == "truncated":
            assert "truncated" in msg
        if fault == "oversized":
            assert "more than" in msg
        assert_untouched(st, before)
        assert st.list() == []
        # once the registry serves the right bytes again, the same pull works
        fake.blob_override.clear()
        assert pull(st, f"{fake.host}/bb:v1").id == info.id
    finally:
        fake.stop()


def test_failed_pull_keeps_existing_images(store: ImageStore, tmp_path: Path) -> None:
    """An image sharing its base layer with a local image, whose new layer arrives
    corrupt: the pull fails, the shared blob and unpacked layer stay, busybox still
    verifies, nothing of the new image remains."""
    bb = store.resolve("busybox")
    raw_cfg = json.loads(store.content.read_bytes(bb.id))
    extra_tar = layer_tar([Entry("work/extra.txt", b"extra layer\n")])
    extra = compress(extra_tar, "gzip")
    raw_cfg["rootfs"]["diff_ids"].append(sha(extra_tar))
    config = json.dumps(raw_cfg).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha(config),
                   "size": len(config)},
        "layers": [{"mediaType": bb.layers[0].media_type, "digest": bb.layers[0].digest, "size": bb.layers[0].size},
                   {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha(extra),
                    "size": len(extra)}]}).encode()
    fake = FakeRegistry({"v2": (manifest, "application/vnd.oci.image.manifest.v1+json")},
                        {sha(config): config, sha(extra): extra, bb.layers[0].digest: store.content.read_bytes(
                            bb.layers[0].digest)})
    try:
        fake.blob_override[sha(extra)] = _corrupt(extra)
        before = store_files(store.root)
        with pytest.raises(DigestMismatch, match=sha(extra)):
            pull(store, f"{fake.host}/app:v2")
        assert_untouched(store, before)
        assert bb.layers[0].digest not in fake.hits  # the local blob was used, not re-fetched
        assert store.verify("busybox", deep=True) == {bb.layers[0].digest: None}
        fake.blob_override.clear()
        got = pull(store, f"{fake.host}/app:v2")
        assert (store.layer_dirs(got.id)[1] / "work/extra.txt").read_text() == "extra layer\n"
    finally:
        fake.stop()


def test_lying_manifest_and_unknown_media_type(store: ImageStore, tmp_path: Path) -> None:
    """Pull by digest where the registry answers other manifest bytes: DigestMismatch
    naming the digest asked for. A layer with an unknown media type is refused by name
    before any blob is downloaded."""
    manifests, blobs = image_blobs(store, "busybox")
    raw, mt = manifests["v1"]
    other = json.loads(raw)
    other["annotations"] = {"x": "y"}
    wrong = json.dumps(other).encode()
    weird = json.loads(raw)
    weird["layers"][0]["mediaType"] = "application/x-weird"
    asked = sha(raw)
    fake = FakeRegistry({asked: (wrong, mt), "weird": (json.dumps(weird).encode(), mt)}, blobs)
    try:
        st = empty_store(tmp_path)
        before = store_files(st.root)
        with pytest.raises(DigestMismatch, match=asked):
            pull(st, f"{fake.host}/bb@{asked}")
        with pytest.raises(ImageError, match="application/x-weird"):
            pull(st, f"{fake.host}/bb:weird")
        assert fake.hits == []
        assert_untouched(st, before)
    finally:
        fake.stop()


def test_registry_dies_mid_transfer(store: ImageStore, tmp_path: Path) -> None:
    """A blob connection that breaks half-way is retried from the start (twice at most);
    past that the pull is a TransientError naming the blob and the bytes received, and
    nothing half-written stays."""
    manifests, blobs = image_blobs(store, "busybox")
    layer = store.resolve("busybox").layers[0].digest
    fake = FakeRegistry(manifests, blobs)
    try:
        st = empty_store(tmp_path)
        before = store_files(st.root)
        fake.break_times[layer] = 5
        with pytest.raises(TransientError) as ei:
            pull(st, f"{fake.host}/bb:v1")
        assert layer in ei.value.message and "broke after" in ei.value.message
        assert fake.hits.count(layer) == 3 and fake.break_times[layer] == 2
        assert_untouched(st, before)
        fake.break_times[layer] = 2  # two breaks, then good bytes: the retries carry the pull
        assert pull(st, f"{fake.host}/bb:v1").id == store.resolve("busybox").id
    finally:
        fake.stop()
