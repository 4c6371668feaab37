"""Content store: digest verification on ingest and on use; one in-flight op per key."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from dsec.errors import DigestMismatch, InvalidArgument
from dsec.images.build.spec import parse_spec
from dsec.images.content import ContentStore
from dsec.images.fsutil import digest_of
from dsec.images.locks import KeyedLock
from dsec.images.oci import normalize_name


def test_ingest_verifies_digest_and_leaves_nothing_on_mismatch(tmp_path: Path) -> None:
    """A wrong expected digest raises DigestMismatch and leaves no blob or temp file."""
    cs = ContentStore(tmp_path)
    with pytest.raises(DigestMismatch):
        cs.ingest(io.BytesIO(b"payload"), digest_of(b"other"))
    assert cs.all_digests() == [] and list(cs.ingest_dir.iterdir()) == []
    d, size = cs.ingest(io.BytesIO(b"payload"), digest_of(b"payload"))
    assert cs.read_bytes(d) == b"payload" and size == 7


def test_corrupt_cached_blob_is_detected_before_use(tmp_path: Path) -> None:
    """A blob modified on disk is caught by the first-use verification of a new process."""
    d = ContentStore(tmp_path).put_bytes(b"good bytes")
    p = ContentStore(tmp_path).path(d)
    p.chmod(0o644)
    p.write_bytes(b"evil bytes")
    fresh = ContentStore(tmp_path)  # a new process: nothing verified yet
    with pytest.raises(DigestMismatch):
        fresh.read_bytes(d)
    assert not fresh.has(d)


def test_keyed_lock_serializes_same_key_only(tmp_path: Path) -> None:
    """Same key: one holder at a time (others wait); different keys run concurrently."""
    locks = KeyedLock(tmp_path)
    active: dict[str, int] = {"a": 0, "b": 0}
    peak: dict[str, int] = {"a": 0, "b": 0}
    guard = threading.Lock()

    def work(key: str) -> None:
        with locks.hold(key):
            with guard:
                active[key] += 1
                peak[key] = max(peak[key], active[key])
            time.sleep(0.02)
            with guard:
                active[key] -= 1

    threads = [threading.Thread(target=work, args=(k,)) for k in "aaaabbbb"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == {"a": 1, "b": 1}


def test_spec_errors_name_the_problem() -> None:
    """Bad build specs give InvalidArgument naming the field/step."""
    with pytest.raises(InvalidArgument, match="from"):
        parse_spec({"steps": []})
    with pytest.raises(InvalidArgument, match="unknown step type"):
        parse_spec({"from": "busybox", "steps": [{"frobnicate": 1}]})
    with pytest.raises(InvalidArgument, match="exactly one"):
        parse_spec({"from": "busybox", "steps": [{"run": "x", "env": {}}]})
    spec = parse_spec({"from": "busybox", "steps": [{"run": "echo"}, {"run": {"cmd": ["a"], "network": True}},
                                                    {"env": {"A": 1}}, {"workdir": "/w"}]})
    assert spec.steps[0].run.argv() == ["/bin/sh", "-c", "echo"] and spec.steps[1].run.network


def test_normalize_name() -> None:
    """Names get a default tag; docker.io/library prefixes are dropped; junk is refused."""
    assert normalize_name("busybox") == "busybox:latest"
    assert normalize_name("docker.io/library/python:3.11") == "python:3.11"
    assert normalize_name("reg:5000/a/b") == "reg:5000/a/b:latest"
    with pytest.raises(InvalidArgument):
        normalize_name("bad name")


def test_layer_removal_is_undone_when_a_lease_appears(tmp_path: Path) -> None:
    """Eviction renames a layer away, then re-checks for a lease; a prepare that leased it
    meanwhile (lock-free fast path) keeps its layer."""
    from dsec.images.layers import LayerCache

    cache = LayerCache(tmp_path / "layers", KeyedLock(tmp_path / "locks"))
    diff_id = "sha256:" + "ab" * 32
    (cache.dir(diff_id) / "fs").mkdir(parents=True)
    (cache.dir(diff_id) / "seal.json").write_text("{}")
    assert cache.remove(diff_id, still_free=lambda: False) == -1
    assert cache.present(diff_id)
    assert cache.remove(diff_id, still_free=lambda: True) == 0
    assert not cache.dir(diff_id).exists()
    assert [p.name for p in cache.root.iterdir()] == []
