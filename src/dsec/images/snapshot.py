"""Snapshotter: image layers -> overlayfs mounts (containerd's Prepare/Commit idea).

``prepare`` is on the sandbox-create hot path, so it does no hashing: layers already
verified by this process cost one ``stat`` each (see layers.py); a lease named ``key``
protects them from GC/eviction until ``release(key)``. It also records, once per image
per process, the order in which the image's layers became ready and how long each took
(``access_order`` table): the prefetcher uses it to fetch layers in demand order. It
does NOT observe file-level reads inside a sandbox (that would need fanotify).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel

from dsec.images.pack import pack_layer
from dsec.images.store import ImageStore
from dsec.models.image import ImageInfo, LayerInfo
from dsec.node import syscalls


def access_orders(store: ImageStore) -> dict[str, list[str]]:
    """image id -> its layers' diff_ids in recorded first-demand order (one query: a node
    reports every image's order in its layer index, the prefetcher's input)."""
    out: dict[str, list[str]] = {}
    for image_id, diff_id in store.db.q("SELECT image_id, diff_id FROM access_order ORDER BY image_id, seq"):
        out.setdefault(str(image_id), []).append(str(diff_id))
    return out


class OverlayMounts(BaseModel):
    lower_dirs: list[str]  # top-most first (overlayfs order), extra_lower_dirs on top
    upper_dir: str
    work_dir: str
    image: ImageInfo


class Snapshotter:
    def __init__(self, store: ImageStore) -> None:
        self.store = store
        self._recorded: set[str] = set()

    def prepare(self, key: str, image_ref: str, scratch_dir: Path,
                extra_lower_dirs: list[Path] | None = None) -> OverlayMounts:
        store = self.store
        info = store.resolve_fast(image_ref)
        objects = [info.id] + [li.digest for li in info.layers] + [li.diff_id for li in info.layers]
        # Lease (and use stats) before ensuring the layers: GC must not race us.
        store.touch(info.id, [li.diff_id for li in info.layers], key, objects)
        try:
            dirs: list[Path] = []
            timings: list[tuple[str, float]] = []
            for li in info.layers:
                t0 = time.perf_counter()
                dirs.append(store.ensure_layer(li))
                timings.append((li.diff_id, (time.perf_counter() - t0) * 1000))
            upper, work = scratch_dir / "upper", scratch_dir / "work"
            for d in (upper, work):  # plain mkdir: makedirs' extra stats cost on slow disks
                try:
                    os.mkdir(d, 0o755)
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    os.makedirs(d, exist_ok=True)
            lower = [str(p) for p in (extra_lower_dirs or [])] + [str(d) for d in reversed(dirs)]
            if not lower:  # an image with no layers: overlay still needs one lower dir
                empty = scratch_dir / "empty"
                os.makedirs(empty, exist_ok=True)
                lower = [str(empty)]
            if info.id not in self._recorded:
                self._record_order(info.id, timings)
        except BaseException:
            store.release(key)
            raise
        return OverlayMounts(lower_dirs=lower, upper_dir=str(upper), work_dir=str(work), image=info)

    def _record_order(self, image_id: str, timings: list[tuple[str, float]]) -> None:
        now = time.time()
        with self.store.db.tx() as tx:
            base = tx.execute("SELECT COUNT(*) FROM access_order WHERE image_id=?", (image_id,)).fetchone()[0]
            for i, (diff_id, ms) in enumerate(timings):
                tx.execute("INSERT OR IGNORE INTO access_order VALUES (?,?,?,?,?)",
                           (image_id, diff_id, base + i, now, ms))
        self._recorded.add(image_id)

    def access_order(self, image_id: str) -> list[tuple[str, float]]:
        """(diff_id, ms until ready at first demand) in first-demand order."""
        rows = self.store.db.q("SELECT diff_id, ready_ms FROM access_order WHERE image_id=? ORDER BY seq",
                               (image_id,))
        return [(str(d), float(ms)) for d, ms in rows]

    def mount(self, m: OverlayMounts, target: Path) -> None:
        syscalls.mount_overlay(str(target), m.lower_dirs, m.upper_dir, m.work_dir)

    def release(self, key: str) -> None:
        self.store.release(key)

    def commit(self, upper_dir: Path) -> LayerInfo:
        """Overlay upper dir -> deterministic OCI layer blob in the content store."""
        s = self.store.settings
        with self.store.content.writer() as w:
            res = pack_layer(Path(upper_dir), w, s.layer_compression, s.layer_zstd_level,  # type: ignore[arg-type]
                             overlay_upper=True)
            digest, size = w.commit(what=f"layer committed from {upper_dir}")
        return LayerInfo(digest=digest, diff_id=res.diff_id, size=size, media_type=res.media_type)
