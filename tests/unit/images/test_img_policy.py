"""Pure cache policy: eviction order, leases, GC candidates, layer index set math."""

from __future__ import annotations

from dsec.images.policy import (
    ImageStat,
    LayerStat,
    coverage,
    gc_candidates,
    keep_score,
    missing_layers,
    plan_eviction,
)

NOW = 1_000_000.0


def L(d: str, size: int, uses: int = 1, images: tuple[str, ...] = ("i1",), age: float = 86400) -> LayerStat:
    return LayerStat(d, size, uses, NOW - 10, NOW - age, frozenset(images))


def test_nothing_evicted_within_budget_and_recent() -> None:
    """Layers of recent images within the byte budget stay."""
    layers = [L("a", 10), L("b", 20)]
    assert plan_eviction(layers, [ImageStat("i1", NOW)], set(), 20, 100, NOW) == []


def test_over_budget_evicts_lowest_score_first() -> None:
    """Over budget: rarely used, small (cheap to re-fetch) layers go first; big popular ones stay."""
    layers = [L("big-popular", 80, uses=100), L("small-rare", 10, uses=0), L("mid", 30, uses=1)]
    out = plan_eviction(layers, [ImageStat("i1", NOW)], set(), 20, 100, NOW)
    assert out[0] == "small-rare" and "big-popular" not in out


def test_leased_layer_never_evicted() -> None:
    """A layer held by a lease (running/pooled sandbox, build, checkpoint) is never evicted."""
    layers = [L("leased", 1000, uses=0)]
    assert plan_eviction(layers, [ImageStat("i1", NOW)], {"leased"}, 0, 0, NOW) == []


def test_layers_outside_max_recent_images_are_evicted() -> None:
    """Only the N most recently used images' layers are kept; shared layers stay."""
    layers = [L("old-only", 5, images=("old",)), L("shared", 5, images=("old", "new")), L("new", 5, images=("new",))]
    images = [ImageStat("old", NOW - 100), ImageStat("new", NOW)]
    assert plan_eviction(layers, images, set(), 1, 10**9, NOW) == ["old-only"]


def test_score_weighs_frequency_and_size() -> None:
    """Score grows with both use frequency and size (re-fetch cost)."""
    assert keep_score(L("a", 100, uses=10), NOW) > keep_score(L("a", 100, uses=1), NOW)
    assert keep_score(L("a", 1000, uses=1), NOW) > keep_score(L("a", 100, uses=1), NOW)


def test_gc_candidates_need_unreferenced_unleased_and_old() -> None:
    """GC deletes only objects that are unreferenced, unleased and unused for the window."""
    present = {"old": NOW - 90000, "recent": NOW - 10, "ref": NOW - 90000, "leased": NOW - 90000}
    assert gc_candidates(present, {"ref"}, {"leased"}, 86400, NOW) == ["old"]


def test_missing_layers_and_coverage() -> None:
    """The scheduler's question: which layers/bytes of image I does this node miss."""
    wanted = {"a": 100, "b": 300, "c": 600}
    assert missing_layers(wanted, {"a", "x"}) == ({"b", "c"}, 900)
    assert coverage(wanted, {"c"}) == 0.6
    assert coverage({}, set()) == 1.0
