"""Checkpoint bounds (issue 18 #3): apparent size against the disk quota before reading,
bounded layer inflation, holes kept on restore, and the layer-cache sweep decisions."""

from __future__ import annotations

import os
import resource
import tarfile
from pathlib import Path

import pytest

from dsec import errors
from dsec.checkpoints import layers
from dsec.checkpoints.fsstate import FsTracker, apparent_bytes
from dsec.checkpoints.layer_cache import collectable, lowers_in_use
from dsec.checkpoints.layers import Node, read_layer, write_layer, write_sparse

MIB = 1 << 20


def _tracker(max_bytes: int | None) -> FsTracker:
    return FsTracker(in_image=lambda _: False, full_every=5, max_bytes=max_bytes)


def _no_layers(_: object) -> bytes:
    raise AssertionError("no earlier layer to load")


def test_capture_refuses_sparse_file_over_quota_without_reading_it(tmp_path: Path) -> None:
    """A 1 GiB sparse file under a 64 MiB quota is refused (413 naming the quota) from the
    stat walk alone: this process's peak RSS does not grow by the file's size."""
    with open(tmp_path / "big", "wb") as fh:
        fh.truncate(1 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(errors.PayloadTooLarge, match="limit of 67108864 bytes"):
        _tracker(64 * MIB).capture(tmp_path, _no_layers)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 64 * MIB


def test_capture_counts_hard_links_and_accepts_within_quota(tmp_path: Path) -> None:
    """Each path is stored on its own, so hard links count once per name; within the quota
    the capture works and the compressed layer of a sparse file is small."""
    with open(tmp_path / "sparse", "wb") as fh:
        fh.truncate(8 * MIB)
    cap, _ = _tracker(64 * MIB).capture(tmp_path, _no_layers)
    assert cap.changed and cap.layer_bytes < MIB
    for i in range(8):
        os.link(tmp_path / "sparse", tmp_path / f"link{i}")
    from dsec.checkpoints.fsdiff import walk_signature
    assert apparent_bytes(walk_signature(tmp_path)) == 9 * 8 * MIB
    with pytest.raises(errors.PayloadTooLarge):
        _tracker(64 * MIB).capture(tmp_path, _no_layers)


def _zero_layer(size: int) -> bytes:
    info = tarfile.TarInfo("zeros")
    info.size, info.mode = size, 0o644
    return write_layer({"zeros": Node(info=info, data=bytes(size))})


def test_read_layer_bound_refuses_an_oversized_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose files exceed the bound is refused (413) instead of being inflated;
    a zstd bomb past bound + framing allowance is cut off after that many bytes."""
    blob = _zero_layer(8 * MIB)
    assert len(blob) < 64 * 1024  # zeros compress ~1000x: the bomb shape
    assert read_layer(blob)["zeros"].info.size == 8 * MIB  # type: ignore[union-attr]
    with pytest.raises(errors.PayloadTooLarge):
        read_layer(blob, max_bytes=MIB)
    assert read_layer(blob, max_bytes=8 * MIB)["zeros"].data == bytes(8 * MIB)
    monkeypatch.setattr(layers, "LAYER_OVERHEAD", 0)  # the inflation cut-off itself
    with pytest.raises(errors.PayloadTooLarge):
        layers._decompress(blob, max_bytes=MIB)


def test_write_sparse_keeps_holes(tmp_path: Path) -> None:
    """Zero runs become holes; the file reads back identical, trailing hole included."""
    data = b"head" + bytes(16 * MIB) + b"mid" + bytes(3 * MIB)
    with open(tmp_path / "f", "wb") as fh:
        write_sparse(fh, data)  # type: ignore[arg-type]
    assert (tmp_path / "f").read_bytes() == data
    assert os.stat(tmp_path / "f").st_blocks * 512 < MIB


def test_lowers_in_use_reads_overlay_lowerdirs() -> None:
    """Only overlay mounts count, only entries of the cache root, with kernel escaping."""
    root = Path("/var/lib/dsec home/ckpt-layers")
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    lines = [
        (f"100 1 0:50 / /x/rootfs rw - overlay overlay rw,lowerdir=/var/lib/dsec\\040home/ckpt-layers/{a}:"
         f"/var/lib/dsec\\040home/ckpt-layers/{b}:/img/l1,upperdir=/u,workdir=/w"),
        f"101 1 0:51 / /y rw - tmpfs tmpfs rw,note=/var/lib/dsec\\040home/ckpt-layers/{c}",
        f"102 1 0:52 / /z rw - overlay overlay rw,lowerdir=/elsewhere/ckpt-layers/{c}",
    ]
    assert lowers_in_use(root, lines) == {a, b}


def test_collectable_spares_used_pinned_and_fresh_layers() -> None:
    entries = {"u": 0.0, "p": 0.0, "f": 95.0, "old": 0.0}
    assert collectable(entries, in_use={"u"}, pinned={"p"}, now=100.0, grace_s=10.0) == ["old"]
    assert collectable(entries, in_use=set(), pinned=set(), now=100.0, grace_s=0.0) == ["f", "old", "p", "u"]


def test_layer_roundtrip_unchanged_by_streaming() -> None:
    """The streamed writer produces a layer every reader still decodes (paths, data, types)."""
    d = tarfile.TarInfo("d")
    d.type, d.mode = tarfile.DIRTYPE, 0o755
    f = tarfile.TarInfo("d/f")
    f.mode, f.size = 0o600, 5
    nodes = read_layer(write_layer({"d": Node(info=d, opaque=True), "d/f": Node(info=f, data=b"hello"),
                                    "gone": Node(info=None, whiteout=True)}))
    assert nodes["d"].opaque and nodes["d/f"].data == b"hello" and nodes["gone"].whiteout


def test_sweep_soon_is_debounced(tmp_path: Path) -> None:
    """A burst of teardowns schedules at most one sweep per delay (not one per teardown)."""
    import asyncio

    from dsec.checkpoints.layer_cache import LayerCache

    async def main() -> int:
        cache = LayerCache(tmp_path / "layers", grace_s=0)
        for _ in range(100):
            cache.sweep_soon()
        n = len(cache._pending)
        for _, handle in cache._pending.values():
            handle.cancel()
        return n
    assert asyncio.run(main()) == 2


def test_checkpoint_bound_is_disk_quota_capped_by_setting() -> None:
    """A default 10G-disk sandbox is still bounded by checkpoint_max_bytes (server memory)."""
    from dsec.checkpoints.layer_cache import disk_quota
    from dsec.config import Settings
    from dsec.models import SandboxSpec

    s = Settings(checkpoint_max_bytes=MIB << 10)
    assert disk_quota(SandboxSpec(disk="64M"), s) == 64 * MIB
    assert disk_quota(SandboxSpec(), s) == MIB << 10  # default disk 10G, capped at 1G
