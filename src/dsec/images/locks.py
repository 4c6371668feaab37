"""One in-flight operation per key (digest), across threads AND processes.

A per-key ``threading.Lock`` serialises threads of this process (flock is per open file
description, so two threads could otherwise both "hold" it); an ``fcntl.flock`` on
``<dir>/<key>.lock`` serialises processes. Callers re-check "already done?" after
acquiring, which is what turns N concurrent requests into one fetch/unpack.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class KeyedLock:
    def __init__(self, lock_dir: Path) -> None:
        self._dir = lock_dir
        self._dir.mkdir(parents=True, exist_ok=True)
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    def _acquire_thread(self, key: str) -> threading.Lock:
        with self._guard:
            lock, refs = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, refs + 1)
        lock.acquire()
        return lock

    def _release_thread(self, key: str, lock: threading.Lock) -> None:
        lock.release()
        with self._guard:
            _, refs = self._locks[key]
            if refs <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, refs - 1)

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        safe = key.replace(":", "_").replace("/", "_")
        lock = self._acquire_thread(safe)
        try:
            fd = os.open(self._dir / f"{safe}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing drops the flock
        finally:
            self._release_thread(safe, lock)
