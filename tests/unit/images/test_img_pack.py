"""Deterministic packing and safe unpacking of layers (no root needed)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import zstandard

from dsec.errors import UnsafeLayer
from dsec.images.craft import Entry, compress, layer_tar
from dsec.images.pack import pack_layer
from dsec.images.unpack import safe_name, unpack_stream


def _tree(root: Path) -> None:
    (root / "b").mkdir(parents=True)
    (root / "b" / "f.txt").write_text("hello")
    (root / "a.bin").write_bytes(os.urandom(1000))
    (root / "ln").symlink_to("b/f.txt")
    os.link(root / "b" / "f.txt", root / "b" / "hard")


@pytest.mark.parametrize("compression", ["zstd", "gzip", "tar"])
def test_pack_is_deterministic_across_mtimes(tmp_path: Path, compression: str) -> None:
    """Packing the same files twice (even with different mtimes) yields the same digest."""
    _tree(tmp_path / "t")
    one = pack_layer(tmp_path / "t", io.BytesIO(), compression)
    for p in (tmp_path / "t").rglob("*"):
        os.utime(p, (12345, 12345), follow_symlinks=False)
    two = pack_layer(tmp_path / "t", io.BytesIO(), compression)
    assert (one.digest, one.diff_id) == (two.digest, two.diff_id)


def test_packed_tar_is_sorted_and_normalized(tmp_path: Path) -> None:
    """Entries are sorted, mtime 0, no user names, owners forced when asked; zstd media type."""
    _tree(tmp_path / "t")
    buf = io.BytesIO()
    res = pack_layer(tmp_path / "t", buf, "zstd", owner=(0, 0))
    assert res.media_type == "application/vnd.oci.image.layer.v1.tar+zstd"
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(buf.getvalue())).read()
    names = []
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        for ti in tf:
            names.append(ti.name)
            assert ti.mtime == 0 and ti.uname == "" and ti.gname == "" and ti.uid == 0
    assert names == ["a.bin", "b", "b/f.txt", "b/hard", "ln"]


def test_gzip_header_has_no_timestamp(tmp_path: Path) -> None:
    """gzip layers we write carry MTIME=0 (bytes 4..8), so digests do not depend on time."""
    _tree(tmp_path / "t")
    buf = io.BytesIO()
    pack_layer(tmp_path / "t", buf, "gzip")
    assert buf.getvalue()[4:8] == b"\0\0\0\0"


@pytest.mark.parametrize("compression", ["zstd", "gzip", "tar"])
def test_unpack_reads_all_compressions(tmp_path: Path, compression: str) -> None:
    """gzip, zstd and uncompressed layers unpack; both digests are computed from the bytes."""
    raw = layer_tar([Entry("d", type=tarfile.DIRTYPE, mode=0o755), Entry("d/x", b"data")])
    blob = compress(raw, compression)
    (tmp_path / "out").mkdir()
    res = unpack_stream(io.BytesIO(blob), compression, tmp_path / "out", "t")
    assert (tmp_path / "out/d/x").read_bytes() == b"data"
    from dsec.images.fsutil import digest_of
    assert res.diff_id == digest_of(raw) and res.digest == digest_of(blob)


@pytest.mark.parametrize("name", ["../evil", "/etc/evil", "a/../../evil", "a/b/../../../evil"])
def test_safe_name_rejects_traversal(name: str) -> None:
    """Absolute paths and '..' components are refused before anything is written."""
    with pytest.raises(UnsafeLayer):
        safe_name(name, "layer")


MALICIOUS = {
    "dotdot": [Entry("../escaped", b"x")],
    "absolute": [Entry("/tmp/escaped", b"x")],
    "write-through-symlink": [Entry("ln", type=tarfile.SYMTYPE, linkname="/tmp"), Entry("ln/escaped", b"x")],
    "symlink-escape": [Entry("a", type=tarfile.DIRTYPE, mode=0o755),
                       Entry("a/up", type=tarfile.SYMTYPE, linkname="../../../../tmp")],
    "hardlink-escape": [Entry("h", type=tarfile.LNKTYPE, linkname="../../etc/passwd")],
    "hardlink-outside-layer": [Entry("h", type=tarfile.LNKTYPE, linkname="etc/shadow")],
    "device": [Entry("dev/sda", type=tarfile.BLKTYPE, devmajor=8, devminor=0)],
    "chardev": [Entry("mem", type=tarfile.CHRTYPE, devmajor=1, devminor=1)],
}


@pytest.mark.parametrize("case", sorted(MALICIOUS))
def test_malicious_layer_is_refused_and_writes_nothing_outside(tmp_path: Path, case: str) -> None:
    """Each crafted malicious entry raises UnsafeLayer naming the entry; nothing lands outside dest."""
    dest = tmp_path / "layer" / "fs"
    dest.mkdir(parents=True)
    before = set(tmp_path.rglob("*"))
    with pytest.raises(UnsafeLayer) as ei:
        unpack_stream(io.BytesIO(layer_tar(MALICIOUS[case])), "tar", dest, f"layer-{case}")
    assert f"layer-{case}" in str(ei.value)
    after = {p for p in tmp_path.rglob("*") if not str(p).startswith(str(dest))}
    assert after <= before
    assert not Path("/tmp/escaped").exists()


def test_setuid_bits_are_stripped(tmp_path: Path) -> None:
    """setuid/setgid bits never survive unpacking (documented in unpack.py)."""
    raw = layer_tar([Entry("su", b"\x7fELF", mode=0o6755)])
    unpack_stream(io.BytesIO(raw), "tar", tmp_path, "t")
    assert (tmp_path / "su").stat().st_mode & 0o7777 == 0o755


def test_relative_symlink_inside_layer_is_fine(tmp_path: Path) -> None:
    """Ordinary relative and absolute symlinks (e.g. merged-/usr) are accepted."""
    raw = layer_tar([Entry("usr/lib", type=tarfile.DIRTYPE, mode=0o755), Entry("lib", type=tarfile.SYMTYPE,
                     linkname="usr/lib"), Entry("usr/lib/x", type=tarfile.SYMTYPE, linkname="../../bin/sh"),
                     Entry("abs", type=tarfile.SYMTYPE, linkname="/etc/passwd")])
    unpack_stream(io.BytesIO(raw), "tar", tmp_path, "t")
    assert os.readlink(tmp_path / "abs") == "/etc/passwd"


def test_truncated_layer_is_a_clear_error(tmp_path: Path) -> None:
    """A truncated zstd layer raises ImageError, not a random exception."""
    from dsec.errors import ImageError
    blob = compress(layer_tar([Entry("x", os.urandom(100000))]), "zstd")
    with pytest.raises(ImageError, match="corrupt or truncated"):
        unpack_stream(io.BytesIO(blob[: len(blob) // 2]), "zstd", tmp_path, "t")
