"""Peer-to-peer layers: nodes fetch missing blobs from peers that hold them before the registry.

Pieces:

- **Directory** (``PeerDirectory``): the cluster-wide view every node reads and writes:
  each node's blob endpoint URL, which node holds which blob (each node publishes its
  own content store: the cluster's layer index at blob granularity), the shared peer
  token, and one *registry-fetch claim* per blob being fetched from the registry. On
  Ray it is the GCS key-value store (``RayKVDirectory``, namespace ``dsec``); tests of
  the logic use ``MemoryDirectory``.
- **Blob endpoint** (``dsec.cluster.blobserve.BlobServer``): read-only, token, verified
  blobs by digest, at most ``p2p_serve_max`` bodies at once.
- **Fetcher** (``PeerFetcher``, the ``registry_ops.BlobSources`` a node's store uses):
  for one missing blob, with the node's ``blob-<digest>`` lock held:

  1. peers that hold it (minus those that already failed this fetch), in a random
     order: stream into ``ingest/``, bounded by the descriptor's size, hashed as it
     arrives, renamed into the store only when the digest matches. A peer that serves
     other bytes (digest mismatch), dies mid-transfer or answers 404 is skipped for the
     rest of this fetch; one that is busy (503) is asked again later;
  2. no holder: take the blob's registry-fetch claim (put-if-absent) and fetch it from
     the registry; the claim is refreshed while bytes arrive and dropped at the end;
  3. the claim is someone else's: wait (poll) until a holder appears, then 1.; a claim
     without progress for ``p2p_claim_stale_s`` is taken over; after ``p2p_wait_s`` in
     all, go to the registry regardless.

  Cut-through (``p2p_cut_through``): a node that is still receiving a blob (from the
  registry or a peer) is a *partial holder* (``p2p:part:``) and serves it as it arrives
  (``blobserve``). Fetchers ask complete holders first, then partial ones, so waiting
  nodes start receiving while the registry fetch is still running, and each of them
  serves on in turn: a pipelined tree, whose wall time is about one registry fetch. A
  receiver still hashes everything it got and commits only on a digest match; a partial
  stream that ends short (its source's own receive failed or stalled) makes the receiver
  pass over that node as a *partial* source only (it may serve the whole blob later); one
  whose bytes do not hash to the digest is skipped like any corrupt peer.

  Fan-out: N nodes wanting one blob at once make one registry fetch; the rest come
  from peers, each holder serving at most ``p2p_serve_max`` at once, and every node
  that finishes becomes a holder: a tree (degree ``p2p_serve_max``), not all from one.
  This runs for any number of nodes (waiting for the one registry fetch in flight is
  never slower when the registry link is the bottleneck), so "more than 5 nodes"
  is covered as a special case.

Never a half-written layer: every path writes through ``ContentStore.writer`` (ingest,
digest check, fsync, rename) and a sandbox only uses blobs that passed it.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from dsec.config import Settings
from dsec.errors import DigestMismatch

log = logging.getLogger("dsec.cluster.p2p")

KV_NAMESPACE = "dsec"
_EP = "p2p:ep:"        # p2p:ep:<node> -> url
_HAS = "p2p:has:"      # p2p:has:<digest>:<node> -> "1"
_CLAIM = "p2p:claim:"  # p2p:claim:<digest> -> {"node": .., "t": ..}
_TOKEN = "p2p:token"
_ASKED = "p2p:asked:"  # p2p:asked:<digest> -> last time any node wanted it (cluster GC input)
_PART = "p2p:part:"    # p2p:part:<digest>:<node> -> "1" while that node receives it (cut-through source)
_SERVED = "p2p:served:"  # p2p:served:<digest>:<node> -> "<bodies of it that node began to serve> <when last>"


# --- pure decisions ---------------------------------------------------------------------

def saturated(served: dict[str, tuple[int, float]], holder: str, degree: int, now: float, window_s: float) -> bool:
    """A holder that began serving this blob to ``degree`` peers within the last
    ``window_s``: in a burst, the next fetchers wait for fresh holders instead (a tree of
    that degree, not a star); outside a burst (old counts) every holder is fair game."""
    n, t = served.get(holder, (0, 0.0))
    return n >= degree and now - t < window_s


def order_peers(holders: list[str], me: str, skip: set[str], served: dict[str, tuple[int, float]],
                rng: random.Random, partial: list[str] | tuple[str, ...] = (),
                skip_partial: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Peers to ask for a blob, in order: every holder but this node and those that failed
    this fetch, plus the nodes still receiving it (``partial``: cut-through sources, but
    not those whose stream was cut in this fetch), the ones that served this blob least
    first (new holders take over from the first one: a tree, not a star), a complete
    holder before a partial one at the same count, ties shuffled (pure but for rng)."""
    full = {h for h in holders if h != me and h not in skip}
    part = {h for h in partial if h != me and h not in skip and h not in skip_partial} - full
    out = sorted(full | part)
    rng.shuffle(out)
    # stable: the shuffle breaks ties
    return sorted(out, key=lambda h: (served.get(h, (0, 0.0))[0], h in part))


def claim_stale(claim: dict[str, Any] | None, now: float, stale_s: float) -> bool:
    """A registry-fetch claim nobody refreshed for ``stale_s`` (its node died or hangs)."""
    return claim is None or now - float(claim.get("t", 0.0)) > stale_s


# --- the directory ------------------------------------------------------------------------

class PeerDirectory(Protocol):
    def publish_endpoint(self, node: str, url: str) -> None: ...
    def endpoints(self) -> dict[str, str]: ...
    def token(self) -> str: ...
    def announce(self, node: str, digests: set[str] | list[str]) -> None: ...
    def retract(self, node: str, digests: set[str] | list[str]) -> None: ...
    def holders(self, digest: str) -> list[str]: ...
    def announce_partial(self, node: str, digest: str) -> None: ...
    def retract_partial(self, node: str, digest: str) -> None: ...
    def partial_holders(self, digest: str) -> list[str]: ...
    def claim(self, digest: str, node: str, now: float, stale_s: float) -> bool: ...
    def refresh_claim(self, digest: str, node: str, now: float) -> None: ...
    def release_claim(self, digest: str, node: str) -> None: ...
    def asked(self, digest: str, now: float) -> None: ...
    def served(self, digest: str) -> dict[str, tuple[int, float]]: ...
    def note_served(self, digest: str, node: str, count: int, now: float) -> None: ...


class _KV(Protocol):
    def put(self, key: str, value: str, overwrite: bool) -> bool: ...  # True: it was added
    def get(self, key: str) -> str | None: ...
    def delete(self, key: str) -> None: ...
    def keys(self, prefix: str) -> list[str]: ...


class KVDirectory:
    """``PeerDirectory`` over a flat key-value store (see the key names above)."""

    def __init__(self, kv: _KV) -> None:
        self.kv = kv
        self._token: str | None = None

    def publish_endpoint(self, node: str, url: str) -> None:
        self.kv.put(_EP + node, url, True)

    def endpoints(self) -> dict[str, str]:
        out = {}
        for k in self.kv.keys(_EP):
            v = self.kv.get(k)
            if v:
                out[k[len(_EP):]] = v
        return out

    def token(self) -> str:
        """The cluster's peer token: the first node to ask makes it (put-if-absent)."""
        if self._token is None:
            self.kv.put(_TOKEN, secrets.token_urlsafe(32), False)
            self._token = self.kv.get(_TOKEN) or ""
        return self._token

    def announce(self, node: str, digests: set[str] | list[str]) -> None:
        for d in digests:
            self.kv.put(f"{_HAS}{d}:{node}", "1", True)

    def retract(self, node: str, digests: set[str] | list[str]) -> None:
        for d in digests:
            self.kv.delete(f"{_HAS}{d}:{node}")

    def holders(self, digest: str) -> list[str]:
        pre = f"{_HAS}{digest}:"
        return [k[len(pre):] for k in self.kv.keys(pre)]

    def announce_partial(self, node: str, digest: str) -> None:
        self.kv.put(f"{_PART}{digest}:{node}", "1", True)

    def retract_partial(self, node: str, digest: str) -> None:
        self.kv.delete(f"{_PART}{digest}:{node}")

    def partial_holders(self, digest: str) -> list[str]:
        pre = f"{_PART}{digest}:"
        return [k[len(pre):] for k in self.kv.keys(pre)]

    def all_holdings(self) -> dict[str, set[str]]:
        """digest -> nodes holding it (cluster GC input)."""
        out: dict[str, set[str]] = {}
        for k in self.kv.keys(_HAS):
            digest, _, node = k[len(_HAS):].rpartition(":")
            out.setdefault(digest, set()).add(node)
        return out

    def _claim(self, digest: str) -> dict[str, Any] | None:
        raw = self.kv.get(_CLAIM + digest)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def claim(self, digest: str, node: str, now: float, stale_s: float) -> bool:
        key = _CLAIM + digest
        value = json.dumps({"node": node, "t": now})
        if self.kv.put(key, value, False):
            return True
        cur = self._claim(digest)
        if cur is not None and cur.get("node") == node:
            return True
        if claim_stale(cur, now, stale_s):
            log.warning("registry fetch of %s claimed by %s made no progress for %.0fs: %s takes it over",
                        digest, cur.get("node") if cur else "?", stale_s, node)
            self.kv.delete(key)
            return self.kv.put(key, value, False)
        return False

    def refresh_claim(self, digest: str, node: str, now: float) -> None:
        cur = self._claim(digest)
        if cur is not None and cur.get("node") == node:
            self.kv.put(_CLAIM + digest, json.dumps({"node": node, "t": now}), True)

    def release_claim(self, digest: str, node: str) -> None:
        cur = self._claim(digest)
        if cur is not None and cur.get("node") == node:
            self.kv.delete(_CLAIM + digest)

    def asked(self, digest: str, now: float) -> None:
        self.kv.put(_ASKED + digest, f"{now:.0f}", True)

    def served(self, digest: str) -> dict[str, tuple[int, float]]:
        pre = f"{_SERVED}{digest}:"
        out = {}
        for k in self.kv.keys(pre):
            v = self.kv.get(k)
            if v:
                n, _, t = v.partition(" ")
                out[k[len(pre):]] = (int(n), float(t or 0.0))
        return out

    def note_served(self, digest: str, node: str, count: int, now: float) -> None:
        self.kv.put(f"{_SERVED}{digest}:{node}", f"{count} {now:.3f}", True)

    def asked_at(self) -> dict[str, float]:
        out = {}
        for k in self.kv.keys(_ASKED):
            v = self.kv.get(k)
            if v:
                out[k[len(_ASKED):]] = float(v)
        return out


class MemoryKV:
    """In-process ``_KV`` (several nodes in one process: tests, benchmarks of the logic)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.lock = threading.Lock()

    def put(self, key: str, value: str, overwrite: bool) -> bool:
        with self.lock:
            if not overwrite and key in self.data:
                return False
            self.data[key] = value
            return True

    def get(self, key: str) -> str | None:
        with self.lock:
            return self.data.get(key)

    def delete(self, key: str) -> None:
        with self.lock:
            self.data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        with self.lock:
            return [k for k in self.data if k.startswith(prefix)]


class RayKV:
    """``_KV`` over Ray's GCS key-value store (every process of the cluster sees it; it
    lives as long as the cluster's head). Needs ``ray`` initialised (node actors are)."""

    def put(self, key: str, value: str, overwrite: bool) -> bool:
        from ray.experimental import internal_kv as kv
        existed = kv._internal_kv_put(key, value, overwrite, namespace=KV_NAMESPACE)
        return not existed

    def get(self, key: str) -> str | None:
        from ray.experimental import internal_kv as kv
        v = kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        return v.decode() if v is not None else None

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv as kv
        kv._internal_kv_del(key, namespace=KV_NAMESPACE)

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv as kv
        return [k.decode() for k in kv._internal_kv_list(prefix, namespace=KV_NAMESPACE)]


# --- fetching -------------------------------------------------------------------------------

class PeerFailed(Exception):
    """This peer cannot give us the blob in this fetch (skip it)."""


class PeerBusy(Exception):
    """The peer serves as many as it may (503): ask again later."""


class PeerCut(PeerFailed):
    """A cut-through stream ended short (its source's own receive failed or stalled): do
    not ask that node again as a partial source in this fetch; as a complete holder, yes."""


class PeerFetcher:
    """``registry_ops.BlobSources`` for one node (see module docstring)."""

    def __init__(self, node: str, directory: PeerDirectory, settings: Settings,
                 rng: random.Random | None = None) -> None:
        self.node = node
        self.dir = directory
        self.s = settings
        self.rng = rng or random.Random()
        self._http = httpx.Client(timeout=httpx.Timeout(settings.registry_timeout_s, connect=5.0),
                                  limits=httpx.Limits(max_connections=16))
        self.from_peers: dict[str, int] = {}   # peer -> bytes we got from it (bench/tests)
        self.skipped: dict[str, str] = {}      # peer -> why it was skipped last (tests)
        self.registry_fetches = 0
        self.cut_through = 0  # blobs received from a node still receiving them (bench/tests)
        self.use_partial = settings.p2p_cut_through  # ask nodes still receiving a blob (admin may switch it)
        self.timeline: list[dict[str, Any]] = []  # the last blobs fetched: source, start, seconds
        self.announced: set[str] = set()  # announced as held here since NodePeers.sync last looked

    def close(self) -> None:
        self._http.close()

    def fetch(self, store: Any, digest: str, size: int, what: str, progress: Callable[[str, int, int], None] | None,
              from_registry: Callable[[], None]) -> str:
        t0 = time.time()
        source = self._fetch(store, digest, size, what, progress, from_registry)
        # Where each blob came from and when (``stats``: the bench's per-node timeline).
        self.timeline.append({"digest": digest, "source": source, "start": round(t0, 3),
                              "seconds": round(time.time() - t0, 3), "bytes": size})
        del self.timeline[:-64]
        log.info("%s: from %s in %.2fs", what, source, time.time() - t0)
        return source

    def _fetch(self, store: Any, digest: str, size: int, what: str, progress: Callable[[str, int, int], None] | None,
               from_registry: Callable[[], None]) -> str:
        deadline = time.monotonic() + self.s.p2p_wait_s
        skip: set[str] = set()
        cut: set[str] = set()  # partial sources whose stream ended short (PeerCut)
        first = 0.0  # when every holder was first seen saturated
        now = time.time()
        self.dir.asked(digest, now)
        while True:
            holders = self.dir.holders(digest)
            partial = ([h for h in self.dir.partial_holders(digest) if h not in holders]
                       if self.use_partial else [])
            served = self.dir.served(digest) if holders or partial else {}
            peers = order_peers(holders, self.node, skip, served, self.rng, partial, cut)
            t = time.time()
            if peers and all(saturated(served, h, self.s.p2p_serve_max, t, self.s.p2p_tree_wait_s) for h in peers):
                # Every holder already feeds p2p_serve_max peers of this burst: wait for
                # those to finish and serve in turn (bounded by p2p_tree_wait_s).
                first = first or time.monotonic()
                if time.monotonic() - first < self.s.p2p_tree_wait_s:
                    time.sleep(0.05)
                    continue
            busy = False
            if peers:
                eps = self.dir.endpoints()
                for peer in peers:
                    url = eps.get(peer)
                    if url is None:
                        skip.add(peer)
                        continue
                    try:
                        self._from_peer(store, peer, url, digest, size, what, progress)
                    except PeerBusy:
                        busy = True
                        continue
                    except PeerCut as e:
                        log.info("%s: cut-through stream from %s ended short: %s", what, peer, e)
                        cut.add(peer)
                        continue
                    except PeerFailed as e:
                        log.warning("%s: peer %s skipped: %s", what, peer, e)
                        self.skipped[peer] = str(e)
                        skip.add(peer)
                        continue
                    self.dir.announce(self.node, [digest])
                    self.announced.add(digest)
                    return f"peer:{peer}"
            late = time.monotonic() > deadline
            # Nobody to ask (or waited long enough): fetch it ourselves if we get the claim.
            if late:
                return self._registry(digest, progress, from_registry)
            if not busy and self.dir.claim(digest, self.node, time.time(), self.s.p2p_claim_stale_s):
                # The previous claimer may have announced and released between our look at
                # the holders and our claim: look again before going to the registry.
                if not order_peers(self.dir.holders(digest), self.node, skip, {}, self.rng):
                    return self._registry(digest, progress, from_registry)
                self.dir.release_claim(digest, self.node)
                continue
            time.sleep(0.05 if busy else 0.1)  # a holder frees a slot / the claimed fetch finishes

    def _registry(self, digest: str, progress: Callable[[str, int, int], None] | None,
                  from_registry: Callable[[], None]) -> str:
        stop = threading.Event()

        def keep_claim() -> None:  # peers waiting on us must see we are alive
            while not stop.wait(self.s.p2p_claim_stale_s / 3):
                try:
                    self.dir.refresh_claim(digest, self.node, time.time())
                except Exception:
                    log.debug("refreshing the claim on %s failed", digest, exc_info=True)

        refresher = threading.Thread(target=keep_claim, name="dsec-p2p-claim", daemon=True)
        refresher.start()
        try:
            from_registry()
            self.registry_fetches += 1
            # Announce BEFORE dropping the claim: a waiter that sees the claim gone must
            # also see this node as a holder, or it would claim and fetch it again.
            self.dir.announce(self.node, [digest])
            self.announced.add(digest)
        finally:
            stop.set()
            refresher.join()
            self.dir.release_claim(digest, self.node)
        return "registry"

    def _from_peer(self, store: Any, peer: str, url: str, digest: str, size: int, what: str,
                   progress: Callable[[str, int, int], None] | None) -> None:
        """One attempt from one peer; the blob is committed only when its digest matches.
        While it arrives this node is a partial holder of it (``writer(expect=...)``)."""
        from dsec.images.registry import _widen_reads
        from dsec.images.registry_ops import node_slots

        headers = {"Authorization": f"Bearer {self.dir.token()}", "X-DSec-Node": self.node}
        got = 0
        partial = False
        with node_slots(self.s.node_max_concurrent_pulls):
            try:
                with self._http.stream("GET", f"{url}/v1/blobs/{digest}", headers=headers) as r:
                    if r.status_code == 503:
                        raise PeerBusy()
                    if r.status_code != 200:
                        raise PeerFailed(f"answered {r.status_code}")
                    partial = r.headers.get("x-dsec-partial") == "1"
                    _widen_reads(r)  # 1 MiB per recv, as for registry blobs (fewer GIL round trips)
                    with store.content.writer(expect=(digest, size)) as w:
                        for chunk in r.iter_raw():
                            got += len(chunk)
                            if got > size:
                                raise PeerFailed(f"sent more than the {size} bytes the manifest names")
                            w.write(chunk)
                            if progress:
                                progress(f"{digest[7:19]} (peer {peer})", len(chunk), size)
                        if got != size:
                            raise (PeerCut if partial else PeerFailed)(f"sent {got} of {size} bytes")
                        try:
                            w.commit(digest, f"{what} from peer {peer}")  # hash checked, fsync, rename
                        except DigestMismatch as e:
                            raise PeerFailed(f"its bytes do not hash to {digest}: {e.message}") from None
            except (httpx.TransportError, httpx.StreamError) as e:
                raise (PeerCut if partial else PeerFailed)(
                    f"connection failed after {got} of {size} bytes ({type(e).__name__}: {e})") from e
        self.from_peers[peer] = self.from_peers.get(peer, 0) + size
        if partial:
            self.cut_through += 1


# --- the node side ----------------------------------------------------------------------------

class NodePeers:
    """What a cluster node agent runs for peer-to-peer layers: its blob endpoint, the
    store's ``blob_sources``, and the announcer that keeps the directory's view of its
    blobs current (at start, after every pull, and every ``p2p_announce_interval_s``)."""

    def __init__(self, node: str, store: Any, directory: PeerDirectory, settings: Settings, host: str) -> None:
        from dsec.cluster.blobserve import BlobServer

        self.node, self.store, self.dir, self.s = node, store, directory, settings
        self.server = BlobServer(store, host, settings.p2p_port, directory.token(), settings.p2p_serve_max,
                                 on_serve=lambda d, n: directory.note_served(d, node, n, time.time()),
                                 cut_through=settings.p2p_cut_through, stall_s=settings.registry_timeout_s,
                                 admit=self._admit)
        self._burst: dict[str, tuple[int, float]] = {}  # digest -> (bodies begun in this burst, its start)
        self._burst_lock = threading.Lock()
        self.fetcher = PeerFetcher(node, directory, settings)
        self._announced: set[str] = set()
        self._prefetch_lock = threading.Lock()  # one prefetch at a time on this node
        self.gc: Any = None  # dsec.cluster.layer_gc.NodeGc, set by attach()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsec-p2p-announce", daemon=True)

    def start(self) -> NodePeers:
        self.server.start()
        self.dir.publish_endpoint(self.node, self.server.url)
        self.sync()
        self.store.blob_sources = self.fetcher
        if self.s.p2p_cut_through:
            self.store.content.on_receiving = self._receiving
        self._thread.start()
        log.info("node %s serves its blobs to peers at %s", self.node, self.server.url)
        return self

    def _admit(self, digest: str, requester: str) -> bool:
        """The tree's degree, enforced at the holder: within a burst (``p2p_tree_wait_s``)
        it begins at most ``p2p_serve_max`` bodies of one blob while another node (complete
        or still receiving it) can serve the requester. The fetchers' own choice (least
        served first) races when they all discover the first holder at once, as they do
        with cut-through; this count does not. With nobody else to ask it serves anyway."""
        now = time.monotonic()
        with self._burst_lock:
            n, start = self._burst.get(digest, (0, now))
            if now - start > self.s.p2p_tree_wait_s:
                n, start = 0, now
            if n >= self.s.p2p_serve_max:
                others = set(self.dir.holders(digest)) | set(self.dir.partial_holders(digest))
                if others - {self.node, requester}:
                    return False
            self._burst[digest] = (n + 1, start)
            if len(self._burst) > 4096:  # old bursts
                for d in [d for d, (_, t) in self._burst.items() if now - t > self.s.p2p_tree_wait_s]:
                    del self._burst[d]
            return True

    def _receiving(self, digest: str, started: bool) -> None:
        """``ContentStore.on_receiving``: tell peers this node can serve ``digest`` cut-through."""
        if started:
            self.dir.announce_partial(self.node, digest)
        else:
            self.dir.retract_partial(self.node, digest)

    def sync(self) -> None:
        """Publish the blobs this node holds now; retract the ones it no longer holds."""
        # Blobs the fetcher announced since the last look count as announced: a blob deleted
        # since (forget, GC) must be retracted, or peers keep asking this node for it (404)
        # and, having skipped it, would go to the registry once it holds the blob again.
        fetched = set(self.fetcher.announced)
        known = self._announced | fetched
        have = set(self.store.content.all_digests())
        self.dir.announce(self.node, have - known)
        self.dir.retract(self.node, known - have)
        self._announced = have
        self.fetcher.announced -= fetched

    def _loop(self) -> None:
        while not self._stop.wait(self.s.p2p_announce_interval_s):
            try:
                self.sync()
            except Exception:
                log.exception("publishing this node's blobs failed")

    def admin(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Operator / benchmark operations on this node's images (not part of NodeAgent):

        - ``pull``: ``{"ref", "unpack": bool, "peers": bool, "cut_through": bool}`` pull a
          ref from ``image_registry`` with or without peers (and, for this pull, with or
          without cut-through: the bench compares both in one run); returns its status;
        - ``forget``: ``{"ref"}`` drop the image and every blob / unpacked layer of it that
          nothing else references or leases (a cold node again for that image);
        - ``prefetch``: ``{"ref", "order": [layer digests]}`` the scheduler leader's prefetch
          (``dsec.cluster.prefetch``): ``registry_ops.prefetch`` of a name creates use, peers
          first, layers in ``order``; one at a time per node (a second answers ``skipped``);
        - ``stats``: the blob endpoint's and the fetcher's counters."""
        from dsec.images.ops import _referenced
        from dsec.images.registry_ops import PULLS, pull, pull_source

        s = self.s
        if op == "pull":
            source = pull_source(args["ref"], s.image_registry, True)
            if source is None:
                raise ValueError(f"{args['ref']!r} does not resolve in image_registry {s.image_registry!r}")
            t0 = time.monotonic()
            cut = bool(args.get("cut_through", s.p2p_cut_through))
            self.fetcher.use_partial = self.server.cut_through = cut
            try:
                pull(self.store, source, name=args["ref"], unpack=bool(args.get("unpack")),
                     insecure=s.registry_insecure, sources=self.fetcher if args.get("peers", True) else None)
            finally:
                self.fetcher.use_partial = self.server.cut_through = s.p2p_cut_through
            done = [p for p in PULLS.snapshot() if p.ref == source and p.state != "pulling"]
            return {"seconds": time.monotonic() - t0, "status": done[-1].model_dump() if done else None}
        if op == "forget":
            try:
                info = self.store.resolve(args["ref"])
            except Exception:  # noqa: BLE001 - nothing to forget
                return {"removed": []}
            self.store.remove(info.id)
            referenced, leased = _referenced(self.store), self.store.db.leased_objects()
            gone = []
            for d in [info.id] + [li.digest for li in info.layers]:
                if d not in referenced and d not in leased and self.store.content.delete(d):
                    gone.append(d)
            for li in info.layers:
                if li.diff_id not in referenced and li.diff_id not in leased:
                    self.store.layers.remove(li.diff_id)
            self.sync()
            return {"removed": gone}
        if op == "prefetch":
            from dsec.images.registry_ops import prefetch
            if not self._prefetch_lock.acquire(blocking=False):
                return {"skipped": "busy: another prefetch runs on this node", "status": None, "seconds": 0.0}
            try:
                t0 = time.monotonic()
                info = prefetch(self.store, str(args["ref"]), order=[str(d) for d in args.get("order") or []])
                if info is None:
                    return {"skipped": "already here or not in image_registry", "status": None, "seconds": 0.0}
                self.sync()  # peers and the GC see the new holder now, not at the next announce
                done = [p for p in PULLS.snapshot() if p.prefetch and p.state != "pulling"]
                return {"skipped": "", "seconds": time.monotonic() - t0, "image_id": info.id,
                        "status": done[-1].model_dump() if done else None}
            finally:
                self._prefetch_lock.release()
        if op == "stats":
            return {"server": self.server.stats(), "from_peers": dict(self.fetcher.from_peers),
                    "registry_fetches": self.fetcher.registry_fetches, "cut_through": self.fetcher.cut_through,
                    "timeline": list(self.fetcher.timeline),
                    "url": self.server.url}
        raise ValueError(f"unknown p2p admin op {op!r} (pull, forget, prefetch, stats)")

    def close(self) -> None:
        self._stop.set()
        if self.gc is not None:
            self.gc.close()
        if self.store.blob_sources is self.fetcher:
            self.store.blob_sources = None
        if self.store.content.on_receiving == self._receiving:
            self.store.content.on_receiving = None
        self.server.close()
        self.fetcher.close()


def node_host(settings: Settings) -> str:
    """Where the blob endpoint listens: ``p2p_host``, else the node's Ray address."""
    if settings.p2p_host:
        return settings.p2p_host
    import ray.util
    return str(ray.util.get_node_ip_address())


def attach(agent: Any) -> NodePeers | None:
    """Peer-to-peer for a node agent inside a Ray actor (``cluster.ray.NodeAgentServer``):
    None when ``p2p_enabled`` is off or the agent has no image store."""
    s = agent.settings
    store = getattr(agent, "images", None)
    if not s.p2p_enabled or store is None or not hasattr(store, "content"):
        return None
    peers = NodePeers(agent.node_id, store, KVDirectory(RayKV()), s, node_host(s)).start()
    from dsec.cluster.layer_gc import NodeGc

    manager = getattr(agent, "manager", None)

    def live_images() -> set[str]:  # running and pooled sandboxes of this node
        return {r.spec.image for r in list(manager.live.values())} if manager is not None else set()

    peers.gc = NodeGc(agent.node_id, store, peers.dir, s, live_images).start()
    return peers
