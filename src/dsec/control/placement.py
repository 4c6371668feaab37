"""Instance-level placement: filter nodes, then score them. Pure; the hot path.

``OursPolicy`` is DSec's policy; ``RandomPolicy``, ``LeastLoadedPolicy`` and
``K8sPolicy`` (ImageLocality + NodeResourcesFit/LeastAllocated, as kube-scheduler scores
by default) are the baselines the simulator compares against. All share one signature:
``choose(req, image, cluster, rng) -> (node, missing_bytes) | None``.
"""

from __future__ import annotations

import random
from typing import Protocol

from dsec.config import Settings
from dsec.control.overcommit import fits
from dsec.control.types import Image, Node, Request


class IndexedSet:
    """A set with O(1) add/remove and O(k) random sampling (list + position map).

    ``objs`` runs parallel to ``items`` (the node object of each id, when given), so a
    sampled candidate costs one list index, not a dict lookup as well."""

    __slots__ = ("items", "objs", "pos")

    def __init__(self) -> None:
        self.items: list[str] = []
        self.objs: list[object] = []
        self.pos: dict[str, int] = {}

    def add(self, x: str, obj: object = None) -> None:
        if x not in self.pos:
            self.pos[x] = len(self.items)
            self.items.append(x)
            self.objs.append(obj)

    def discard(self, x: str) -> None:
        i = self.pos.pop(x, None)
        if i is None:
            return
        last = self.items.pop()
        last_obj = self.objs.pop()
        if i < len(self.items):
            self.items[i] = last
            self.objs[i] = last_obj
            self.pos[last] = i

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, x: object) -> bool:
        return x in self.pos


class ClusterView:
    """Nodes plus the layer -> nodes index the scheduler maintains for placement."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.node_list: list[Node] = []
        self.layer_index: dict[str, IndexedSet] = {}

    def add_node(self, node: Node) -> None:
        if node.node_id in self.nodes:
            raise ValueError(f"node {node.node_id!r} already registered")
        self.nodes[node.node_id] = node
        self.node_list.append(node)
        for d in node.layers:
            self.layer_index.setdefault(d, IndexedSet()).add(node.node_id, node)

    def remove_node(self, node_id: str) -> Node | None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            self.node_list = [n for n in self.node_list if n.node_id != node_id]
            for d in node.layers:
                idx = self.layer_index.get(d)
                if idx is not None:
                    idx.discard(node_id)
        return node

    def add_layers(self, node: Node, digests: list[str] | tuple[str, ...] | set[str]) -> None:
        for d in digests:
            if d not in node.layers:
                node.layers.add(d)
                self.layer_index.setdefault(d, IndexedSet()).add(node.node_id, node)

    def remove_layers(self, node: Node, digests: list[str] | tuple[str, ...] | set[str]) -> None:
        for d in digests:
            if d in node.layers:
                node.layers.discard(d)
                idx = self.layer_index.get(d)
                if idx is not None:
                    idx.discard(node.node_id)


def missing_bytes(node: Node, image: Image) -> int:
    have = node.layers
    return sum(s for d, s in image.layers if d not in have)


def _eligible(node: Node, req: Request, ratio: float, threshold: float) -> bool:
    if not node.healthy or req.isolation not in node.isolation or node.node_id in req.excluded:
        return False
    if req.selector and any(node.labels.get(k) != v for k, v in req.selector.items()):
        return False
    return fits(node, req, ratio, threshold)


class Policy(Protocol):
    name: str

    def choose(self, req: Request, image: Image, cluster: ClusterView,
               rng: random.Random) -> tuple[Node, int] | None: ...


class OursPolicy:
    """Layer coverage in bytes + load + predicted load, with a per-batch spread penalty.

    Small clusters: every node is a candidate. Large clusters (> ``sparrow_min_nodes``):
    samples of nodes holding the image's top layer and its largest layer (``k``/2 each)
    plus ``sparrow_probes`` random probes (Sparrow's power of d choices), so a decision costs O(candidates), not O(nodes).
    Nodes missing more than ``image_miss_threshold`` of the image's bytes are refused
    while a candidate within the threshold exists.
    """

    name = "ours"

    def __init__(self, s: Settings) -> None:
        self.ratio = s.overcommit_ratio
        self.threshold = s.overcommit_threshold
        self.miss = s.image_miss_threshold
        self.wl, self.wload, self.wp = s.place_w_locality, s.place_w_load, s.place_w_predicted
        self.spread = s.place_spread
        self.k = s.locality_candidates
        self.d = s.sparrow_probes
        self.min_nodes = s.sparrow_min_nodes
        self.half = max(1, self.k // 2)

    def candidates(self, image: Image, cluster: ClusterView, rng: random.Random) -> list[Node]:
        nl = cluster.node_list
        if len(nl) <= self.min_nodes:
            return nl
        out: list[Node] = []
        half = self.half
        rnd = rng.random
        index = cluster.layer_index
        for digest in image.probe:
            holders = index.get(digest)
            if holders is not None:
                objs = holders.objs
                m = len(objs)
                if m <= half:
                    out.extend(objs)  # type: ignore[arg-type]
                else:
                    # With replacement: a duplicate candidate costs one extra score, while
                    # random.sample costs more than the whole scoring loop.
                    out.extend([objs[int(rnd() * m)] for _ in range(half)])  # type: ignore[misc]
        n = len(nl)
        for _ in range(self.d):
            out.append(nl[int(rnd() * n)])
        return out

    def score(self, node: Node, miss: int, total: int) -> float:
        """A node's score for an image of ``total`` bytes it misses ``miss`` of (higher is
        better). ``choose`` inlines this formula in its hot loop: change both together."""
        return (self.wl * (1.0 - miss / total) - self.wload * (node.used_cpu / node.cpu)
                - self.wp * node.predicted - self.spread * node.batch_load)

    def choose(self, req: Request, image: Image, cluster: ClusterView,
               rng: random.Random) -> tuple[Node, int] | None:
        total = image.total_bytes or 1
        layers, digests = image.layers, image.digests
        ratio, thr = self.ratio, self.threshold
        wl, wload, wp, spread = self.wl, self.wload, self.wp, self.spread
        near = self.miss * total
        cpu, mem, disk, gpu, iso = req.cpu, req.memory, req.disk, req.gpu, req.isolation
        excluded, selector = req.excluded, req.selector
        best = best_near = None
        best_s = best_near_s = -1e18
        best_m = best_near_m = 0
        for node in self.candidates(image, cluster, rng):
            # Inlined ``_eligible``/``fits`` (same rule; the hot loop cannot afford the calls).
            if (not node.healthy or node.predicted >= thr or iso not in node.isolation
                    or node.used_cpu + cpu > node.cpu * ratio + 1e-9
                    or node.used_memory + mem > node.memory * ratio
                    or node.used_disk + disk > node.disk or node.count >= node.max_sandboxes):
                continue
            if excluded and node.node_id in excluded:
                continue
            if gpu is not None and node.gpu_used.get(gpu, 0) >= node.gpus.get(gpu, 0):
                continue
            if selector and any(node.labels.get(k) != v for k, v in selector.items()):
                continue
            have = node.layers
            miss = 0
            if not digests <= have:  # most candidates hold the whole image: one C-level test
                for d, sz in layers:
                    if d not in have:
                        miss += sz
            score = (wl * (1.0 - miss / total) - wload * (node.used_cpu / node.cpu)  # = self.score(), inlined
                     - wp * node.predicted - spread * node.batch_load)
            if score > best_s:
                best, best_s, best_m = node, score, miss
            if score > best_near_s and miss <= near:
                best_near, best_near_s, best_near_m = node, score, miss
        if best_near is not None:
            return best_near, best_near_m
        return (best, best_m) if best is not None else None


def rank(policy: OursPolicy, req: Request, image: Image, cluster: ClusterView) -> list[tuple[Node, int]]:
    """Every node that could take ``req`` now (room, health, isolation, selector), in the
    order ``OursPolicy.choose`` prefers them: nodes within ``image_miss_threshold`` of the
    image first, each group by the same score, best first; with the bytes each misses.
    Not the hot path (the prefetcher asks which nodes the scheduler will pick next for a
    popular image): it scores every node, where ``choose`` samples large clusters."""
    total = image.total_bytes or 1
    near = policy.miss * total
    scored: list[tuple[bool, float, str, Node, int]] = []
    for node in cluster.node_list:
        if not _eligible(node, req, policy.ratio, policy.threshold):
            continue
        miss = missing_bytes(node, image)
        scored.append((miss <= near, policy.score(node, miss, total), node.node_id, node, miss))
    # Ties broken by node id, so the answer does not depend on the node list's order.
    scored.sort(key=lambda t: (not t[0], -t[1], t[2]))
    return [(node, miss) for _, _, _, node, miss in scored]


class RandomPolicy:
    """Baseline: a uniformly random feasible node."""

    name = "random"

    def __init__(self, s: Settings) -> None:
        self.ratio, self.threshold = s.overcommit_ratio, s.overcommit_threshold

    def choose(self, req: Request, image: Image, cluster: ClusterView,
               rng: random.Random) -> tuple[Node, int] | None:
        nl = cluster.node_list
        n = len(nl)
        for _ in range(32):
            node = nl[int(rng.random() * n)]
            if _eligible(node, req, self.ratio, self.threshold):
                return node, missing_bytes(node, image)
        ok = [x for x in nl if _eligible(x, req, self.ratio, self.threshold)]
        if not ok:
            return None
        node = ok[int(rng.random() * len(ok))]
        return node, missing_bytes(node, image)


class LeastLoadedPolicy:
    """Baseline: the feasible node with the lowest allocated CPU fraction."""

    name = "least-loaded"

    def __init__(self, s: Settings) -> None:
        self.ratio, self.threshold = s.overcommit_ratio, s.overcommit_threshold

    def choose(self, req: Request, image: Image, cluster: ClusterView,
               rng: random.Random) -> tuple[Node, int] | None:
        best, best_f = None, 1e18
        ratio, thr, cpu, mem, disk = self.ratio, self.threshold, req.cpu, req.memory, req.disk
        iso, gpu, excluded, selector = req.isolation, req.gpu, req.excluded, req.selector
        for node in cluster.node_list:
            f = node.used_cpu / node.cpu
            # ``_eligible`` inlined (same rule): every node is visited for every decision.
            if (f >= best_f or node.used_cpu + cpu > node.cpu * ratio + 1e-9 or not node.healthy
                    or node.used_memory + mem > node.memory * ratio or node.used_disk + disk > node.disk
                    or iso not in node.isolation or node.predicted >= thr
                    or node.count >= node.max_sandboxes):
                continue
            if excluded and node.node_id in excluded:
                continue
            if gpu is not None and node.gpu_used.get(gpu, 0) >= node.gpus.get(gpu, 0):
                continue
            if selector and any(node.labels.get(k) != v for k, v in selector.items()):
                continue
            best, best_f = node, f
        return (best, missing_bytes(best, image)) if best is not None else None


class K8sPolicy:
    """Baseline modelled on kube-scheduler defaults.

    Scores a sample of feasible nodes (percentageOfNodesToScore: adaptive, >= 100 nodes)
    with NodeResourcesFit/LeastAllocated (0..100) + ImageLocality (0..100: bytes present,
    each layer scaled by the fraction of nodes holding it, clamped between 23 MB and
    1000 MB) with equal weights.
    """

    name = "k8s"
    MIN_BYTES = 23 * 1024 * 1024
    MAX_BYTES = 1000 * 1024 * 1024

    def __init__(self, s: Settings) -> None:
        self.ratio, self.threshold = s.overcommit_ratio, s.overcommit_threshold

    def choose(self, req: Request, image: Image, cluster: ClusterView,
               rng: random.Random) -> tuple[Node, int] | None:
        nl = cluster.node_list
        n = len(nl)
        pct = max(5.0, 50.0 - n / 125.0)
        want = max(min(n, 100), int(n * pct / 100.0))
        total_nodes = float(n)
        spread = [(d, sz * len(cluster.layer_index.get(d) or ()) / total_nodes) for d, sz in image.layers]
        start = int(rng.random() * n)
        best, best_s, found = None, -1e18, 0
        ratio, thr = self.ratio, self.threshold
        cpu, mem, disk, iso = req.cpu, req.memory, req.disk, req.isolation
        gpu, excluded, selector = req.gpu, req.excluded, req.selector
        order = nl[start:] + nl[:start]
        for node in order:
            # ``_eligible`` inlined (same rule): this loop visits hundreds of nodes per decision.
            if (not node.healthy or node.used_cpu + cpu > node.cpu * ratio + 1e-9
                    or node.used_memory + mem > node.memory * ratio or node.used_disk + disk > node.disk
                    or iso not in node.isolation or node.predicted >= thr
                    or node.count >= node.max_sandboxes):
                continue
            if excluded and node.node_id in excluded:
                continue
            if gpu is not None and node.gpu_used.get(gpu, 0) >= node.gpus.get(gpu, 0):
                continue
            if selector and any(node.labels.get(k) != v for k, v in selector.items()):
                continue
            found += 1
            have = node.layers
            loc = 0.0
            for d, w in spread:
                if d in have:
                    loc += w
            loc = min(max(loc, self.MIN_BYTES), self.MAX_BYTES)
            loc_score = 100.0 * (loc - self.MIN_BYTES) / (self.MAX_BYTES - self.MIN_BYTES)
            fit = 50.0 * ((1 - node.used_cpu / node.cpu) + (1 - node.used_memory / node.memory))
            score = loc_score + fit
            if score > best_s:
                best, best_s = node, score
            if found >= want:
                break
        return (best, missing_bytes(best, image)) if best is not None else None


POLICIES: dict[str, type] = {p.name: p for p in (OursPolicy, RandomPolicy, LeastLoadedPolicy, K8sPolicy)}


def make_policy(name: str, s: Settings) -> Policy:
    try:
        return POLICIES[name](s)
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {sorted(POLICIES)}") from None
