"""Pure checkpoint logic: signature diffs, layer squash semantics, manifest, retention, units."""

from __future__ import annotations

import stat
import tarfile

from dsec.blobs import LocalBlobStore
from dsec.checkpoints import fsdiff, layers
from dsec.checkpoints.layers import Node
from dsec.checkpoints.unit import (
    Compat,
    UnitMeta,
    commit_unit,
    complete_units,
    list_unit_keys,
    load_meta,
    put_part,
    units_to_drop,
)

D, F = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644


def sig(mode, ino=1, mtime=0, opaque=False):
    return (mode, 0, 0, 0, mtime, mtime, ino, 0, opaque)


def test_diff_signatures_changes_deletes_and_masking():
    """New/changed entries are listed parents first; only top-most vanished entries get
    whiteouts; children of a newly opaque dir or a dir turned file need none."""
    prev = {"a": sig(D), "a/x": sig(F, 2), "b": sig(D, 3), "b/y": sig(F, 4), "c": sig(F, 5), "d": sig(D, 6),
            "d/z": sig(F, 7)}
    cur = {"a": sig(D, 1, 9), "a/x": sig(F, 2), "b": sig(D, 30, 9, opaque=True), "d": sig(F, 8)}
    ch = fsdiff.diff_signatures(prev, cur)
    assert ch.changed == ["a", "b", "d"]
    assert ch.deleted == ["c"]
    assert ch.opaque_new == ["b"]
    assert fsdiff.diff_signatures(cur, cur).empty


def _f(name, data=b"x"):
    i = tarfile.TarInfo(name)
    i.size = len(data)
    return Node(info=i, data=data)


def _d(name):
    i = tarfile.TarInfo(name)
    i.type = tarfile.DIRTYPE
    return Node(info=i)


def test_squash_matches_overlay_semantics():
    """Stacking layers: whiteouts delete subtrees, opaque dirs hide older children, a dir
    replacing a whiteout becomes opaque, and useless whiteouts are dropped."""
    l1 = layers.write_layer({"w": _d("w"), "w/a": _f("w/a"), "w/b": _f("w/b"), "etc": _d("etc")})
    l2 = layers.write_layer({"w": _d("w"), "w/a": Node(info=None, whiteout=True),
                             "etc/hosts": Node(info=None, whiteout=True)})
    l3 = layers.write_layer({"etc": _d("etc"), "etc/hosts": _d("etc/hosts")})
    merged = layers.read_layer(layers.squash([l1, l2, l3], in_image=lambda p: p.startswith("etc")))
    assert sorted(merged) == ["etc", "etc/hosts", "w", "w/b"]
    assert merged["etc/hosts"].opaque and merged["etc/hosts"].info.isdir()
    l4 = layers.write_layer({"w": Node(info=_d("w").info, opaque=True), "w/c": _f("w/c")})
    merged = layers.read_layer(layers.squash([l1, l4], in_image=lambda p: False))
    assert sorted(merged) == ["etc", "w", "w/c"] and merged["w"].opaque


def test_layer_rejects_escaping_paths():
    """A layer entry with '..' is refused before anything is unpacked."""
    import io

    import pytest
    import zstandard

    from dsec import errors
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:") as t:
        t.addfile(tarfile.TarInfo("../evil"), io.BytesIO(b""))
    with pytest.raises(errors.CheckpointError):
        layers.read_layer(zstandard.ZstdCompressor().compress(buf.getvalue()))


def test_manifest_ignores_whiteouts_of_episode_files():
    """Deleting a file the episode created leaves the same canonical state as never creating it."""
    m1: dict = {}
    fsdiff.apply_to_manifest(m1, {"w": _d("w"), "w/tmp": _f("w/tmp")}, in_image=lambda p: False)
    fsdiff.apply_to_manifest(m1, {"w/tmp": Node(info=None, whiteout=True)}, in_image=lambda p: False)
    m2: dict = {}
    fsdiff.apply_to_manifest(m2, {"w": _d("w")}, in_image=lambda p: False)
    assert fsdiff.manifest_digest(m1) == fsdiff.manifest_digest(m2)
    fsdiff.apply_to_manifest(m2, {"bin/sh": Node(info=None, whiteout=True)}, in_image=lambda p: True)
    assert m2["bin/sh"] == ["wh"]


def test_retention_policy():
    """The K newest units are kept; at least one always survives."""
    assert units_to_drop([9, 8, 7, 6], 2) == [7, 6]
    assert units_to_drop([9], 5) == []
    assert units_to_drop([9, 8], 0) == [8]


def _meta(seq, parts=()):
    c = Compat(image="bb")
    return UnitMeta(episode_id="e", seq=seq, steps=seq, compat=c, compat_hash=c.hash(), trajectory=list(parts))


def test_units_without_parts_or_with_bad_metadata_are_invisible(tmp_path):
    """Readers see only units whose metadata verifies and whose parts exist."""
    store = LocalBlobStore(tmp_path)
    p = put_part(store, b"segment")
    commit_unit(store, _meta(0, [p]))
    k1 = commit_unit(store, _meta(1, [p]))
    missing = put_part(store, b"gone")
    commit_unit(store, _meta(2, [missing]))
    store.delete("cas/sha256/" + missing.digest.split(":")[1])
    assert [m.seq for m in complete_units(store, "e")] == [1, 0]
    (tmp_path / k1).write_bytes((tmp_path / k1).read_bytes().replace(b'"steps":1', b'"steps":7'))
    assert load_meta(store, k1) is None
    assert [m.seq for m in complete_units(store, "e")] == [0]
    assert len(list_unit_keys(store, "e")) == 3


def test_gc_keeps_referenced_and_young_blobs(tmp_path):
    """GC deletes only blobs no unit references and older than the grace period; retention
    drops old metadata so their exclusive parts become collectable."""
    import time as _t
    store = LocalBlobStore(tmp_path)
    from dsec.checkpoints.unit import apply_retention, collect_garbage
    shared = put_part(store, b"shared segment")
    only_old = put_part(store, b"only in unit 0")
    commit_unit(store, _meta(0, [shared, only_old]))
    commit_unit(store, _meta(1, [shared]))
    orphan = put_part(store, b"written, unit never committed")
    assert collect_garbage(store, grace_s=3600) == 0          # everything is young
    assert collect_garbage(store, grace_s=0, now=_t.time() + 1) == 1  # the orphan
    apply_retention(store, "e", keep=1)
    assert collect_garbage(store, grace_s=0, now=_t.time() + 1) == 1  # only_old, now unreferenced
    assert store.exists("cas/sha256/" + shared.digest.split(":")[1])
    assert not store.exists("cas/sha256/" + orphan.digest.split(":")[1])


def test_squash_policy_and_adoption_only_splice_a_matching_prefix():
    """A squash is due at ``full_every`` layers; its result replaces exactly the prefix it
    was made from, and is refused when the chain no longer starts with those layers
    (the episode was restored from another unit while the squash ran)."""
    from dsec.checkpoints.fsstate import adopt_squash, should_squash
    from dsec.checkpoints.unit import LayerRef
    L = [LayerRef(digest=f"sha256:{i}", size=i, full=i == 0) for i in range(5)]
    full = LayerRef(digest="sha256:f", size=9, full=True, squash_of=[r.digest for r in L[:3]])
    assert not should_squash(L[:2], 3) and should_squash(L[:3], 3)
    assert adopt_squash(L, L[:3], full) == [full, L[3], L[4]]
    assert adopt_squash(L[:3], L[:3], full) == [full]
    assert adopt_squash([L[0], L[2], L[3]], L[:3], full) is None     # restored elsewhere meanwhile
    assert adopt_squash(L[:2], L[:3], full) is None                  # shorter chain: not a prefix
    assert adopt_squash(L, [], full) is None
