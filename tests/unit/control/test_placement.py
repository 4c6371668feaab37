"""Instance-level placement: filters and scores of our policy and the baselines."""

from __future__ import annotations

import random

from dsec.control.placement import (
    ClusterView,
    IndexedSet,
    K8sPolicy,
    LeastLoadedPolicy,
    OursPolicy,
    RandomPolicy,
)
from dsec.control.types import Image, Node

from .helpers import GIB, MIB, req, settings

IMG = Image("img", (("base", 300 * MIB), ("mid", 100 * MIB), ("top", 10 * MIB)))


def cluster(n: int = 4, **kw: object) -> ClusterView:
    c = ClusterView()
    for i in range(n):
        c.add_node(Node(f"n{i}", 16, 64 * GIB, 500 * GIB, isolation=frozenset({"container"}), **kw))  # type: ignore[arg-type]
    return c


def test_prefers_node_with_layers() -> None:
    """The node holding the image's bytes wins over emptier nodes without them."""
    c = cluster()
    c.add_layers(c.nodes["n2"], ["base", "mid", "top"])
    c.nodes["n2"].used_cpu = 8
    node, miss = OursPolicy(settings()).choose(req("a"), IMG, c, random.Random(1))  # type: ignore[misc]
    assert node.node_id == "n2" and miss == 0


def test_refuses_nodes_missing_more_than_threshold_while_better_exists() -> None:
    """A node missing > 30 % of the bytes is refused while a node within 30 % exists,
    even if the refused node is far less loaded."""
    c = cluster(2)
    c.add_layers(c.nodes["n0"], ["base"])  # misses 110/410 = 27 %
    c.nodes["n0"].used_cpu = 15
    c.nodes["n0"].predicted = 0.8
    pol = OursPolicy(settings(place_w_locality=0.1))  # load would otherwise dominate
    node, miss = pol.choose(req("a", cpu=1), IMG, c, random.Random(1))  # type: ignore[misc]
    assert node.node_id == "n0" and miss == 110 * MIB


def test_pulls_when_no_node_is_within_threshold() -> None:
    """With no node near the image, the best-scored node is still used (a pull)."""
    c = cluster(3)
    node, miss = OursPolicy(settings()).choose(req("a"), IMG, c, random.Random(1))  # type: ignore[misc]
    assert miss == IMG.total_bytes


def test_spread_factor_moves_load_off_hot_node() -> None:
    """Within a batch, a hot node with the layers stops taking everything."""
    c = cluster(2)
    for n in c.node_list:
        c.add_layers(n, ["base", "mid"])
    c.add_layers(c.nodes["n0"], ["top"])
    pol = OursPolicy(settings(place_spread=0.05))
    rng = random.Random(1)
    chosen = []
    for i in range(6):
        node, _ = pol.choose(req(f"r{i}", cpu=0.1), IMG, c, rng)  # type: ignore[misc]
        node.batch_load += 1
        chosen.append(node.node_id)
    assert chosen[0] == "n0" and "n1" in chosen


def test_filters_health_isolation_selector_and_exclusions() -> None:
    """Unhealthy, wrong-tier, label-mismatched and excluded nodes are never chosen."""
    c = cluster(4)
    c.nodes["n0"].healthy = False
    c.nodes["n1"].isolation = frozenset({"gvisor"})
    c.nodes["n2"].labels = {"zone": "a"}
    c.nodes["n3"].labels = {"zone": "b"}
    pol = OursPolicy(settings())
    r = req("a", selector={"zone": "b"})
    assert pol.choose(r, IMG, c, random.Random(1))[0].node_id == "n3"  # type: ignore[index]
    r.excluded.add("n3")
    assert pol.choose(r, IMG, c, random.Random(1)) is None


def test_sampling_bounds_candidates_in_large_clusters() -> None:
    """Above sparrow_min_nodes, candidates = k/2 holders of the image's top layer + k/2
    holders of its largest layer + d random probes, whatever the cluster size."""
    c = cluster(500)
    for i in range(0, 500, 5):
        c.add_layers(c.node_list[i], ["base"])
    for i in range(0, 500, 50):
        c.add_layers(c.node_list[i], ["top"])
    pol = OursPolicy(settings(sparrow_min_nodes=200, locality_candidates=8, sparrow_probes=2))
    cands = pol.candidates(IMG, c, random.Random(3))
    assert len(cands) == 10
    assert all("top" in n.layers for n in cands[:4]) and all("base" in n.layers for n in cands[4:8])


def test_baselines_choose_feasible_nodes() -> None:
    """Random, least-loaded and k8s never choose a full or unhealthy node."""
    c = cluster(3)
    c.nodes["n0"].used_cpu = 16
    c.nodes["n1"].healthy = False
    s = settings(overcommit_ratio=1.0)
    for pol in (RandomPolicy(s), LeastLoadedPolicy(s), K8sPolicy(s)):
        assert pol.choose(req("a"), IMG, c, random.Random(2))[0].node_id == "n2"  # type: ignore[index]


def test_k8s_baseline_prefers_image_locality() -> None:
    """The k8s baseline scores ImageLocality: equal load, the node with layers wins."""
    c = cluster(3)
    c.add_layers(c.nodes["n1"], ["base", "mid", "top"])
    assert K8sPolicy(settings()).choose(req("a"), IMG, c, random.Random(2))[0].node_id == "n1"  # type: ignore[index]


def test_indexed_set_sampling_structure() -> None:
    """IndexedSet stays consistent through adds and swap-removes."""
    s = IndexedSet()
    for x in "abcde":
        s.add(x)
    s.discard("b")
    s.discard("zz")
    s.add("a")
    assert sorted(s.items) == ["a", "c", "d", "e"] and all(s.items[s.pos[x]] == x for x in s.items)


def test_layer_index_follows_removals() -> None:
    """Removing layers or a node drops it from the locality index."""
    c = cluster(2)
    c.add_layers(c.nodes["n0"], ["base"])
    c.remove_layers(c.nodes["n0"], ["base"])
    assert len(c.layer_index["base"]) == 0
    c.add_layers(c.nodes["n1"], ["base"])
    c.remove_node("n1")
    assert len(c.layer_index["base"]) == 0 and [n.node_id for n in c.node_list] == ["n0"]
