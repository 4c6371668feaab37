"""Image import, export, removal and GC on top of ImageStore.

Failure rule: an import that fails anywhere (corrupt tar, digest mismatch, unknown
media type, missing blob, unsafe layer) removes every blob and unpacked layer it created
that no other image references, and registers nothing; existing images are untouched
(content addressing means it never overwrites a blob with different bytes).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Self

from dsec.errors import DigestMismatch, ImageError, InvalidArgument
from dsec.images import media, policy
from dsec.images.oci import normalize_name, plan_archive, write_layout
from dsec.models.image import ImageInfo, LayerInfo

if TYPE_CHECKING:
    from dsec.images.store import GcReport, ImageStore, Progress


class _Prefixed:
    """A stream with a few already-read bytes put back in front."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = head
        self._rest = rest

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n < 0 or n >= len(self._head):
                out, self._head = self._head, b""
                return out + (self._rest.read(n - len(out)) if n >= 0 else self._rest.read())
            out, self._head = self._head[:n], self._head[n:]
            return out
        return self._rest.read(n)


def import_archive(store: ImageStore, path: Path, name: str | None, progress: Progress | None) -> ImageInfo:
    src, plans = plan_archive(path)
    if name and len(plans) > 1:
        # Several images: --name NAME:TAG picks the one whose tag matches.
        tag = normalize_name(name).rsplit(":", 1)[1]
        plans = [p for p in plans if any(n.rsplit(":", 1)[1] == tag for n in p.names)]
        if len(plans) != 1:
            src.close()
            raise InvalidArgument(f"image archive {path} holds several images and {len(plans)} have tag {tag!r}; "
                                  "give --name NAME:TAG with a tag present in the archive")
    lease = store.new_lease_key("import")
    new_blobs: list[str] = []
    new_layers: list[str] = []
    result: ImageInfo | None = None
    total = sum(lp.size for p in plans for lp in p.layers)
    try:
        for plan in plans:
            # Objects this plan may create, known up front (digest of docker-save compressed
            # layers is not: those go serially, where the loop tracks what it creates).
            known = [(lp.digest or lp.diff_id) for lp in plan.layers]
            new_blobs += [d for d in known if not store.content.has(d)]
            new_layers += [lp.diff_id for lp in plan.layers if not store.layers.present(lp.diff_id)]
            store.lease(lease, known + [lp.diff_id for lp in plan.layers])
            parallel = (len(plan.layers) > 1 and sum(lp.size for lp in plan.layers) >= store.settings.image_parallel_unpack_min_bytes
                        and store.settings.image_unpack_workers > 1)
            if parallel:
                layers = _import_layers_parallel(store, path, plan.layers, progress, total)
            else:
                layers = []
                for i, lp in enumerate(plan.layers):
                    li, created = _import_layer(store, src, path, i, lp, progress, total)
                    if created and li.digest not in new_blobs:
                        new_blobs.append(li.digest)
                    store.lease(lease, [li.digest])
                    layers.append(li)
            if any(li.digest != (lp.digest or li.digest) for li, lp in zip(layers, plan.layers)):
                plan.manifest = None  # a blob was re-encoded: synthesize our manifest
            names = [normalize_name(name)] if name else (plan.names or [f"{path.name.split('.')[0]}:latest"])
            result = store.register(plan.config, layers, names, plan.manifest)
        assert result is not None
        evict(store)  # keep the unpacked cache within budget (this import's layers are leased)
        return result
    except BaseException:
        _rollback(store, new_blobs, new_layers, lease)
        raise
    finally:
        store.release(lease)
        src.close()


def _import_layer(store: ImageStore, src: object, path: Path, i: int, lp: object, progress: Progress | None,
                  total: int) -> tuple[LayerInfo, bool]:
    """Ingest (verified) and unpack one layer. Returns (layer, whether its blob is new)."""
    what = f"layer {i} ({lp.path}) of {path}"  # type: ignore[attr-defined]
    adv = (lambda n: progress("import", n, total)) if progress else None
    with src.open(lp.path) as fh:  # type: ignore[attr-defined]
        head = fh.read(4)
        comp = media.sniff_compression(head) if lp.media_type is None else \
            media.layer_compression(lp.media_type, what)  # type: ignore[attr-defined]
        mt = lp.media_type or media.COMPRESSION_MT[comp]  # type: ignore[attr-defined]
        if comp == "tar" and store.settings.layer_import_compress and not store.layers.present(lp.diff_id):  # type: ignore[attr-defined]
            # Uncompressed and we store it compressed: ONE pass unpacks it and tees the
            # bytes into the compressor (the raw tar is never written).
            if lp.digest is not None and lp.digest != lp.diff_id:  # type: ignore[attr-defined]
                raise DigestMismatch(f"{what}: uncompressed layer has digest {lp.digest} but diff_id "  # type: ignore[attr-defined]
                                     f"{lp.diff_id}; they must be equal", expected=lp.digest, actual=lp.diff_id)  # type: ignore[attr-defined]
            existed = store.content.has(lp.diff_id)  # type: ignore[attr-defined]
            li = _ingest_and_unpack(store, _Prefixed(head, fh), lp.diff_id, what, adv)  # type: ignore[arg-type,attr-defined]
            return li, not existed
        expected = lp.digest or (lp.diff_id if comp == "tar" else None)  # type: ignore[attr-defined]
        # One writer per known digest (threads and processes); the others wait, then
        # find the blob present and only verify it.
        with store.locks.hold("blob-" + expected) if expected else contextlib.nullcontext():
            existed = expected is not None and store.content.has(expected)
            digest, size = store.content.ingest(_Prefixed(head, fh), expected, what, adv)  # type: ignore[arg-type]
    li = LayerInfo(digest=digest, diff_id=lp.diff_id, size=size, media_type=mt)  # type: ignore[attr-defined]
    store.ensure_layer(li, progress)
    return li, not existed


def _import_layers_parallel(store: ImageStore, path: Path, plans: list, progress: Progress | None,  # type: ignore[type-arg]
                            total: int) -> list[LayerInfo]:
    """Unpack an image's layers in worker processes (``python -m dsec.images.worker``):
    tar parsing is Python (GIL-bound), and on a shared machine more runnable workers also
    get a fairer share of the CPUs. Plain subprocesses, not multiprocessing: nothing
    re-imports the caller's ``__main__``, and a threaded parent (API server) is safe."""
    import concurrent.futures as cf
    import json
    import subprocess
    import sys

    from dsec.errors import error_from_dict

    workers = min(len(plans), store.settings.image_unpack_workers)
    settings_json = store.settings.model_dump_json()
    out: list[LayerInfo | None] = [None] * len(plans)
    errors: list[BaseException] = []

    def run_one(k: int) -> tuple[int, bytes, bytes]:
        job = {"root": str(store.root), "settings": settings_json, "archive": str(path), "index": k,
               "layer": {"path": plans[k].path, "digest": plans[k].digest, "diff_id": plans[k].diff_id,
                         "media_type": plans[k].media_type, "size": plans[k].size}}
        # Each thread waits for its own child only (never os.wait(): not ours to reap).
        proc = subprocess.run([sys.executable, "-m", "dsec.images.worker"], input=json.dumps(job).encode(),
                              capture_output=True, check=False)
        return k, proc.stdout, proc.stderr

    order = sorted(range(len(plans)), key=lambda k: -plans[k].size)  # biggest first
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsec-unpack") as pool:
        for fut in cf.as_completed([pool.submit(run_one, k) for k in order]):
            k, reply_raw, err_raw = fut.result()
            try:
                reply = json.loads(reply_raw)
            except ValueError:
                errors.append(ImageError(f"layer {k} of {path}: unpack worker died: "
                                         f"{err_raw.decode(errors='replace')[-500:]}"))
                continue
            if "error" in reply:
                errors.append(error_from_dict(reply["error"], 500))
                continue
            out[k] = LayerInfo.model_validate(reply["layer"])
            store.misses += reply["misses"]
            store.hits += 1 - reply["misses"]
            if progress:
                progress("import", plans[k].size, total)
    if errors:
        raise errors[0]  # every worker has finished: nothing is still writing
    for li in out:
        assert li is not None
        store.layers.mark_trusted(li.diff_id)  # verified by the worker that unpacked it
    return out  # type: ignore[return-value]


class _Tee:
    """Reads from ``src`` and copies every chunk read into ``sink``."""

    def __init__(self, src: BinaryIO, sink: object) -> None:
        self._src = src
        self._sink = sink

    def read(self, n: int = -1) -> bytes:
        data = self._src.read(n)
        if data:
            self._sink.write(data)  # type: ignore[attr-defined]
        return data

    def close(self) -> None:
        pass  # the caller owns both ends

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _ingest_and_unpack(store: ImageStore, stream: BinaryIO, diff_id: str, what: str,
                       progress: Callable[[int], None] | None) -> LayerInfo:
    from dsec.images.fsutil import CHUNK

    s = store.settings
    with store.content.writer() as w:
        comp = media.compressing_writer(w, s.layer_compression, s.layer_zstd_level,  # type: ignore[arg-type]
                                        threads=s.layer_import_threads)
        tee = _Tee(stream, comp)
        _, hit = store.layers.ensure(diff_id, lambda: (tee, "tar", diff_id, False), what, progress)  # type: ignore[arg-type,return-value]
        if hit:  # another process unpacked it meanwhile: still store the blob
            while tee.read(CHUNK):
                pass
        else:
            store.misses += 1
        comp.close()
        digest, size = w.commit(what=what)
    return LayerInfo(digest=digest, diff_id=diff_id, size=size, media_type=media.COMPRESSION_MT[s.layer_compression])


def _rollback(store: ImageStore, blobs: list[str], layers: list[str], lease: str) -> None:
    store.release(lease)
    referenced = _referenced(store)
    leased = store.db.leased_objects()
    for d in blobs:
        if d not in referenced and d not in leased:
            store.content.delete(d)
    for d in layers:
        if d not in referenced and d not in leased:
            store.layers.remove(d)


def _referenced(store: ImageStore) -> set[str]:
    refs: set[str] = set()
    for image_id, manifest in store.db.q("SELECT id, manifest_digest FROM images"):
        refs.update((image_id, manifest))
    for digest, diff_id in store.db.q("SELECT digest, diff_id FROM image_layers"):
        refs.update((digest, diff_id))
    for digest, diff_id in store.db.q("SELECT digest, diff_id FROM build_cache"):
        refs.update((digest, diff_id))
    return refs


def export(store: ImageStore, ref: str, path: Path, tag: str | None, compression: str | None = None) -> None:
    """Write an OCI image layout (directory, or a tar of one when PATH ends in .tar).

    ``compression`` (gzip | zstd | tar) re-encodes layers whose compression differs, for
    older consumers (umoci 0.4.7 reads no zstd); None keeps the stored blobs as they are.
    """
    import json

    info = store.resolve(ref)
    mdigest = store.manifest_digest(info.id)
    digests = [mdigest, info.id] + [li.digest for li in info.layers]
    for d in digests:
        store.content.verify(d, f"blob {d} of image {ref}")
    raw = store.content.read_bytes(mdigest)
    manifest = json.loads(raw)
    mtype = manifest.get("mediaType") or media.MT_OCI_MANIFEST
    if tag is None:
        tag = ref.rsplit(":", 1)[1] if ":" in ref and not ref.startswith("sha256:") else (
            info.names[0].rsplit(":", 1)[1] if info.names else "latest")
    blobs = {d: store.content.path(d) for d in digests}
    final = path
    work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.")) if path.suffix == ".tar" else path
    try:
        if compression is not None:
            manifest, raw, mdigest = _recompress(store, info, manifest, compression, work, blobs)
            mtype = manifest.get("mediaType") or media.MT_OCI_MANIFEST
            blobs[mdigest] = _write_blob(work, raw)
        write_layout(work, blobs, mdigest, len(raw), mtype, [tag])
        if work is not final:
            part = final.with_name(final.name + ".part")
            with tarfile.open(part, "w", format=tarfile.PAX_FORMAT) as tf:
                for p in sorted(work.rglob("*")):
                    tf.add(p, arcname=str(p.relative_to(work)), recursive=False)
            os.replace(part, final)
    finally:
        if work is not final:
            shutil.rmtree(work, ignore_errors=True)


def _write_blob(dest: Path, data: bytes) -> Path:
    from dsec.images.fsutil import digest_of

    d = dest / "blobs" / "sha256"
    d.mkdir(parents=True, exist_ok=True)
    p = d / digest_of(data)[7:]
    p.write_bytes(data)
    return p


def _recompress(store: ImageStore, info: ImageInfo, manifest: dict, compression: str, dest: Path,  # type: ignore[type-arg]
                blobs: dict[str, Path]) -> tuple[dict, bytes, str]:  # type: ignore[type-arg]
    import json

    from dsec.images.fsutil import CHUNK, HashingWriter, digest_of

    out_dir = dest / "blobs" / "sha256"
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = []
    for li, desc in zip(info.layers, manifest.get("layers") or []):
        comp = media.layer_compression(li.media_type, f"layer {li.digest}")
        if comp == compression:
            layers.append(desc)
            continue
        tmp = out_dir / f".tmp-{li.digest[7:]}"
        with open(store.content.path(li.digest), "rb") as src, open(tmp, "wb") as fh:
            hw = HashingWriter(fh)  # type: ignore[arg-type]
            sink = media.compressing_writer(hw, compression, store.settings.layer_zstd_level)  # type: ignore[arg-type]
            reader = media.decompressing_reader(src, comp)
            while chunk := reader.read(CHUNK):
                sink.write(chunk)
            sink.close()
        os.replace(tmp, out_dir / hw.digest[7:])
        blobs.pop(li.digest, None)
        blobs[hw.digest] = out_dir / hw.digest[7:]
        layers.append({"mediaType": media.COMPRESSION_MT[compression], "digest": hw.digest, "size": hw.count})
    new = dict(manifest, layers=layers)
    if new.get("mediaType") == media.MT_DOCKER_MANIFEST:
        new["mediaType"] = media.MT_OCI_MANIFEST
    raw = json.dumps(new, separators=(",", ":")).encode()
    return new, raw, digest_of(raw)


def remove(store: ImageStore, ref: str) -> list[str]:
    """Untag a name (removing the image when it was its last name), or remove by id."""
    image_id = store._resolve_id(ref)
    by_name = not (ref.startswith("sha256:") or ref == image_id[7:7 + len(ref)])
    now = time.time()
    with store.db.tx() as tx:
        if by_name:
            tx.execute("DELETE FROM names WHERE name=?", (normalize_name(ref),))
            left = tx.execute("SELECT COUNT(*) FROM names WHERE image_id=?", (image_id,)).fetchone()[0]
            if left:
                return [normalize_name(ref)]
        names = [r[0] for r in tx.execute("SELECT name FROM names WHERE image_id=?", (image_id,))]
        rows = tx.execute("SELECT digest FROM image_layers WHERE image_id=?", (image_id,)).fetchall()
        mdig = tx.execute("SELECT manifest_digest FROM images WHERE id=?", (image_id,)).fetchone()[0]
        tx.executemany("INSERT OR REPLACE INTO blob_use VALUES (?,?)",
                       [(d, now) for d in [image_id, mdig] + [r[0] for r in rows]])
        tx.execute("DELETE FROM names WHERE image_id=?", (image_id,))
        tx.execute("DELETE FROM image_layers WHERE image_id=?", (image_id,))
        tx.execute("DELETE FROM images WHERE id=?", (image_id,))
    store._infos.pop(image_id, None)
    return [image_id] + names


def gc(store: ImageStore, unused_s: float) -> GcReport:
    from dsec.images.store import GcReport

    now = time.time()
    report = GcReport()
    with store.db.tx() as tx:
        tx.execute("DELETE FROM build_cache WHERE created < ?", (now - unused_s,))
    referenced = _referenced(store)
    leased = store.db.leased_objects()
    blob_use = dict(store.db.q("SELECT digest, last_used FROM blob_use"))
    present_blobs = {}
    for d in store.content.all_digests():
        try:
            present_blobs[d] = max(blob_use.get(d, 0.0), store.content.path(d).stat().st_mtime)
        except FileNotFoundError:
            continue
    for d in policy.gc_candidates(present_blobs, referenced, leased, unused_s, now):
        with store.locks.hold("blob-" + d):
            report.freed_bytes += store.content.delete(d)
        report.removed_blobs.append(d)
    stats = {r[0]: (r[1], r[2]) for r in store.db.q("SELECT diff_id, last_used, uses FROM layer_stats")}
    present_layers = {}
    for d in store.layers.all_diff_ids():
        present_layers[d] = max(stats.get(d, (0.0, 0))[0], store.layers.dir(d).stat().st_mtime)
    for d in policy.gc_candidates(present_layers, referenced, leased, unused_s, now):
        with store.locks.hold("layer-" + d):
            report.freed_bytes += store.layers.remove(d)
        report.removed_layers.append(d)
    for d, freed in evict(store, leased, stats, present_layers, now):
        report.evicted_layers.append(d)
        report.freed_bytes += freed
    report.removed_temp = store.layers.clean_temp() + _clean_ingest(store)
    return report


def evict(store: ImageStore, leased: set[str] | None = None, stats: dict | None = None,  # type: ignore[type-arg]
          present: dict[str, float] | None = None, now: float | None = None) -> list[tuple[str, int]]:
    """Apply the cache budget (policy.plan_eviction) to unpacked layer dirs. Blobs stay,
    so an evicted layer is re-unpacked (and re-verified) on its next use."""
    now = time.time() if now is None else now
    leased = store.db.leased_objects() if leased is None else leased
    if stats is None:
        stats = {r[0]: (r[1], r[2]) for r in store.db.q("SELECT diff_id, last_used, uses FROM layer_stats")}
    images = [policy.ImageStat(i, lu or ca) for i, lu, ca in store.db.q("SELECT id, last_used, created_at FROM images")]
    owners: dict[str, set[str]] = {}
    for image_id, diff_id in store.db.q("SELECT image_id, diff_id FROM image_layers"):
        owners.setdefault(diff_id, set()).add(image_id)
    lstats = []
    for d in store.layers.all_diff_ids():
        try:
            mtime = store.layers.dir(d).stat().st_mtime
        except FileNotFoundError:
            continue
        last, uses = stats.get(d, ((present or {}).get(d, mtime), 0))
        lstats.append(policy.LayerStat(d, store.layers.unpacked_size(d), uses, last, mtime,
                                       frozenset(owners.get(d, ()))))
    out = []
    for d in policy.plan_eviction(lstats, images, leased, store.settings.image_cache_max_images,
                                  store.max_bytes(), now):
        with store.locks.hold("layer-" + d):
            # A prepare's fast path takes no lock: re-check the lease once the dir is gone.
            freed = store.layers.remove(d, still_free=lambda d=d: d not in store.db.leased_objects())
            if freed >= 0:
                out.append((d, freed))
    return out


def _clean_ingest(store: ImageStore) -> int:
    n = 0
    for p in store.content.ingest_dir.iterdir():
        pid = p.name[1:].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        elif pid.isdigit():
            continue
        p.unlink(missing_ok=True)
        n += 1
    return n


__all__ = ["evict", "export", "gc", "import_archive", "remove"]
