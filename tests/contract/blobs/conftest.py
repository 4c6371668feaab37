"""Backends for the BlobStore contract suite: local dir, two-replica set, real S3 server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from dsec.blobs import LocalBlobStore, ReplicatedBlobStore
from dsec.testing.s3server import moto_server


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real S3-compatible HTTP server (moto server mode) on loopback, for this session."""
    with moto_server() as endpoint:
        yield endpoint


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
