"""The node's unpacked checkpoint layers (``DSEC_HOME/ckpt-layers``): materialize, pin, collect.

A restore unpacks each checkpoint layer once into ``<cache>/<digest hex>`` and mounts it
as a read-only overlay lower. Those dirs sit outside every sandbox quota, so they live
only while something needs them (issue 18 #3): a dir is kept while

* a mounted overlay (any sandbox on this node, either tier) has it as a lower dir — read
  from ``/proc/self/mountinfo``, the kernel's own record, so nothing can drift; or
* a restore in this process has materialized it and not yet mounted it (a pin); or
* it was made or reused less than ``checkpoint_layer_gc_grace_s`` ago (another process,
  e.g. a drill, between its unpack and its mount).

Everything else is deleted by ``gc`` (after a restored sandbox is killed, a checkpoint
deleted, a tenant removed). The blob store still holds the layers: a later restore of a
checkpoint that still exists unpacks them again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from dsec.blobs import BlobStore
from dsec.checkpoints.fsstate import materialize
from dsec.checkpoints.unit import LayerRef
from dsec.config import Settings, parse_bytes
from dsec.models import SandboxSpec

log = logging.getLogger(__name__)

_HEX = re.compile(r"^[0-9a-f]{64}$")
_SHARED: dict[Path, LayerCache] = {}
_SHARED_LOCK = threading.Lock()


def disk_quota(spec: SandboxSpec, settings: Settings) -> int:
    """The most one checkpoint of a sandbox of ``spec`` may hold: its writable-layer (disk)
    quota, capped by ``checkpoint_max_bytes`` (a capture holds the files in server memory)."""
    disk = spec.disk if isinstance(spec.disk, int) else parse_bytes(spec.disk or settings.default_disk)
    return min(disk, settings.checkpoint_max_bytes)


def _mountinfo_escape(path: str) -> str:
    """How the kernel writes a path in mountinfo (space, tab, newline, backslash as octal)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def lowers_in_use(root: Path, mountinfo: Iterable[str]) -> set[str]:
    """Pure: names of ``root``'s entries that appear in an overlay mount's lowerdir option."""
    prefix = _mountinfo_escape(str(root).rstrip("/")) + "/"
    pat = re.compile(re.escape(prefix) + r"([0-9a-f]{64})(?=[:,\s]|$)")
    used: set[str] = set()
    for line in mountinfo:
        _, sep, tail = line.partition(" - ")
        if sep and tail.startswith("overlay ") and prefix in tail:
            used.update(pat.findall(tail))
    return used


def collectable(entries: dict[str, float], in_use: set[str], pinned: set[str], now: float,
                grace_s: float) -> list[str]:
    """Pure GC decision: ``entries`` maps a cached layer name to its mtime."""
    return sorted(n for n, mtime in entries.items()
                  if n not in in_use and n not in pinned and now - mtime >= grace_s)


class LayerCache:
    """One per cache dir and process (``LayerCache.at``): the episode engine and sandbox
    checkpoints share it, so neither collects a layer the other is about to mount."""

    def __init__(self, root: Path, grace_s: float) -> None:
        self.root, self.grace_s = root, grace_s
        self._pins: Counter[str] = Counter()
        self._lock = threading.Lock()
        # False once a sweep left the dir empty: then a sweep (run after every kill) costs
        # nothing until the next restore unpacks something.
        self._maybe_entries = True
        self._made = 0  # materialize calls so far: a sweep clears the flag only if none came meanwhile
        self._pending: dict[float, tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle]] = {}
        self._tasks: set[asyncio.Task[int]] = set()

    @classmethod
    def at(cls, root: Path, grace_s: float) -> LayerCache:
        with _SHARED_LOCK:
            cache = _SHARED.get(root)
            if cache is None:
                cache = _SHARED[root] = cls(root, grace_s)
            return cache

    def materialize(self, store: BlobStore, chain: list[LayerRef], inline: dict[str, str] | None = None,
                    max_bytes: int | None = None) -> list[Path]:
        """``fsstate.materialize`` with every returned dir pinned: call ``unpin`` once the
        sandbox that mounts them exists (or failed)."""
        names = [ref.digest.removeprefix("sha256:") for ref in chain]
        with self._lock:
            self._pins.update(names)
            self._maybe_entries = True
            self._made += 1
        try:
            dirs = materialize(store, chain, self.root, inline, max_bytes)
        except BaseException:
            self.unpin(names)
            raise
        now = time.time()
        for d in dirs:  # reused: restart its grace period
            try:
                os.utime(d, (now, now))
            except OSError:
                pass
        return dirs

    def unpin(self, dirs: Iterable[Path | str]) -> None:
        with self._lock:
            for d in dirs:
                name = Path(d).name
                self._pins[name] -= 1
                if self._pins[name] <= 0:
                    del self._pins[name]

    def gc_now(self) -> int:
        """Delete every cached layer nothing needs (see the module doc); returns how many."""
        try:
            with os.scandir(self.root) as it:
                names = [e for e in it if _HEX.match(e.name) and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return 0
        entries = {}
        for e in names:
            try:
                entries[e.name] = e.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
        doomed = []
        # Under the pin lock: a restore either pinned its layers before (skipped here) or
        # unpinned them after its mount, which this mountinfo read then shows.
        with self._lock:
            made = self._made
            with open("/proc/self/mountinfo") as fh:
                in_use = lowers_in_use(self.root, fh)
            for name in collectable(entries, in_use, set(self._pins), time.time(), self.grace_s):
                # Rename first: a later materialize sees "missing" and unpacks afresh,
                # never a half-deleted dir.
                gone = self.root / f".{name}.gc-{os.getpid()}-{time.monotonic_ns()}"
                try:
                    os.rename(self.root / name, gone)
                except OSError:
                    continue
                doomed.append(gone)
        for gone in doomed:
            shutil.rmtree(gone, ignore_errors=True)
        n = len(doomed)
        with self._lock:
            if n == len(entries) and not self._pins and self._made == made:
                self._maybe_entries = False
        for e in os.scandir(self.root):  # temp dirs of an unpack or a gc that crashed
            if e.name.startswith(".") and (".gc-" in e.name or e.name.endswith(".tmp")):
                try:
                    if time.time() - e.stat(follow_symlinks=False).st_mtime >= max(self.grace_s, 60):
                        shutil.rmtree(e.path, ignore_errors=True)
                except FileNotFoundError:
                    pass
        if n:
            log.info("removed %d unused checkpoint layer dirs from %s", n, self.root)
        return n

    def sweep_soon(self) -> None:
        """Sweep a little later (after a teardown's unmount), debounced: at most one sweep
        pending per delay, whatever the teardown rate. The later one catches a slow unmount."""
        if not self._maybe_entries:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for delay in (2.0, 15.0):
            pending = self._pending.get(delay)
            if pending is not None and pending[0] is loop and not pending[1].cancelled():
                continue

            def fire(d: float = delay) -> None:
                self._pending.pop(d, None)
                task = loop.create_task(self.gc())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._pending[delay] = (loop, loop.call_later(delay, fire))

    async def gc(self) -> int:
        if not self._maybe_entries:
            return 0
        try:
            return await asyncio.to_thread(self.gc_now)
        except Exception:
            log.exception("checkpoint layer cache sweep of %s failed", self.root)
            return 0
