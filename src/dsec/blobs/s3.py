"""S3 (or any S3-compatible server) BlobStore via boto3.

S3 PUTs are atomic per object (a reader sees the old object, the new one, or none),
which is exactly the BlobStore contract; ``prefix`` lets many deployments share one
bucket.
"""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from dsec import errors
from dsec.blobs.base import BlobStat, check_key

_FULL_CODES = {"EntityTooLarge", "QuotaExceeded", "XMinioStorageFull", "InsufficientStorage"}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


class S3BlobStore:
    def __init__(self, bucket: str, *, endpoint_url: str | None = None, prefix: str = "",
                 create_bucket: bool = False, client: Any | None = None, **client_kwargs: Any) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.name = f"s3:{endpoint_url or 'aws'}/{bucket}/{self.prefix}"
        self._s3 = client or boto3.client(
            "s3", endpoint_url=endpoint_url,
            config=Config(retries={"max_attempts": 3, "mode": "standard"}), **client_kwargs)
        if create_bucket:
            try:
                self._s3.create_bucket(Bucket=bucket)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",
                                                                      "BucketAlreadyExists"):
                    raise self._error(exc, "create bucket") from exc

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _error(self, exc: Exception, key: str) -> errors.DSecError:
        code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
        if code in _MISSING_CODES:
            return errors.NotFound(f"blob {key!r} not found in {self.name}", key=key)
        if code in _FULL_CODES:
            return errors.StorageFull(f"S3 store {self.name} refused {key!r} as full ({code}); "
                                      "free space or raise the bucket quota", key=key)
        return errors.TransientError(f"S3 store {self.name}: {key!r}: {exc}; retry later", key=key)

    def put(self, key: str, data: bytes) -> None:
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, key) from exc

    def get(self, key: str) -> bytes:
        try:
            return self._s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, key) from exc

    def stat(self, key: str) -> BlobStat:
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=self._k(key))
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, key) from exc
        return BlobStat(size=head["ContentLength"], mtime=head["LastModified"].timestamp())

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except errors.NotFound:
            return False
        return True

    def touch(self, key: str) -> None:
        try:
            self._s3.copy_object(Bucket=self.bucket, Key=self._k(key), MetadataDirective="REPLACE",
                                 CopySource={"Bucket": self.bucket, "Key": self._k(key)})
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, key) from exc

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self._k(key))
        except (ClientError, BotoCoreError) as exc:
            err = self._error(exc, key)
            if not isinstance(err, errors.NotFound):
                raise err from exc

    def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                out.extend(o["Key"][len(self.prefix):] for o in page.get("Contents", []))
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, prefix) from exc
        return sorted(out)
