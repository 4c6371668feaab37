"""The BlobStore protocol: a flat namespace of immutable, atomically written objects.

Every backend (local directory, S3, replicated set) runs the same contract suite
(``tests/contract/blobs``). Two conventions sit on top of the raw namespace:

* content-addressed blobs under ``cas/sha256/<hex>``: written once, shared by every
  episode (dedup), verified against their name on every read;
* named objects (checkpoint metadata) whose names embed their own sha256, so a reader
  can always tell a corrupt object from a good one.

A ``put`` is all-or-nothing: a reader sees the whole new object or no object, never a
prefix. Backends map "disk/bucket full" to :class:`dsec.errors.StorageFull` and a
missing key to :class:`dsec.errors.NotFound`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol, runtime_checkable

from pydantic import BaseModel

from dsec import errors

CAS_PREFIX = "cas/sha256/"
_KEY_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")


class BlobStat(BaseModel):
    size: int
    mtime: float


@runtime_checkable
class BlobStore(Protocol):
    name: str

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` durably and atomically (replace if present)."""

    def get(self, key: str) -> bytes:
        """Return the object; raise NotFound if absent."""

    def exists(self, key: str) -> bool: ...

    def stat(self, key: str) -> BlobStat:
        """Size and modification time; raise NotFound if absent."""

    def touch(self, key: str) -> None:
        """Refresh the modification time (GC grace) of an existing object; NotFound if absent."""

    def delete(self, key: str) -> None:
        """Remove the object; deleting an absent key is not an error."""

    def list(self, prefix: str) -> list[str]:
        """All keys starting with ``prefix``, sorted."""


def check_key(key: str) -> str:
    """Refuse keys that could escape a directory root or confuse a backend."""
    if not isinstance(key, str) or len(key) > 1024 or not _KEY_RE.match(key) \
            or any(part in (".", "..") or part.startswith(".tmp") for part in key.split("/")):
        raise errors.InvalidArgument(
            f"invalid blob key {key!r}: use 1-1024 chars of [A-Za-z0-9._-] separated by '/', "
            "no '.', '..' or '.tmp*' segments")
    return key


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cas_key(digest: str) -> str:
    """``sha256:<hex>`` or ``<hex>`` -> the CAS key."""
    hexd = digest.removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", hexd):
        raise errors.InvalidArgument(f"invalid sha256 digest {digest!r}")
    return CAS_PREFIX + hexd


_SELF_DIGEST_RE = re.compile(r"-([0-9a-f]{64})\.[a-z]+$")


def self_digest(key: str) -> str | None:
    """The sha256 hex a key promises for its content (CAS or ``...-<hex>.ext``), if any."""
    if key.startswith(CAS_PREFIX):
        return key[len(CAS_PREFIX):]
    m = _SELF_DIGEST_RE.search(key)
    return m.group(1) if m else None


def content_ok(key: str, data: bytes) -> bool:
    """True unless the key promises a digest the data does not have."""
    want = self_digest(key)
    return want is None or sha256_hex(data) == want


def put_blob(store: BlobStore, data: bytes) -> str:
    """Store ``data`` content-addressed; return ``sha256:<hex>``. Existing blobs are reused."""
    digest = "sha256:" + sha256_hex(data)
    key = cas_key(digest)
    if store.exists(key):
        try:
            store.touch(key)  # reused by a new unit: restart its GC grace period
            return digest
        except errors.NotFound:
            pass  # collected between the two calls: write it again
    store.put(key, data)
    return digest


def get_blob(store: BlobStore, digest: str) -> bytes:
    """Read a CAS blob and verify it; raise DigestMismatch if the bytes do not match."""
    data = store.get(cas_key(digest))
    actual = "sha256:" + sha256_hex(data)
    if actual != digest:
        raise errors.DigestMismatch(
            f"blob {digest} in store {store.name!r} is corrupt (content hashes to {actual}); "
            "it will be read from another replica or the checkpoint falls back",
            digest=digest, actual=actual)
    return data
