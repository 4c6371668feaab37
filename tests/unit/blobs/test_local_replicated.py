"""Crash-safety and failover behaviour of the local and replicated blob stores."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsec import errors
from dsec.blobs import LocalBlobStore, ReplicatedBlobStore, cas_key, get_blob, put_blob
from dsec.testing import faults
from dsec.testing.faults import FAULT_EXIT_CODE, FaultInjected


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.disarm_all()


@pytest.mark.parametrize("point", ["blob.local.mid_write", "blob.local.before_rename"])
def test_crash_mid_put_leaves_old_object(tmp_path, point):
    """A process killed half-way through a put leaves the previous object intact and no partial one."""
    store = LocalBlobStore(tmp_path)
    store.put("k/v", b"old")
    code = (f"from dsec.blobs import LocalBlobStore\n"
            f"LocalBlobStore({str(tmp_path)!r}).put('k/v', b'new' * 100000)\n")
    proc = subprocess.run([sys.executable, "-c", code], env={"DSEC_FAULTS": f"{point}=exit"}, check=False)
    assert proc.returncode == FAULT_EXIT_CODE
    again = LocalBlobStore(tmp_path)  # reopening cleans orphaned temp files
    assert again.get("k/v") == b"old"
    assert again.list("") == ["k/v"]
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_raised_fault_cleans_temp(tmp_path):
    """An in-process failure during put removes its temp file and surfaces the error."""
    store = LocalBlobStore(tmp_path)
    faults.arm("blob.local.mid_write", "raise")
    with pytest.raises(FaultInjected):
        store.put("k", b"data")
    assert not store.exists("k")
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_corrupt_replica_fails_over_and_repairs(tmp_path):
    """A corrupt or missing copy on one replica is served from the other and rewritten."""
    a, b = LocalBlobStore(tmp_path / "a"), LocalBlobStore(tmp_path / "b")
    rep = ReplicatedBlobStore([a, b])
    d = put_blob(rep, b"payload" * 100)
    (tmp_path / "a" / cas_key(d)).write_bytes(b"garbage")
    assert get_blob(rep, d) == b"payload" * 100
    assert a.get(cas_key(d)) == b"payload" * 100  # repaired
    a.delete(cas_key(d))
    assert get_blob(rep, d) == b"payload" * 100
    assert a.exists(cas_key(d))


def test_corrupt_everywhere_is_digest_mismatch(tmp_path):
    """When every replica is corrupt the read fails loudly, never returning bad bytes."""
    a, b = LocalBlobStore(tmp_path / "a"), LocalBlobStore(tmp_path / "b")
    rep = ReplicatedBlobStore([a, b])
    d = put_blob(rep, b"x" * 10)
    for root in ("a", "b"):
        (tmp_path / root / cas_key(d)).write_bytes(b"y" * 10)
    with pytest.raises(errors.DigestMismatch):
        rep.get(cas_key(d))


def test_failed_replica_put_rolls_back(tmp_path):
    """If one replica fails, the object is removed from the others (no half-replicated unit)."""
    a, b = LocalBlobStore(tmp_path / "a"), LocalBlobStore(tmp_path / "b")
    rep = ReplicatedBlobStore([a, b])
    faults.arm("blob.local.before_rename", "raise")  # exactly one of the two puts fails
    with pytest.raises(FaultInjected):
        rep.put("meta/x", b"1")
    assert not a.exists("meta/x") and not b.exists("meta/x")
