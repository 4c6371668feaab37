"""Helpers for checkpoint integration tests: real overlay mounts and tree comparison."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ckpt_helpers import Overlay

from dsec.node import syscalls


@pytest.fixture
def work(tmp_path):
    """A scratch dir whose leftover mounts (engines' sandboxes) are undone afterwards."""
    yield tmp_path
    for mp in syscalls.mounts_under(str(tmp_path)):
        try:
            syscalls.umount(mp)
        except OSError:
            pass


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


@pytest.fixture(scope="module")
def s3_store_factory():
    """S3 blob stores on a real S3-compatible server (moto server mode) on loopback."""
    import uuid

    from dsec.blobs.s3 import S3BlobStore
    from dsec.testing.s3server import moto_server
    with moto_server() as endpoint:
        bucket = f"ck-{uuid.uuid4().hex[:10]}"

        def make():
            return S3BlobStore(bucket, endpoint_url=endpoint, create_bucket=True, region_name="us-east-1",
                               aws_access_key_id="testing", aws_secret_access_key="testing")
        yield make
