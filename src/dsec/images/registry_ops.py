"""``push`` / ``pull`` between the local ImageStore and an OCI distribution registry.

Push sends the stored blobs byte for byte (layer digests and the manifest digest are
unchanged). Pull follows the store's failure rule (``ops.py``): every blob is streamed
into ``blobs/ingest``, its size bounded by the descriptor, its sha256 compared with the
manifest's digest, and only then renamed into place; a pull that fails anywhere removes
every blob/layer it created that nothing else references, and registers nothing.

Single flight: one fetch per blob digest at a time across threads and processes
(``store.locks`` ``blob-<digest>``, the same key imports use); a waiter finds the blob
present and only re-verifies it. At most ``image_max_concurrent_pulls`` blobs move at once.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from dsec.errors import (
    DigestMismatch,
    DSecError,
    Forbidden,
    ImageError,
    InvalidArgument,
    NotFound,
    TransientError,
    Unauthorized,
)
from dsec.images import media
from dsec.images.fsutil import check_digest, digest_of
from dsec.images.oci import normalize_name
from dsec.images.registry import MAX_CONFIG_BYTES, Reference, RegistryClient, parse_reference, pick_platform
from dsec.models.image import ImageInfo, LayerInfo, PullStatus

FETCH_ATTEMPTS = 3  # per blob; only transient failures (connection broke, 5xx, 429) are retried

if TYPE_CHECKING:
    from dsec.config import Settings
    from dsec.images.store import ImageStore, Progress

log = logging.getLogger("dsec.images.registry")


class BlobSources(Protocol):
    """Where a missing blob may come from besides the registry (``dsec.cluster.p2p``:
    peers that hold it). Called with the node's ``blob-<digest>`` lock held and the blob
    absent; must leave the blob committed (verified) in ``store.content`` or raise.
    ``from_registry()`` fetches it from the registry. Returns the source's label
    (``registry`` or ``peer:<node>``)."""

    def fetch(self, store: ImageStore, digest: str, size: int, what: str, progress: Progress | None,
              from_registry: Callable[[], None]) -> str: ...


_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


def node_slots(n: int) -> threading.BoundedSemaphore:
    """The process-wide bound on blob transfers (``node_max_concurrent_pulls``): a node
    agent is one process, so this bounds the node however many pulls run at once."""
    with _SLOTS_LOCK:
        sem = _SLOTS.get(n)
        if sem is None:
            sem = _SLOTS[n] = threading.BoundedSemaphore(n)
        return sem


class PullTracker:
    """Pulls of this process, in progress and the last few finished (``dsec node ls``)."""

    KEEP = 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[int, PullStatus] = {}
        self._recent: collections.deque[PullStatus] = collections.deque(maxlen=self.KEEP)
        self._seq = 0
        self.prefetched_bytes = 0  # fetched (not local) by prefetch pulls since this process started

    def start(self, ref: str, total: int, blobs: int, prefetch: bool = False) -> int:
        with self._lock:
            self._seq += 1
            self._active[self._seq] = PullStatus(ref=ref, total_bytes=total, blobs=blobs, started_at=time.time(),
                                                 prefetch=prefetch)
            return self._seq

    def real_active(self) -> int:
        """Pulls in flight that a create waits on (not prefetches): prefetch yields to them."""
        with self._lock:
            return sum(1 for st in self._active.values() if not st.prefetch)

    def advance(self, key: int, n: int) -> None:
        with self._lock:
            st = self._active.get(key)
            if st is not None:
                st.done_bytes = min(st.total_bytes, st.done_bytes + n)

    def blob_done(self, key: int, source: str, size: int) -> None:
        with self._lock:
            st = self._active.get(key)
            if st is not None:
                st.blobs_done += 1
                st.sources[source] = st.sources.get(source, 0) + size
                if st.prefetch and source != "local":
                    self.prefetched_bytes += size

    def fetched(self, key: int) -> None:
        with self._lock:
            st = self._active.get(key)
            if st is not None:
                st.fetch_seconds = round(time.time() - st.started_at, 3)

    def finish(self, key: int, error: str = "") -> None:
        with self._lock:
            st = self._active.pop(key, None)
            if st is not None:
                st.state = "failed" if error else "done"
                st.error = error
                st.seconds = round(time.time() - st.started_at, 3)
                self._recent.append(st)

    def snapshot(self) -> list[PullStatus]:
        now = time.time()
        with self._lock:
            active = [s.model_copy(update={"seconds": round(now - s.started_at, 3)}) for s in self._active.values()]
            return active + [s.model_copy() for s in self._recent]


PULLS = PullTracker()
_ACTIVE = [0]  # pulls in flight in this process (see the batched syncfs in pull())
_ACTIVE_LOCK = threading.Lock()


class Credentials:
    """Registry credentials: explicit values win over settings (never logged)."""

    def __init__(self, username: str | None = None, password: str | None = None) -> None:
        self.username = username
        self.password = password


def client_for(store: ImageStore, registry: str, insecure: bool = False,
               creds: Credentials | None = None) -> RegistryClient:
    s = store.settings
    user = (creds.username if creds and creds.username else None) or s.registry_username
    pw = (creds.password if creds and creds.password is not None else None) or s.registry_password
    return RegistryClient(registry, username=user, password=pw, insecure=insecure, ca_file=s.registry_ca_file,
                          timeout_s=s.registry_timeout_s, pool=max(2, s.image_max_concurrent_pulls + 2))


def _run_bounded(fn: Callable[[Any], Any], items: list[Any], workers: int) -> list[Any]:
    """Run ``fn`` over items with at most ``workers`` at once; wait for ALL to finish
    before raising the first error (nothing is still writing when the caller rolls back)."""
    if len(items) <= 1 or workers <= 1:
        return [fn(i) for i in items]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dsec-registry") as pool:
        futs = {pool.submit(fn, it): k for k, it in enumerate(items)}
        for fut in cf.as_completed(futs):
            try:
                results[futs[fut]] = fut.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below after every worker finished
                errors.append(exc)
    if errors:
        raise errors[0]
    return results


# --- pull ---------------------------------------------------------------------------------

def _fetch_blob(store: ImageStore, rc: RegistryClient, ref: Reference, digest: str, size: int, what: str,
                progress: Progress | None, sources: BlobSources | None = None,
                deferred: list[tuple[Path, str]] | None = None) -> str:
    """Fetch one blob into the content store, verified. Returns where it came from:
    ``local`` (already here), ``registry`` or what ``sources`` says (a peer).
    ``deferred`` (registry only): leave the verified bytes in ingest/ and append
    (file, digest); the caller makes the batch durable and renames it (``place_durable``)."""
    with store.locks.hold("blob-" + digest):
        if store.content.has(digest):
            store.content.verify(digest, what)  # re-hash once per process; a bad one is removed
            if progress:
                progress(f"{digest[7:19]} (local)", size, size)
            return "local"

        def from_registry() -> None:
            with node_slots(store.settings.node_max_concurrent_pulls):
                _registry_blob(store, rc, ref, digest, size, what, progress,
                               deferred if sources is None else None)

        if sources is not None:
            return sources.fetch(store, digest, size, what, progress, from_registry)
        from_registry()
        return "registry"


def _registry_blob(store: ImageStore, rc: RegistryClient, ref: Reference, digest: str, size: int, what: str,
                   progress: Progress | None, deferred: list[tuple[Path, str]] | None = None) -> None:
    """Stream one blob from the registry into ``ingest/``, check size and digest, commit."""
    # expect: peers may be served this blob while it arrives (cut-through, dsec.cluster.p2p)
    with rc.blob_stream(ref.repository, digest, what) as r, store.content.writer(expect=(digest, size)) as w:
        got = 0
        # Raw bytes as received (we asked for identity encoding): no re-chunking copies.
        raw = r.headers.get("content-encoding", "identity") in ("", "identity")
        try:
            for chunk in (r.iter_raw() if raw else r.iter_bytes()):
                got += len(chunk)
                if got > size:
                    raise DigestMismatch(f"{what}: the registry sent more than the {size} bytes its manifest "
                                         "descriptor names; nothing was stored", expected=digest)
                w.write(chunk)
                if progress:
                    progress(digest[7:19], len(chunk), size)
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise TransientError(f"{what}: the connection to registry {rc.registry} broke after {got} of "
                                 f"{size} bytes ({type(exc).__name__}: {exc}); nothing was stored",
                                 registry=rc.registry, digest=digest) from exc
        if got != size:
            raise DigestMismatch(f"{what}: the registry sent {got} of {size} bytes (truncated); nothing "
                                 "was stored", expected=digest)
        if w.digest != digest:
            raise DigestMismatch(f"{what}: the bytes registry {rc.registry} sent hash to {w.digest}, not "
                                 "to the manifest's digest; nothing was stored", expected=digest, actual=w.digest)
        if deferred is not None:
            deferred.append((w.verified_unsynced(digest, what), digest))  # durable + renamed by the caller
        else:
            w.commit(digest, what)  # fsync, then rename into place


def _manifest_for(rc: RegistryClient, ref: Reference) -> tuple[bytes, str, str]:
    """Resolve a reference to one linux/amd64 image manifest: (raw, media type, digest)."""
    what = f"manifest {ref}"
    raw, mt, header_digest = rc.get_manifest(ref.repository, ref.reference, what)
    digest = digest_of(raw)
    if ref.digest and digest != ref.digest:
        raise DigestMismatch(f"{what}: the registry's manifest hashes to {digest}, not the digest asked for",
                             expected=ref.digest, actual=digest)
    if header_digest and header_digest.startswith("sha256:") and header_digest != digest:
        raise DigestMismatch(f"{what}: manifest bytes hash to {digest} but the registry says {header_digest}",
                             expected=header_digest, actual=digest)
    doc = _json(raw, what)
    mt = doc.get("mediaType") or mt
    if mt in media.INDEX_TYPES:
        desc = pick_platform(doc, what)
        sub = check_digest(str(desc.get("digest", "")), f"{what}: index entry")
        raw, mt, _ = rc.get_manifest(ref.repository, sub, f"manifest {ref} (linux/amd64 {sub})")
        if digest_of(raw) != sub:
            raise DigestMismatch(f"{what}: platform manifest hashes to {digest_of(raw)}, index names {sub}",
                                 expected=sub, actual=digest_of(raw))
        digest = sub
        mt = _json(raw, what).get("mediaType") or mt
    if mt not in media.MANIFEST_TYPES:
        raise ImageError(f"{what}: unsupported manifest media type {mt!r}; supported: "
                         f"{', '.join(sorted(media.MANIFEST_TYPES | media.INDEX_TYPES))}", media_type=mt)
    return raw, mt, digest


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ImageError(f"{what}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ImageError(f"{what}: not a JSON object")
    return doc


def _unpack(store: ImageStore, layers: list[LayerInfo], progress: Progress | None) -> None:
    """Unpack (verified) every layer. Tar parsing is GIL-bound Python: an image above
    ``image_parallel_unpack_min_bytes`` with several missing layers is unpacked by up to
    ``image_unpack_workers`` worker processes (``python -m dsec.images.worker``, biggest
    layer first), as an import is; a failure is raised after every worker finished."""
    import subprocess
    import sys

    from dsec.errors import error_from_dict

    s = store.settings
    todo = [li for li in layers if not store.layers.is_trusted(li.diff_id)]
    if (len(todo) < 2 or s.image_unpack_workers < 2
            or sum(li.size for li in todo) < s.image_parallel_unpack_min_bytes):
        for li in layers:
            store.ensure_layer(li, progress)
        return
    settings_json = s.model_dump_json()

    def one(li: LayerInfo) -> None:
        job = {"root": str(store.root), "settings": settings_json, "ensure": li.model_dump()}
        proc = subprocess.run([sys.executable, "-m", "dsec.images.worker"], input=json.dumps(job).encode(),
                              capture_output=True, check=False)
        try:
            reply = json.loads(proc.stdout)
        except ValueError:
            raise ImageError(f"layer {li.digest}: unpack worker died: "
                             f"{proc.stderr.decode(errors='replace')[-500:]}") from None
        if "error" in reply:
            raise error_from_dict(reply["error"], 500)
        store.misses += reply["misses"]
        if progress:
            progress(f"unpack {li.digest[7:19]}", li.size, li.size)

    _run_bounded(one, sorted(todo, key=lambda li: -li.size), min(len(todo), s.image_unpack_workers))
    for li in todo:
        store.layers.mark_trusted(li.diff_id)  # verified by the worker that unpacked it


def pull(store: ImageStore, ref_text: str, *, name: str | None = None, insecure: bool = False,
         creds: Credentials | None = None, progress: Progress | None = None, unpack: bool = True,
         sources: BlobSources | None = None, order: list[str] | None = None,
         before_blob: Callable[[], None] | None = None, prefetch: bool = False) -> ImageInfo:
    """Pull ``HOST[:PORT]/REPO[:TAG|@DIGEST]`` into the store (verified), register it
    under ``name`` (default: the reference itself) and, with ``unpack``, unpack its layers.
    ``sources`` (a cluster node's peers) is asked for each missing blob before the registry.
    Progress and where each blob came from are in ``PULLS`` (``dsec node ls``).

    A prefetch (``prefetch``, see ``prefetch``) fetches one blob at a time, layers in
    ``order`` (first-demand order; others after, in manifest order), and calls
    ``before_blob`` before each (it waits while pulls that creates wait on run)."""
    ref = parse_reference(ref_text, store.settings.image_registry)
    new_blobs: list[str] = []
    new_layers: list[str] = []
    lease = store.new_lease_key("pull")
    track: int | None = None
    counted = False
    try:
        with client_for(store, ref.registry, insecure, creds) as rc:
            raw, _mt, mdigest = _manifest_for(rc, ref)
            doc = _json(raw, f"manifest {ref}")
            cdesc = doc.get("config") or {}
            if cdesc.get("mediaType") not in media.CONFIG_TYPES:
                raise ImageError(f"manifest {ref}: unsupported config media type {cdesc.get('mediaType')!r}")
            cdigest = check_digest(str(cdesc.get("digest", "")), f"manifest {ref}: config")
            csize = int(cdesc.get("size") or 0)
            if not 0 < csize <= MAX_CONFIG_BYTES:
                raise ImageError(f"manifest {ref}: config size {csize} is not in 1..{MAX_CONFIG_BYTES}")
            layers_desc = doc.get("layers") or []
            wanted: list[tuple[str, int, str]] = []  # (digest, size, what)
            for i, ld in enumerate(layers_desc):
                what = f"layer {i} of {ref}"
                media.layer_compression(str(ld.get("mediaType")), what)  # unknown media type: refused by name
                wanted.append((check_digest(str(ld.get("digest", "")), what), int(ld.get("size") or 0), what))
            store.lease(lease, [cdigest, mdigest] + [d for d, _, _ in wanted])
            todo = [(cdigest, csize, f"config {cdigest} of {ref}")]
            seen = {cdigest}
            for d, size, what in wanted:
                if d not in seen:
                    seen.add(d)
                    todo.append((d, size, f"{what} ({d})"))
            if order:
                rank = {d: i for i, d in enumerate(order)}
                todo = todo[:1] + sorted(todo[1:], key=lambda t: rank.get(t[0], len(rank)))  # config first
            new_blobs += [d for d, _, _ in todo if not store.content.has(d)]
            track = PULLS.start(str(ref), sum(sz for _, sz, _ in todo), len(todo), prefetch=prefetch)
            # A pull alone in this process, without peers: verified blobs wait in ingest/ and
            # the whole pull is made durable in one pass at the end, before any is renamed
            # into the store (was: an fsync per blob as each completed). With other pulls in flight (they may want the
            # same blob: single flight needs it named as soon as it is fetched) or with peers
            # (they fetch it from us), each blob is fsynced and placed at once.
            deferred: list[tuple[Path, str]] | None = None
            with _ACTIVE_LOCK:
                _ACTIVE[0] += 1
                counted = True
                if sources is None and _ACTIVE[0] == 1:
                    deferred = []
            user_progress = progress

            def tracked(label: str, n: int, total: int, key: int = track) -> None:
                PULLS.advance(key, n)
                if user_progress is not None:
                    user_progress(label, n, total)

            def fetch(item: tuple[str, int, str]) -> None:
                d, size, what = item
                if before_blob is not None:
                    before_blob()
                try:
                    for attempt in range(FETCH_ATTEMPTS):  # a broken connection / 5xx: start the blob again
                        try:
                            src = _fetch_blob(store, rc, ref, d, size, what, tracked, sources, deferred)
                            PULLS.blob_done(track, src, size)  # type: ignore[arg-type]
                            return
                        except TransientError:
                            if attempt == FETCH_ATTEMPTS - 1:
                                raise
                            time.sleep(0.2 * 4 ** attempt)
                except NotFound as exc:
                    raise NotFound(f"{what} is missing from registry {ref.registry} although the manifest "
                                   f"names it ({exc.message})", digest=d, registry=ref.registry) from exc

            try:
                # A prefetch moves one blob at a time: at most one of the node's transfer
                # slots (node_max_concurrent_pulls), the rest stay free for creates' pulls.
                _run_bounded(fetch, todo, 1 if prefetch else max(1, store.settings.image_max_concurrent_pulls))
            except BaseException:
                for tmp, _ in deferred or []:
                    tmp.unlink(missing_ok=True)
                raise
            store.content.place_durable(deferred or [])
            PULLS.fetched(track)
        config = store.content.read_bytes(cdigest, f"config of {ref}")
        cfg = _json(config, f"config {cdigest} of {ref}")
        diff_ids = ((cfg.get("rootfs") or {}).get("diff_ids")) or []
        if len(diff_ids) != len(wanted):
            raise ImageError(f"{ref}: manifest has {len(wanted)} layers but its config lists {len(diff_ids)} diff_ids")
        layers = [LayerInfo(digest=d, diff_id=check_digest(str(diff), f"{ref}: diff_id"), size=size,
                            media_type=str(ld.get("mediaType")))
                  for (d, size, _), diff, ld in zip(wanted, diff_ids, layers_desc)]
        store.lease(lease, [li.diff_id for li in layers])
        if unpack:
            new_layers += [li.diff_id for li in layers if not store.layers.present(li.diff_id)]
            _unpack(store, layers, progress)  # digest + diff_id recomputed while unpacking
        info = store.register(config, layers, [name or ref.local_name()], raw)
        from dsec.images.ops import evict
        evict(store)
        if track is not None:
            PULLS.finish(track)
        return info
    except BaseException as exc:
        from dsec.images.ops import _rollback
        _rollback(store, new_blobs, new_layers, lease)
        if track is not None:
            PULLS.finish(track, getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if counted:
            with _ACTIVE_LOCK:
                _ACTIVE[0] -= 1
        store.release(lease)


# --- pull on create ------------------------------------------------------------------------

def pull_source(ref_text: str, image_registry: str, enabled: bool) -> str | None:
    """The registry reference a create's missing image is pulled from, or None. Only the
    configured registry (``image_registry``) is ever contacted: a tenant naming another
    host (say a loopback service) must not make the node fetch from it."""
    text = ref_text.strip()
    if not enabled or not image_registry or text.startswith("sha256:"):
        return None
    try:
        ref = parse_reference(text, image_registry)
    except InvalidArgument:
        return None
    return str(ref) if ref.registry == image_registry.rstrip("/") else None


def remote_layers(settings: Settings, ref_text: str) -> tuple[list[tuple[str, int]], str] | None:
    """For a control plane that must place an image no node holds yet: its layers
    ``[(digest, compressed size)]`` (base first) and image id (config digest), read from
    the manifest in ``image_registry`` (no blob is fetched). None when pull-on-create does
    not apply to ``ref_text`` (no registry, or a ref naming another host)."""
    source = pull_source(ref_text, settings.image_registry, settings.image_pull_on_create)
    if source is None:
        return None
    ref = parse_reference(source, settings.image_registry)
    rc = RegistryClient(ref.registry, username=settings.registry_username, password=settings.registry_password,
                        insecure=settings.registry_insecure, ca_file=settings.registry_ca_file,
                        timeout_s=settings.registry_timeout_s, pool=2)
    with rc:
        raw, _mt, _digest = _manifest_for(rc, ref)
    doc = _json(raw, f"manifest {ref}")
    cdigest = check_digest(str((doc.get("config") or {}).get("digest", "")), f"manifest {ref}: config")
    layers = [(check_digest(str(ld.get("digest", "")), f"layer {i} of {ref}"), int(ld.get("size") or 0))
              for i, ld in enumerate(doc.get("layers") or [])]
    return layers, cdigest


def log_progress(title: str, log: logging.Logger) -> Progress:
    """Progress as log lines (a server has no terminal): per blob, at most one per 25 %."""
    done: dict[str, int] = {}
    shown: dict[str, int] = {}
    lock = threading.Lock()
    t0 = time.monotonic()

    def advance(label: str, n: int, total: int) -> None:
        with lock:
            done[label] = done.get(label, 0) + n
            step = int(4 * done[label] / total) if total else 4
            if step <= shown.get(label, -1):
                return
            shown[label] = step
        log.info("%s: %s %d/%d bytes (%d%%) %.1fs", title, label, done[label], total, 25 * step,
                 time.monotonic() - t0)
    return advance


def resolve_or_pull(store: ImageStore, ref_text: str) -> ImageInfo:
    """``store.resolve(ref)``; when the image is missing and pull-on-create applies
    (``image_pull_on_create`` and the ref resolves in the ``image_registry``), pull it
    first, once per reference however many creates wait for it (a per-ref lock; blob
    fetches are single-flight anyway). Registry auth failures become ``ImageError`` so an
    API client does not mistake them for its own credentials being refused."""
    try:
        return store.resolve_fast(ref_text)
    except NotFound:
        s = store.settings
        source = pull_source(ref_text, s.image_registry, s.image_pull_on_create)
        if source is None:
            raise
    with store.locks.hold("pull-" + hashlib.sha256(source.encode()).hexdigest()):
        try:
            return store.resolve_fast(ref_text)  # another create pulled it meanwhile
        except NotFound:
            pass
        log.info("image %s is not on this node: pulling %s", ref_text, source)
        t0 = time.monotonic()
        try:
            info = pull(store, source, name=normalize_name(ref_text), progress=log_progress(f"pull {source}", log),
                        insecure=s.registry_insecure, sources=store.blob_sources)
        except (Unauthorized, Forbidden) as exc:
            raise ImageError(f"image {ref_text!r} is not on this node and pulling {source} failed: "
                             f"{exc.message}", image=ref_text) from exc
        except DSecError as exc:
            exc.message = f"image {ref_text!r} is not on this node and pulling {source} failed: {exc.message}"
            raise
        log.info("pulled %s as %s (%s) in %.2fs", source, normalize_name(ref_text), info.id, time.monotonic() - t0)
        return info


def prefetch(store: ImageStore, ref_text: str, *, order: list[str] | None = None,
             yield_s: float = 0.05) -> ImageInfo | None:
    """Prefetch: pull ``ref_text`` (a name creates use, resolved in ``image_registry`` as
    pull-on-create does) before any create asks for it on this node, through the same
    path as a create's pull (peers first, digests verified, single flight per blob, the
    node's transfer slots), registered under the same name so a later create finds it
    with no fetch at all, and unpacked. It yields to real pulls: before each blob it waits
    while a pull a create waits on is in flight (a blob already moving finishes first).
    None when the image is already here or not in the registry (nothing to do)."""
    try:
        store.resolve_fast(ref_text)
        return None
    except NotFound:
        pass
    s = store.settings
    source = pull_source(ref_text, s.image_registry, True)
    if source is None:
        return None

    def wait_turn() -> None:
        while PULLS.real_active():
            time.sleep(yield_s)

    log.info("prefetching %s (%s) onto this node", ref_text, source)
    return pull(store, source, name=normalize_name(ref_text), insecure=s.registry_insecure,
                sources=store.blob_sources, order=order, before_blob=wait_turn, prefetch=True)


# --- push ---------------------------------------------------------------------------------

def mount_sources(store: ImageStore, dest: Reference) -> dict[str, str]:
    """blob digest -> another repository of ``dest``'s registry that should hold it: local
    images are named by the reference they were pulled from (``HOST/REPO:TAG``), so a
    blob of an image named after a repo of the same registry was in that repo."""
    repos: dict[str, str] = {}  # image id -> repo
    for name, image_id in store.db.q("SELECT name, image_id FROM names"):
        try:
            r = parse_reference(str(name))
        except InvalidArgument:
            continue
        if r.registry == dest.registry and r.repository != dest.repository:
            repos.setdefault(str(image_id), r.repository)
    out: dict[str, str] = {}
    for image_id, repo in repos.items():
        out.setdefault(image_id, repo)  # the config blob
        for (digest,) in store.db.q("SELECT digest FROM image_layers WHERE image_id=?", (image_id,)):
            out.setdefault(str(digest), repo)
    return out


def push(store: ImageStore, image_ref: str, dest: str, *, insecure: bool = False,
         creds: Credentials | None = None, progress: Progress | None = None) -> str:
    """Push a local image to ``HOST[:PORT]/REPO[:TAG]``; returns the manifest digest
    (the same digest the manifest has in the local store)."""
    ref = parse_reference(dest, store.settings.image_registry)
    if ref.digest:
        raise ImageError(f"push destination {dest!r} names a digest; give a tag (HOST/REPO:TAG)")
    info = store.resolve(image_ref)
    mdigest = store.manifest_digest(info.id)
    raw = store.content.read_bytes(mdigest, f"manifest of {image_ref}")
    doc = _json(raw, f"manifest of {image_ref}")
    mt = doc.get("mediaType") or (media.MT_DOCKER_MANIFEST if (doc.get("config") or {}).get("mediaType")
                                  == media.MT_DOCKER_CONFIG else media.MT_OCI_MANIFEST)
    blobs = [(info.id, store.content.size(info.id))] + [(li.digest, li.size) for li in info.layers]
    for d, _ in blobs:
        store.content.verify(d, f"blob {d} of {image_ref}")  # never push bytes we cannot vouch for
    chunk = store.settings.registry_push_chunk_bytes
    with client_for(store, ref.registry, insecure, creds) as rc:
        sources = mount_sources(store, ref)

        def send(item: tuple[str, int]) -> None:
            d, size = item
            if rc.blob_exists(ref.repository, d):
                if progress:
                    progress(f"{d[7:19]} (exists)", size, size)
                return
            adv = (lambda n: progress(d[7:19], n, size)) if progress else None
            mounted = rc.upload_blob(ref.repository, d, store.content.path(d), size, chunk, adv,
                                     mount_from=sources.get(d))
            if mounted and progress:
                progress(f"{d[7:19]} (mounted from {sources[d]})", size, size)

        uniq = list(dict.fromkeys(blobs))
        _run_bounded(send, uniq, max(1, store.settings.image_max_concurrent_pulls))
        got = rc.put_manifest(ref.repository, ref.tag or "latest", raw, mt)
    if got and got != mdigest:
        raise DigestMismatch(f"registry {ref.registry} stored the manifest of {image_ref} as {got}, not {mdigest}",
                             expected=mdigest, actual=got)
    return mdigest


__all__ = ["PULLS", "BlobSources", "Credentials", "PullTracker", "node_slots", "prefetch", "pull", "pull_source", "push",
           "remote_layers", "resolve_or_pull"]
