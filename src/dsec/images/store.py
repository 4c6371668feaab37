"""ImageStore: the node-local image store (content store + unpacked layers + metadata).

Layout under ``root`` (= ``settings.home / "images"``)::

    blobs/sha256/<hex>   content store (layers, configs, manifests), verified blobs only
    layers/<hex>/        unpacked layers (see layers.py for sealing and verification)
    locks/               per-digest flock files (one in-flight fetch/unpack per digest)
    meta.db              SQLite: images, names, layer index, stats, leases, build cache
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel

from dsec.config import Settings, parse_bytes
from dsec.errors import DigestMismatch, ImageError, NotFound
from dsec.images import media, policy
from dsec.images.content import ContentStore
from dsec.images.db import MetaDB
from dsec.images.layers import LayerCache
from dsec.images.locks import KeyedLock
from dsec.images.oci import normalize_name
from dsec.models.image import ImageInfo, LayerInfo

Progress = Callable[[str, int, int], None]  # (label, advance_bytes, total_bytes)


class GcReport(BaseModel):
    removed_blobs: list[str] = []
    removed_layers: list[str] = []
    evicted_layers: list[str] = []
    removed_temp: int = 0
    freed_bytes: int = 0


class ImageStore:
    def __init__(self, root: Path, settings: Settings) -> None:
        self.root = root
        self.settings = settings
        root.mkdir(parents=True, exist_ok=True)
        self.content = ContentStore(root / "blobs")
        self.locks = KeyedLock(root / "locks")
        self.layers = LayerCache(root / "layers", self.locks, settings.layer_unpack_syncfs)
        self.db = MetaDB(root / "meta.db")
        self._infos: dict[str, ImageInfo] = {}  # image id -> info (content-addressed: immutable)
        self.hits = 0    # layer uses served from the local unpacked cache
        self.misses = 0  # layer uses that needed an unpack
        # Where missing blobs may come from before the registry (registry_ops.BlobSources):
        # set by a cluster node agent to its peers (dsec.cluster.p2p); None elsewhere.
        self.blob_sources: Any = None

    # --- lookup -----------------------------------------------------------------------
    def _info(self, image_id: str) -> ImageInfo:
        info = self._infos.get(image_id)
        if info is None:
            rows = self.db.q("SELECT info FROM images WHERE id=?", (image_id,))
            if not rows:
                raise NotFound(f"image {image_id} is not in the store")
            info = ImageInfo.model_validate_json(rows[0][0])
            self._infos[image_id] = info
        names = [r[0] for r in self.db.q("SELECT name FROM names WHERE image_id=? ORDER BY name", (image_id,))]
        last = self.db.q("SELECT last_used FROM images WHERE id=?", (image_id,))
        return info.model_copy(update={"names": names, "last_used": last[0][0] if last else None})

    def _resolve_id(self, ref: str) -> str:
        ref = ref.strip()
        hexpart = ref.removeprefix("sha256:")
        if ref.startswith("sha256:") or (len(hexpart) >= 12 and all(c in "0123456789abcdef" for c in hexpart)):
            rows = self.db.q("SELECT id FROM images WHERE id LIKE ?", (f"sha256:{hexpart}%",))
            if len(rows) == 1:
                return str(rows[0][0])
            if len(rows) > 1:
                raise ImageError(f"image id prefix {ref!r} is ambiguous ({len(rows)} images); give more digits")
        else:
            rows = self.db.q("SELECT image_id FROM names WHERE name=?", (normalize_name(ref),))
            if rows:
                return str(rows[0][0])
        have = [r[0] for r in self.db.q("SELECT name FROM names ORDER BY name")]
        raise NotFound(f"image {ref!r} not found on this node; available: {', '.join(have) or '(none)'}. "
                       "Import it with `dsec image import` or build it with `dsec image build`",
                       image=ref, available=have)

    def resolve(self, ref: str) -> ImageInfo:
        return self._info(self._resolve_id(ref))

    def resolve_fast(self, ref: str) -> ImageInfo:
        """Hot path: layers/config of ``ref`` from the in-memory index (names and
        last_used may be stale); one indexed SQLite lookup of the name."""
        image_id = self._resolve_id(ref)
        info = self._infos.get(image_id)
        return info if info is not None else self._info(image_id)

    def resolve_or_pull(self, ref: str) -> ImageInfo:
        """``resolve_fast``, pulling a missing image from its registry first when
        pull-on-create applies (``registry_ops.resolve_or_pull``)."""
        from dsec.images.registry_ops import resolve_or_pull
        return resolve_or_pull(self, ref)

    def list(self) -> list[ImageInfo]:
        ids = [r[0] for r in self.db.q("SELECT id FROM images ORDER BY created_at, id")]
        return [self._info(i) for i in ids]

    def manifest_digest(self, image_id: str) -> str:
        return str(self.db.q("SELECT manifest_digest FROM images WHERE id=?", (image_id,))[0][0])

    # --- registration -----------------------------------------------------------------
    def register(self, config: bytes, layers: list[LayerInfo], names: list[str],
                 manifest: bytes | None = None) -> ImageInfo:
        """Record an image whose blobs are all in the content store already."""
        config_digest = self.content.put_bytes(config, what="image config")
        try:
            cfg = json.loads(config)
        except ValueError as exc:
            raise ImageError(f"image config {config_digest} is not JSON ({exc})") from exc
        if manifest is None:
            manifest = json.dumps({
                "schemaVersion": 2, "mediaType": media.MT_OCI_MANIFEST,
                "config": {"mediaType": media.MT_OCI_CONFIG, "digest": config_digest, "size": len(config)},
                "layers": [{"mediaType": li.media_type, "digest": li.digest, "size": li.size} for li in layers],
            }, separators=(",", ":")).encode()
        manifest_digest = self.content.put_bytes(manifest, what="image manifest")
        for li in layers:
            if not self.content.has(li.digest):
                raise ImageError(f"layer blob {li.digest} is missing from the content store")
        c = cfg.get("config") or {}
        info = ImageInfo(id=config_digest, names=[], layers=layers, size=sum(li.size for li in layers),
                         created_at=time.time(), env=c.get("Env") or [], workdir=c.get("WorkingDir") or None,
                         entrypoint=c.get("Entrypoint"), cmd=c.get("Cmd"))
        now = time.time()
        names = [normalize_name(n) for n in names]
        with self.db.tx() as tx:
            row = tx.execute("SELECT info FROM images WHERE id=?", (config_digest,)).fetchone()
            if row is None:
                tx.execute("INSERT INTO images VALUES (?,?,?,?,NULL,0)",
                           (config_digest, manifest_digest, info.model_dump_json(), now))
                tx.executemany("INSERT OR REPLACE INTO image_layers VALUES (?,?,?,?,?,?)",
                               [(config_digest, i, li.digest, li.diff_id, li.size, li.media_type)
                                for i, li in enumerate(layers)])
            tx.executemany("INSERT OR REPLACE INTO names VALUES (?,?)", [(n, config_digest) for n in names])
            tx.executemany("INSERT OR REPLACE INTO blob_use VALUES (?,?)",
                           [(d, now) for d in [config_digest, manifest_digest] + [li.digest for li in layers]])
        self._infos.pop(config_digest, None)
        return self._info(config_digest)

    # --- layers -----------------------------------------------------------------------
    def _opener(self, li: LayerInfo) -> Callable[[], tuple[BinaryIO, str, str | None, bool]]:
        def open_blob() -> tuple[BinaryIO, str, str | None, bool]:
            comp = media.layer_compression(li.media_type, f"layer {li.digest}")
            if comp == "tar" and li.digest == li.diff_id:
                # Hashed up front (once per process), then unpacked with kernel copies.
                self.content.verify(li.digest, f"layer {li.digest}")
                return open(self.content.path(li.digest), "rb"), comp, li.digest, True
            # Verified while unpacking (the digest is recomputed from the bytes read).
            return open(self.content.path(li.digest), "rb"), comp, li.digest, False
        return open_blob

    def ensure_layer(self, li: LayerInfo, progress: Progress | None = None) -> Path:
        if self.layers.is_trusted(li.diff_id):  # hot path: one stat
            self.hits += 1
            return self.layers.fs(li.diff_id)
        if not self.content.has(li.digest) and not self.layers.present(li.diff_id):
            raise NotFound(f"layer {li.digest} (diff_id {li.diff_id}) is neither unpacked nor in the content "
                           "store; re-import the image")
        adv = (lambda n: progress(f"unpack {li.digest[7:19]}", n, li.size)) if progress else None
        try:
            path, hit = self.layers.ensure(li.diff_id, self._opener(li), f"layer {li.digest}", adv)
        except DigestMismatch as exc:
            if exc.details.get("expected") != li.digest:
                raise  # a config whose diff_id lies: the blob is fine (maybe shared), keep it
            # The stored blob itself is bad (disk corruption, tampering): never keep it.
            self.content.delete(li.digest)
            raise DigestMismatch(f"{exc.message}; the cached blob was removed, re-import the image",
                                 **exc.details) from exc
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        return path

    def layer_dirs(self, image_id: str, progress: Progress | None = None) -> list[Path]:
        """Unpacked, verified lower dirs of an image, bottom-most layer first."""
        info = self._infos.get(image_id) or self._info(image_id)
        return [self.ensure_layer(li, progress) for li in info.layers]

    def touch(self, image_id: str, diff_ids: list[str], lease_key: str | None = None,
              lease_objects: list[str] | None = None) -> None:
        """Record a use (and optionally take a lease) in one transaction."""
        now = time.time()
        with self.db.tx() as tx:
            if lease_key is not None:
                tx.executemany("INSERT OR IGNORE INTO leases VALUES (?,?,?)",
                               [(lease_key, o, now) for o in lease_objects or []])
            tx.execute("UPDATE images SET last_used=?, uses=uses+1 WHERE id=?", (now, image_id))
            tx.executemany("INSERT INTO layer_stats VALUES (?,?,1) ON CONFLICT(diff_id) DO UPDATE SET "
                           "last_used=excluded.last_used, uses=uses+1", [(d, now) for d in diff_ids])

    # --- layer index (scheduler) --------------------------------------------------------
    def local_layers(self) -> set[str]:
        """Layer blob digests this node holds (blob or unpacked dir present)."""
        rows = self.db.q("SELECT DISTINCT digest, diff_id FROM image_layers")
        return {d for d, diff in rows if self.content.has(d) or self.layers.present(diff)}

    def layer_index(self) -> dict[str, dict[str, int]]:
        """Per-image layer index: image id -> {layer digest: compressed size}."""
        out: dict[str, dict[str, int]] = {}
        for image_id, digest, size in self.db.q("SELECT image_id, digest, size FROM image_layers"):
            out.setdefault(image_id, {})[digest] = size
        return out

    def missing(self, image_layer_digests: Mapping[str, int] | Iterable[LayerInfo]) -> tuple[set[str], int]:
        wanted = (dict(image_layer_digests) if isinstance(image_layer_digests, Mapping)
                  else {li.digest: li.size for li in image_layer_digests})
        return policy.missing_layers(wanted, self.local_layers())

    # --- leases -------------------------------------------------------------------------
    def lease(self, key: str, objects: list[str]) -> None:
        self.db.add_lease(key, objects)

    def release(self, key: str) -> None:
        self.db.drop_lease(key)

    # --- import / export / remove / gc (implemented in ops.py to keep modules small) ----
    def import_archive(self, path: Path, name: str | None = None, progress: Progress | None = None) -> ImageInfo:
        from dsec.images.ops import import_archive
        return import_archive(self, Path(path), name, progress)

    def export(self, ref: str, path: Path, tag: str | None = None, compression: str | None = None) -> None:
        from dsec.images.ops import export
        export(self, ref, Path(path), tag, compression)

    def remove(self, ref: str) -> list[str]:
        from dsec.images.ops import remove
        return remove(self, ref)

    def gc(self, unused_s: float | None = None) -> GcReport:
        from dsec.images.ops import gc
        return gc(self, self.settings.image_gc_unused_s if unused_s is None else unused_s)

    def verify(self, ref: str, deep: bool = False) -> dict[str, str | None]:
        info = self.resolve(ref)
        out: dict[str, str | None] = {}
        for li in info.layers:
            reason = None
            try:
                self.content.verify(li.digest, f"layer {li.digest}")
            except (ImageError, NotFound) as exc:
                reason = exc.message
            if reason is None and self.layers.present(li.diff_id):
                reason = self.layers.verify(li.diff_id, deep=deep, blob_path=self.content.path)
            out[li.digest] = reason
        return out

    def preverify(self) -> dict[str, str | None]:
        """Unpack/verify every image's layers now (the per-process first-use check), so the
        first sandbox create does not pay it. Returns {diff_id: error or None}."""
        out: dict[str, str | None] = {}
        for info in self.list():
            for li in info.layers:
                if li.diff_id in out:
                    continue
                try:
                    self.ensure_layer(li)
                    out[li.diff_id] = None
                except (ImageError, NotFound) as exc:
                    out[li.diff_id] = exc.message
        return out

    def start_preverify(self) -> threading.Thread:
        """``preverify`` in a daemon thread (call at node start-up; prepares that need a
        layer being verified simply wait on that layer's lock)."""
        t = threading.Thread(target=self.preverify, name="dsec-image-preverify", daemon=True)
        t.start()
        return t

    def max_bytes(self) -> int:
        return parse_bytes(self.settings.image_cache_max_bytes)

    def new_lease_key(self, kind: str) -> str:
        return f"{kind}:{uuid.uuid4().hex}"
