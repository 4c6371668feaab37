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


@pytest.fixture(scope="module")
def s3_store_factory():
    """S3 blob stores on a real S3-compatible server (moto server mode) on loopback."""
    import socket
    import subprocess
    import sys
    import time
    import uuid

    from dsec.blobs.s3 import S3BlobStore
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    bucket = f"ck-{uuid.uuid4().hex[:10]}"

    def make():
        return S3BlobStore(bucket, endpoint_url=f"http://127.0.0.1:{port}", create_bucket=True,
                           region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    yield make
    proc.terminate()
    proc.wait(timeout=10)
