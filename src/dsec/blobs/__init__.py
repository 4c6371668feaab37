"""Blob stores for checkpoints: local directory (default), S3, replicated set."""

from __future__ import annotations

from dsec.blobs.base import (
    BlobStat,
    BlobStore,
    cas_key,
    check_key,
    content_ok,
    get_blob,
    put_blob,
    sha256_hex,
)
from dsec.blobs.local import LocalBlobStore
from dsec.blobs.replicated import ReplicatedBlobStore
from dsec.config import Settings

__all__ = ["BlobStat", "BlobStore", "LocalBlobStore", "ReplicatedBlobStore", "cas_key", "check_key",
           "content_ok", "get_blob", "open_checkpoint_store", "put_blob", "sha256_hex"]


def open_checkpoint_store(settings: Settings) -> BlobStore:
    """The checkpoint store Settings describe: one replica per checkpoint root, or S3.

    Local: ``checkpoint_roots`` (default ``HOME/checkpoints``); with two or more roots the
    store writes every object to each (put them on different disks). S3: one bucket.
    """
    if settings.blob_backend == "s3":
        from dsec.blobs.s3 import S3BlobStore
        return S3BlobStore(settings.s3_bucket, endpoint_url=settings.s3_endpoint, prefix="checkpoints")
    if settings.blob_backend != "local":
        from dsec import errors
        raise errors.InvalidArgument(f"blob_backend {settings.blob_backend!r} must be 'local' or 's3'")
    roots = settings.checkpoint_roots or [settings.home / "checkpoints"]
    stores: list[BlobStore] = [LocalBlobStore(r) for r in roots]
    return stores[0] if len(stores) == 1 else ReplicatedBlobStore(stores)
