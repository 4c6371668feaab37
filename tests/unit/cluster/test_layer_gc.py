"""The cluster-wide layer GC decision (dsec.cluster.layer_gc.plan): pure, no I/O."""

from __future__ import annotations

from dsec.cluster.layer_gc import GcView, NodeDrop, NodeImage, keepers, node_drop, plan, published

DAY = 24 * 3600.0
NOW = 10 * DAY
B, L, C = "sha256:" + "b" * 64, "sha256:" + "1" * 64, "sha256:" + "c" * 64
NODES = {"n0", "n1", "n2", "n3", "n4"}


def _view(**kw: object) -> GcView:
    base: dict[str, object] = {"holdings": {B: set(NODES), L: {"n0", "n1"}, C: {"n2"}}, "base": {B},
                               "in_use": {}, "last_wanted": {B: NOW - 2 * DAY, L: NOW - 2 * DAY, C: NOW - 2 * DAY}}
    base.update(kw)
    return GcView(**base)  # type: ignore[arg-type]


def test_unused_blobs_go_and_base_layers_keep_three_copies() -> None:
    """Idle for more than 24 h and used by no sandbox: other blobs leave every node; a base
    layer stays on exactly 3 nodes (the same 3 whichever node decides)."""
    out = plan(_view(), NOW, min_copies=3, unused_s=DAY)
    assert {n for n, ds in out.items() if L in ds} == {"n0", "n1"}
    assert {n for n, ds in out.items() if C in ds} == {"n2"}
    dropped_b = {n for n, ds in out.items() if B in ds}
    assert len(dropped_b) == 2 and NODES - dropped_b == keepers(B, NODES, 3)
    outsider = next(iter(dropped_b))
    assert keepers(B, NODES - {outsider}, 3) == keepers(B, NODES, 3)  # stable as non-keepers leave


def test_base_layer_with_three_or_fewer_copies_is_never_dropped() -> None:
    out = plan(_view(holdings={B: {"n0", "n1", "n2"}}), NOW, min_copies=3, unused_s=DAY)
    assert out == {}
    out = plan(_view(holdings={B: {"n0"}}), NOW, min_copies=3, unused_s=DAY)
    assert out == {}


def test_a_blob_a_sandbox_uses_anywhere_is_kept_everywhere() -> None:
    """A running or pooled sandbox on n4 uses L (held elsewhere too) and C: nobody drops
    them, however long ago they were asked for."""
    out = plan(_view(in_use={"n4": {L, C}}), NOW, min_copies=3, unused_s=DAY)
    assert all(L not in ds and C not in ds for ds in out.values())


def test_a_blob_asked_for_within_the_window_is_kept() -> None:
    out = plan(_view(last_wanted={B: NOW - 60, L: NOW - DAY + 1, C: NOW - 2 * DAY}), NOW, min_copies=3,
               unused_s=DAY)
    assert out == {"n2": {C}}


def test_never_asked_counts_as_idle_and_settings_are_honoured() -> None:
    out = plan(_view(last_wanted={}), NOW, min_copies=5, unused_s=DAY)
    assert all(B not in ds for ds in out.values())  # 5 copies wanted, 5 held
    assert plan(_view(), NOW, min_copies=3, unused_s=3 * DAY) == {}


def _img(i: str, layers: list[str], **kw: object) -> NodeImage:
    return NodeImage(id=f"sha256:{i * 64}", layers=layers, blobs={f"sha256:{i * 64}", f"sha256:m{i * 63}",
                                                                  *layers}, **kw)  # type: ignore[arg-type]


def test_node_drop_keeps_records_and_blobs_consistent() -> None:
    """An image goes whole or stays whole: one whose top layer the cluster drops here
    leaves with its config, manifest and top layer, while its base layer (a keeper here,
    not dropped) stays as a bare copy; an image another image shares the base with keeps
    it; a pinned image (a sandbox uses it) keeps every blob even if the cluster drops one;
    an image whose layers are gone is removed (never listed as present)."""
    top, top2 = "sha256:" + "2" * 64, "sha256:" + "3" * 64
    gc_img = _img("a", [B, top])
    out = node_drop([gc_img], {top}, set())
    assert out.images == {gc_img.id} and out.bare == {B}
    assert out.blobs == gc_img.blobs - {B}  # config + manifest + top go with it
    other = _img("d", [B, top2])
    out = node_drop([gc_img, other], {top}, set())
    assert out.images == {gc_img.id} and out.bare == set() and B not in out.blobs  # `other` still names B
    pinned = _img("e", [B, top], pinned=True)
    assert node_drop([pinned], {top, B}, set()) == NodeDrop()
    broken = _img("f", [L], complete=False)
    out = node_drop([broken], set(), set())
    assert out.images == {broken.id} and L in out.bare  # not dropped by the cluster: a bare copy
    assert node_drop([broken], set(), {L}).blobs.isdisjoint({L})  # a lease protects a blob


def test_published_layers_keep_bare_copies_in_view() -> None:
    """A bare base-layer copy (its image removed) stays published as a base layer and a
    layer while the node holds it, so the 3-copy rule still counts it; once deleted it
    leaves the record."""
    top = "sha256:" + "2" * 64
    prev = published([_img("a", [B, top])], {B, top}, {})
    assert prev == {"base": [B], "layers": sorted([B, top])}
    assert published([], {B}, prev) == {"base": [B], "layers": [B]}
    assert published([], set(), prev) == {"base": [], "layers": []}
