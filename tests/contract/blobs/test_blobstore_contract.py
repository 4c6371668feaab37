"""The BlobStore contract: every backend (local, replicated, S3 via a real server) passes it."""

from __future__ import annotations

import pytest

from dsec import errors
from dsec.blobs import cas_key, get_blob, put_blob, sha256_hex


def test_put_get_roundtrip_and_replace(store):
    """Objects read back byte for byte; a second put replaces the first whole."""
    store.put("a/b/c.bin", b"one")
    assert store.get("a/b/c.bin") == b"one"
    store.put("a/b/c.bin", b"two" * 1000)
    assert store.get("a/b/c.bin") == b"two" * 1000
    assert store.stat("a/b/c.bin").size == 3000


def test_missing_key_is_not_found(store):
    """Reading, stat-ing a missing key raises NotFound; exists is False; delete is a no-op."""
    with pytest.raises(errors.NotFound):
        store.get("nope/x")
    with pytest.raises(errors.NotFound):
        store.stat("nope/x")
    assert not store.exists("nope/x")
    store.delete("nope/x")


def test_list_by_prefix_sorted(store):
    """list returns exactly the keys under a prefix, sorted, across nested levels."""
    for k in ["ep/1/u/2", "ep/1/u/1", "ep/1/v", "ep/10/u/1", "other"]:
        store.put(k, k.encode())
    assert store.list("ep/1/") == ["ep/1/u/1", "ep/1/u/2", "ep/1/v"]
    assert store.list("ep/1") == ["ep/1/u/1", "ep/1/u/2", "ep/1/v", "ep/10/u/1"]
    assert store.list("zzz/") == []


def test_delete_removes(store):
    """Deleted keys disappear from get, exists and list."""
    store.put("d/x", b"1")
    store.delete("d/x")
    assert not store.exists("d/x")
    assert store.list("d/") == []


def test_cas_dedup_and_verify(store):
    """put_blob is content-addressed (same bytes, same key) and get_blob verifies them."""
    d1 = put_blob(store, b"hello")
    d2 = put_blob(store, b"hello")
    assert d1 == d2 == "sha256:" + sha256_hex(b"hello")
    assert get_blob(store, d1) == b"hello"
    assert store.list("cas/") == [cas_key(d1)]


def test_empty_object(store):
    """Zero-byte objects are legal (an empty context, an empty diff)."""
    store.put("e/empty", b"")
    assert store.get("e/empty") == b""


@pytest.mark.parametrize("bad", ["../x", "/abs", "a//b", "a/../b", ".tmp/x", "a b", ""])
def test_bad_keys_refused(store, bad):
    """Keys that could escape the root or confuse a backend are refused before any I/O."""
    with pytest.raises(errors.InvalidArgument):
        store.put(bad, b"x")


def test_touch_refreshes_mtime(store):
    """touch restarts an object's GC grace period and refuses absent keys."""
    import time
    store.put("t/x", b"1")
    before = store.stat("t/x").mtime
    time.sleep(1.1)
    store.touch("t/x")
    assert store.stat("t/x").mtime > before
    assert store.get("t/x") == b"1"
    with pytest.raises(errors.NotFound):
        store.touch("t/none")
