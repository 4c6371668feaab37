"""Pure decisions of peer-to-peer layers (dsec.cluster.p2p, blobserve) and pull progress."""

from __future__ import annotations

import random

from dsec.cluster.blobserve import parse_blob_path, token_ok
from dsec.cluster.nodes import pulls_text
from dsec.cluster.p2p import KVDirectory, MemoryKV, claim_stale, order_peers, saturated
from dsec.images.registry_ops import PullTracker

D = "sha256:" + "ab" * 32


def test_order_peers_skips_self_and_failed_and_prefers_least_served() -> None:
    """A fetch never asks itself or a peer that already failed it; holders that served the
    blob least come first (fresh holders take over: a tree, not a star)."""
    got = order_peers(["n0", "n1", "n2", "n3", "me"], "me", {"n3"}, {"n0": (2, 0.0), "n1": (1, 0.0)},
                      random.Random(1))
    assert got == ["n2", "n1", "n0"]
    ties = {tuple(order_peers(["a", "b", "c"], "me", set(), {}, random.Random(s))) for s in range(20)}
    assert len(ties) > 1  # equal holders are shuffled, so concurrent fetchers spread


def test_claim_is_exclusive_until_stale_then_taken_over() -> None:
    """One registry fetch per blob: the first claim wins, a second node is refused while
    the claim is fresh, takes it over once stale, and only the owner can release it."""
    d = KVDirectory(MemoryKV())
    assert d.claim(D, "n0", now=100.0, stale_s=10)
    assert d.claim(D, "n0", now=101.0, stale_s=10)  # re-entrant for its owner
    assert not d.claim(D, "n1", now=105.0, stale_s=10)
    d.refresh_claim(D, "n0", now=108.0)
    assert not d.claim(D, "n1", now=115.0, stale_s=10)
    assert d.claim(D, "n1", now=119.0, stale_s=10)  # n0 silent for 11 s
    d.release_claim(D, "n0")  # not n0's any more: no effect
    assert not d.claim(D, "n2", now=119.5, stale_s=10)
    d.release_claim(D, "n1")
    assert d.claim(D, "n2", now=120.0, stale_s=10)
    assert claim_stale(None, 0, 1) and not claim_stale({"t": 5.0}, 6.0, 2.0)


def test_directory_holders_announce_retract_token() -> None:
    d = KVDirectory(MemoryKV())
    d.announce("n0", [D])
    d.announce("n1", {D})
    assert sorted(d.holders(D)) == ["n0", "n1"]
    d.retract("n0", [D])
    assert d.holders(D) == ["n1"]
    assert d.all_holdings() == {D: {"n1"}}
    tok = d.token()
    assert len(tok) >= 32 and KVDirectory(d.kv).token() == tok  # one token for the whole cluster
    d.note_served(D, "n1", 3, 50.0)
    assert d.served(D) == {"n1": (3, 50.0)}


def test_a_holder_is_saturated_only_within_a_burst() -> None:
    """A holder that began serving p2p_serve_max copies of a blob just now is passed over
    (fresh holders take the next peers: a tree); the same counts an hour old are not."""
    served = {"n0": (2, 100.0), "n1": (1, 100.0)}
    assert saturated(served, "n0", 2, now=101.0, window_s=5)
    assert not saturated(served, "n1", 2, now=101.0, window_s=5)
    assert not saturated(served, "n0", 2, now=3700.0, window_s=5)
    assert not saturated(served, "n9", 2, now=101.0, window_s=5)


def test_blob_endpoint_accepts_only_digest_paths_and_the_token() -> None:
    assert parse_blob_path(f"/v1/blobs/{D}") == D
    for bad in ("/v1/blobs/sha256:abc", f"/v1/blobs/{D}/x", "/v1/blobs/../../etc/passwd", f"/blobs/{D}",
                f"/v1/blobs/{D.upper()}"):
        assert parse_blob_path(bad) is None, bad
    assert token_ok("Bearer s3cret", "s3cret")
    assert not token_ok("Bearer s3cre", "s3cret") and not token_ok(None, "s3cret") and not token_ok("s3cret", "s3cret")
    assert not token_ok("Bearer ", "")  # an unset token never opens the endpoint


def test_pull_tracker_reports_progress_then_sources() -> None:
    """`dsec node ls` shows a pull in progress with its percentage, then the finished pull
    with bytes by source."""
    t = PullTracker()
    k = t.start("reg:5000/a:1", total=200, blobs=2)
    t.advance(k, 50)
    snap = t.snapshot()
    assert snap[0].state == "pulling" and snap[0].done_bytes == 50
    assert pulls_text([s.model_dump() for s in snap]) == "reg:5000/a:1 25%"
    t.blob_done(k, "registry", 100)
    t.blob_done(k, "peer:n1", 100)
    t.fetched(k)
    t.finish(k)
    done = t.snapshot()[0]
    assert done.state == "done" and done.blobs_done == 2 and done.sources == {"registry": 100, "peer:n1": 100}
    assert done.fetch_seconds is not None and done.fetch_seconds <= done.seconds
    assert pulls_text([done.model_dump()]) == "-"
    k2 = t.start("reg:5000/b:1", total=1, blobs=1)
    t.finish(k2, "boom")
    assert t.snapshot()[-1].state == "failed" and t.snapshot()[-1].error == "boom"


def test_a_blob_being_received_is_published_until_committed_or_failed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Cut-through sources: a writer told its digest publishes the partial blob (readers
    follow ``written``) and retracts it on commit; a failed commit ends it ``failed`` so
    the streams that follow it are cut short, and nothing is left in the store."""
    import hashlib

    from dsec.errors import DigestMismatch
    from dsec.images.content import ContentStore

    cs = ContentStore(tmp_path / "blobs")
    seen: list[tuple[str, bool]] = []
    cs.on_receiving = lambda d, on: seen.append((d, on))
    data = b"x" * 1000
    d = "sha256:" + hashlib.sha256(data).hexdigest()
    with cs.writer(expect=(d, len(data))) as w:
        w.write(data[:400])
        inf = cs.inflight[d]
        assert inf.wait(0, 1.0, batch=1) == (400, "receiving")
        assert inf.path.read_bytes() == data[:400]  # on disk for another fd to read
        w.write(data[400:])
        w.commit(d)
    assert inf.state == "done" and d not in cs.inflight and cs.has(d)
    assert seen == [(d, True), (d, False)]
    with cs.writer(expect=(D, 3)) as w:
        w.write(b"abc")
        inf = cs.inflight[D]
        try:
            w.commit(D)
        except DigestMismatch:
            pass
    assert inf.state == "failed" and D not in cs.inflight and not cs.has(D)
    assert list((tmp_path / "blobs" / "ingest").iterdir()) == []
