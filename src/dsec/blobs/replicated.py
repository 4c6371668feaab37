"""Replicated BlobStore: every put goes to all replicas; reads verify and fail over.

A put is acknowledged only when every replica holds the object, so losing any single
replica (disk, corruption) never loses an acknowledged write. Reads check the bytes
against the digest the key promises (see ``base.content_ok``), try the next replica on
a mismatch or a miss, and repair the bad replica from the good copy.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from dsec import errors
from dsec.blobs.base import BlobStat, BlobStore, content_ok

log = logging.getLogger(__name__)


class ReplicatedBlobStore:
    def __init__(self, replicas: list[BlobStore]) -> None:
        if not replicas:
            raise errors.InvalidArgument("a replicated blob store needs at least one replica")
        self.replicas = list(replicas)
        self.name = "replicated(" + ", ".join(r.name for r in self.replicas) + ")"
        # Replicas live on different disks: write them in parallel, not one after another.
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="blob-rep")

    def put(self, key: str, data: bytes) -> None:
        futures = [self._pool.submit(r.put, key, data) for r in self.replicas]
        failures: list[BaseException] = []
        for fut in futures:
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                failures.append(exc)
        if failures:
            # Best effort: do not leave the object visible on a subset of replicas.
            for r, fut in zip(self.replicas, futures):
                if fut.exception() is None:
                    try:
                        r.delete(key)
                    except Exception:  # noqa: BLE001
                        log.warning("could not roll back %s on %s", key, r.name)
            full = [f for f in failures if isinstance(f, errors.StorageFull)]
            raise (full or failures)[0]

    def get(self, key: str) -> bytes:
        bad: list[BlobStore] = []
        last: Exception | None = None
        corrupt = False
        for r in self.replicas:
            try:
                data = r.get(key)
            except errors.NotFound as exc:
                bad.append(r)
                last = exc
                continue
            except errors.DSecError as exc:
                last = exc
                continue
            if not content_ok(key, data):
                log.warning("replica %s holds a corrupt copy of %s", r.name, key)
                bad.append(r)
                corrupt = True
                last = errors.DigestMismatch(f"blob {key!r} corrupt on {r.name}", key=key)
                continue
            self._repair(key, data, bad)
            return data
        if corrupt:
            raise errors.DigestMismatch(
                f"blob {key!r} is missing or corrupt on every replica of {self.name}", key=key)
        if last is None or isinstance(last, errors.NotFound):
            raise errors.NotFound(f"blob {key!r} not found in any replica of {self.name}", key=key)
        raise last

    def _repair(self, key: str, data: bytes, bad: list[BlobStore]) -> None:
        for r in bad:
            try:
                r.put(key, data)
                log.info("repaired %s on %s", key, r.name)
            except Exception as exc:  # noqa: BLE001 - repair is opportunistic
                log.warning("could not repair %s on %s: %s", key, r.name, exc)

    def exists(self, key: str) -> bool:
        # A write is complete only if every replica has it (put is all-replicas).
        return all(r.exists(key) for r in self.replicas)

    def stat(self, key: str) -> BlobStat:
        last: Exception | None = None
        for r in self.replicas:
            try:
                return r.stat(key)
            except errors.NotFound as exc:
                last = exc
        raise last or errors.NotFound(f"blob {key!r} not found", key=key)

    def touch(self, key: str) -> None:
        for r in self.replicas:
            r.touch(key)

    def delete(self, key: str) -> None:
        for r in self.replicas:
            r.delete(key)

    def list(self, prefix: str) -> list[str]:
        keys: set[str] = set()
        for r in self.replicas:
            try:
                keys.update(r.list(prefix))
            except errors.DSecError as exc:
                log.warning("listing %s on %s failed: %s", prefix, r.name, exc)
        return sorted(keys)
