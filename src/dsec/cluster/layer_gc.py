"""Cluster-wide layer GC: which node may drop which blob (a pure decision) and its executor.

Rules (``plan``):

- a blob that a running or pooled sandbox uses on ANY node is kept on every node;
- a blob some node asked for (pulled, or a sandbox used) within ``image_gc_unused_s``
  (24 h) is kept everywhere;
- otherwise a *base layer* (layer 0 of some image: what many images share) keeps
  ``image_base_layer_min_copies`` (3) copies: the keepers are chosen by rendezvous
  hashing of (digest, node), so every node running the decision on its own picks the
  same keepers and no coordination is needed for "at least 3 stay"; only non-keepers
  drop it, and only while the keepers still hold it;
- any other blob is removed from every node that holds it.

``NodeGc`` runs the decision on one node every ``image_gc_cluster_interval_s`` from
the cluster directory (``dsec.cluster.p2p``: holdings, when each blob was last asked
for, which blobs each node's sandboxes use) and applies only this node's part, keeping
image records and blobs consistent (``node_drop``, pure):

- an image goes whole or stays whole: it is removed when one of its blobs is dropped
  here and no lease pins it (a running or pooled sandbox, a pull); a pinned image keeps
  every blob, so a listed image always has all its layers;
- with it go its config and manifest, and its layers the cluster drops here; a layer
  the cluster keeps here (a base-layer keeper, or one asked for lately) stays as a *bare
  copy*: no image names it, but the node still publishes it as a layer (and a base
  layer) it holds, so later passes still count it and may still drop it;
- an image whose layers are gone (no blob, not unpacked) is removed too: it could not
  start a sandbox, and the layer index (what the scheduler's coverage is built from)
  must not claim it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any

from pydantic import BaseModel, Field

log = logging.getLogger("dsec.cluster.gc")


class GcView(BaseModel):
    """What the decision needs to know about the cluster (all from the directory)."""

    holdings: dict[str, set[str]] = Field(default_factory=dict, description="blob digest -> nodes holding it")
    in_use: dict[str, set[str]] = Field(default_factory=dict, description="node -> blobs its running or pooled "
                                        "sandboxes use")
    base: set[str] = Field(default_factory=set, description="base-layer digests (layer 0 of an image)")
    last_wanted: dict[str, float] = Field(default_factory=dict, description="blob -> last time a node asked for "
                                          "it or a sandbox used it (unix s)")


def keepers(digest: str, holders: set[str], k: int) -> set[str]:
    """The ``k`` holders that keep a base layer (rendezvous hashing: stable, spread)."""
    ranked = sorted(holders, key=lambda n: hashlib.sha256(f"{digest}\0{n}".encode()).hexdigest())
    return set(ranked[:k])


def plan(view: GcView, now: float, min_copies: int, unused_s: float) -> dict[str, set[str]]:
    """node -> blobs to remove there (see module docstring). Pure."""
    used = set().union(*view.in_use.values()) if view.in_use else set()
    out: dict[str, set[str]] = {}
    for digest, holders in view.holdings.items():
        if digest in used or now - view.last_wanted.get(digest, 0.0) < unused_s:
            continue
        drop = holders - keepers(digest, holders, min_copies) if digest in view.base else set(holders)
        for node in drop:
            out.setdefault(node, set()).add(digest)
    return out


class NodeImage(BaseModel):
    """One image record of a node's store, as ``node_drop`` needs it."""

    id: str
    layers: list[str] = Field(default_factory=list, description="layer blob digests, base first")
    blobs: set[str] = Field(default_factory=set, description="every blob of it: config, manifest, layers")
    pinned: bool = Field(False, description="a lease holds it (running or pooled sandbox, pull in flight)")
    complete: bool = Field(True, description="every layer is here (blob or unpacked)")


class NodeDrop(BaseModel):
    images: set[str] = Field(default_factory=set, description="image records to remove")
    blobs: set[str] = Field(default_factory=set, description="blobs to delete")
    bare: set[str] = Field(default_factory=set, description="layers of removed images kept as bare copies")


def node_drop(images: list[NodeImage], drop: set[str], leased: set[str]) -> NodeDrop:
    """What this node removes for the cluster's ``drop`` (its share of ``plan``), so that
    image records and blobs stay consistent (see module docstring). Pure."""
    gone = {i.id for i in images if not i.pinned and (i.blobs & drop or not i.complete)}
    kept_refs = set(leased).union(*(i.blobs for i in images if i.id not in gone))
    freed = set().union(*(i.blobs for i in images if i.id in gone))
    layers_of_gone = set().union(*(set(i.layers) for i in images if i.id in gone))
    bare = layers_of_gone - drop - kept_refs  # the cluster wants a copy here
    return NodeDrop(images=gone, blobs=((drop | freed) - bare) - kept_refs, bare=bare)


def published(images: list[NodeImage], held: set[str], prev: dict[str, list[str]]) -> dict[str, list[str]]:
    """What a node publishes about its layers (``p2p:img:<node>``): the base layer and the
    layers of its images, plus the bare copies it still holds from earlier passes (the
    previous record's, intersected with its blobs), so those stay in the GC's view. Pure."""
    base = {i.layers[0] for i in images if i.layers} | (set(prev.get("base", [])) & held)
    layers = {d for i in images for d in i.layers} | (set(prev.get("layers", [])) & held)
    return {"base": sorted(base), "layers": sorted(layers)}


# --- the node side ---------------------------------------------------------------------

_USED = "p2p:used:"  # p2p:used:<node> -> JSON [digests its live sandboxes use]
_IMG = "p2p:img:"    # p2p:img:<node> -> JSON {"base": [layer 0 of each image], "layers": [every layer]}


class NodeGc:
    """One node's share of the cluster GC (see module docstring)."""

    def __init__(self, node: str, store: Any, directory: Any, settings: Any,
                 live_images: Any = None) -> None:
        self.node, self.store, self.dir, self.s = node, store, directory, settings
        self.live_images = live_images or (lambda: set())  # image refs of this node's live sandboxes
        self.removed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsec-cluster-gc", daemon=True)

    def start(self) -> NodeGc:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.s.image_gc_cluster_interval_s):
            try:
                self.run_once()
            except Exception:
                log.exception("cluster layer GC pass failed")

    def used_here(self) -> set[str]:
        """Blobs this node's live sandboxes (running or pooled) use: the images they were
        made from plus whatever the store's leases hold."""
        out: set[str] = set()
        for ref in self.live_images():
            try:
                info = self.store.resolve_fast(ref)
            except Exception:  # noqa: BLE001, S112 - an image gone from the store holds nothing
                continue
            out.add(info.id)
            out.update(li.digest for li in info.layers)
        out.update(d for d in self.store.db.leased_objects() if d.startswith("sha256:"))
        return out

    def publish_use(self) -> set[str]:
        used = self.used_here()
        self.dir.kv.put(_USED + self.node, json.dumps(sorted(used)), True)
        return used

    def view(self) -> GcView:
        kv = self.dir.kv
        in_use = {}
        for k in kv.keys(_USED):
            raw = kv.get(k)
            in_use[k[len(_USED):]] = set(json.loads(raw)) if raw else set()
        base: set[str] = set()
        layers: set[str] = set()
        for raw in (kv.get(k) for k in kv.keys(_IMG)):
            if raw:
                doc = json.loads(raw)
                base.update(doc.get("base", []))
                layers.update(doc.get("layers", []))
        # Layers only: configs and manifests are tiny and go with their image.
        holdings = {d: n for d, n in self.dir.all_holdings().items() if d in layers}
        return GcView(holdings=holdings, in_use=in_use, base=base, last_wanted=self.dir.asked_at())

    def run_once(self, now: float | None = None) -> list[str]:
        """Publish this node's use and base layers, decide, and drop this node's share."""
        now = time.time() if now is None else now
        used = self.publish_use()
        images = self.store.list()
        mine = self.node_images()  # one read per pass (each image: a manifest query, a look at every layer)
        self._publish_layers(mine)
        for d in used:  # in use now counts as wanted now
            self.dir.asked(d, now)
        # This node's own record of when it last used (or got) each image's blobs: a stock
        # image imported at setup and never "asked for" through a pull is not idle from day 0.
        wanted = self.dir.asked_at()
        for info in images:
            t = max(info.last_used or 0.0, info.created_at)
            for d in [info.id] + [li.digest for li in info.layers]:
                if t > wanted.get(d, 0.0):
                    self.dir.asked(d, t)
                    wanted[d] = t
        drop = plan(self.view(), now, self.s.image_base_layer_min_copies, self.s.image_gc_unused_s).get(self.node, set())
        drop -= used
        if not drop and all(i.complete for i in mine):
            return []
        return self._drop(drop)

    def node_images(self) -> list[NodeImage]:
        """This node's image records as ``node_drop`` sees them (leases re-read now)."""
        leased = self.store.db.leased_objects()
        out = []
        for info in self.store.list():
            layers = [li.digest for li in info.layers]
            manifest = self.store.manifest_digest(info.id)
            blobs = {info.id, *layers} | ({manifest} if manifest.startswith("sha256:") else set())
            out.append(NodeImage(
                id=info.id, layers=layers, blobs=blobs,
                pinned=bool((blobs | {li.diff_id for li in info.layers}) & leased),
                complete=all(self.store.content.has(li.digest) or self.store.layers.present(li.diff_id)
                             for li in info.layers)))
        return out

    def _publish_layers(self, mine: list[NodeImage] | None = None) -> None:
        raw = self.dir.kv.get(_IMG + self.node)
        prev = json.loads(raw) if raw else {}
        doc = published(self.node_images() if mine is None else mine, set(self.store.content.all_digests()), prev)
        self.dir.kv.put(_IMG + self.node, json.dumps(doc), True)

    def _drop(self, drop: set[str]) -> list[str]:
        """Apply ``node_drop``: remove the images (never one a lease pins), then delete
        exactly the blobs it names that still nothing references (re-checked: a pull may
        have registered an image meanwhile). Unpacked layers follow the store's own GC and
        cache budget (no image names them any more)."""
        from dsec.images.ops import _referenced

        images = self.node_images()
        decision = node_drop(images, drop, self.store.db.leased_objects())
        names = {i.id: i for i in self.store.list()}
        for image_id in sorted(decision.images):
            info = names.get(image_id)
            log.info("cluster GC: removing image %s (%s) from node %s: no node used its blobs for %.0fs",
                     image_id, ",".join(info.names) if info else "?", self.node, self.s.image_gc_unused_s)
            try:
                self.store.remove(image_id)
            except Exception:
                log.debug("removing image %s failed", image_id, exc_info=True)
        referenced = _referenced(self.store)
        leased = self.store.db.leased_objects()
        gone = []
        for d in sorted(decision.blobs):
            if d in referenced or d in leased:
                continue
            with self.store.locks.hold("blob-" + d):
                if self.store.content.delete(d):
                    gone.append(d)
        self.dir.retract(self.node, gone)
        self._publish_layers()  # bare copies stay in the GC's view; removed layers leave it
        self.removed += gone
        return gone
