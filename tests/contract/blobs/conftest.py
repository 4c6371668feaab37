"""Backends for the BlobStore contract suite: local dir, two-replica set, real S3 server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dsec.blobs import LocalBlobStore, ReplicatedBlobStore


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint() -> str:
    """A real S3-compatible HTTP server (moto server mode) on loopback, for this session."""
    port = _free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


def make_s3(endpoint: str):
    from dsec.blobs.s3 import S3BlobStore
    return S3BlobStore(f"b-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, create_bucket=True,
                       region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")


@pytest.fixture(params=["local", "replicated", "s3"])
def store(request, tmp_path):
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    if request.param == "local":
        return LocalBlobStore(tmp_path / "a")
    if request.param == "replicated":
        return ReplicatedBlobStore([LocalBlobStore(tmp_path / "a"), LocalBlobStore(tmp_path / "b")])
    return make_s3(request.getfixturevalue("moto_endpoint"))
