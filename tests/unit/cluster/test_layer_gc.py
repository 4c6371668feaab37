"""The cluster-wide layer GC decision (dsec.cluster.layer_gc.plan): pure, no I/O."""

from __future__ import annotations

from dsec.cluster.layer_gc import GcView, keepers, plan

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
