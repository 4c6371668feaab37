"""Upgrade path of issue 18 #7: blob-store data written under tenant names moves to the
tenant's uid keys, except keys that cannot be attributed to exactly one tenant."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from dsec.blobs.local import LocalBlobStore
from dsec.checkpoints.migrate_keys import legacy_target, migrate_legacy_keys
from dsec.checkpoints.unit import Compat, UnitMeta, commit_unit, complete_units, list_unit_keys
from dsec.state import SqliteDB
from dsec.state.keys import episode_key, sandbox_checkpoint_episode

HEX = "0123456789abcdef01234567"
UID = "T" + "a" * 24


def test_legacy_target_attributes_only_unambiguous_keys() -> None:
    assert legacy_target("alice--run1", "alice", UID) == episode_key(UID, "run1")
    assert legacy_target(f"sbckpt.alice.{HEX}", "alice", UID) == sandbox_checkpoint_episode(UID, HEX)
    assert legacy_target("a---b", "a-", UID) == episode_key(UID, "b")
    # The issue-18 collision: tenant epi's "x--e1" or tenant epi--x's "e1"? Neither moves.
    assert legacy_target("epi--x--e1", "epi", UID) is None
    assert legacy_target("epi--x--e1", "epi--x", UID) is None
    assert legacy_target("a---b", "a", UID) is None  # id "-b" is not an id
    assert legacy_target("alicex--run1", "alice", UID) is None
    assert legacy_target(f"sbckpt.alicex.{HEX}", "alice", UID) is None


def _unit(store: LocalBlobStore, episode: str, meta: dict | None = None) -> None:
    compat = Compat(image="busybox")
    commit_unit(store, UnitMeta(episode_id=episode, seq=0, kind="open", steps=0, compat=compat,
                                compat_hash=compat.hash(), meta=meta or {}))


def test_pre_uid_store_moves_to_uid_keys(tmp_path: Path) -> None:
    """After the state DB gives pre-uid tenants their uids, the next start moves their
    episodes (units, owner record, journal) and checkpoints (units, restored sandboxes'
    base records) to uid keys; an ambiguous legacy key stays put; a second run is a no-op."""
    db_path = tmp_path / "state.db"
    SqliteDB(db_path).close()
    db = sqlite3.connect(db_path)
    for i, name in enumerate(["alice", "epi", "epi--x"]):
        body = json.dumps({"name": name, "token_hash": f"h{i}", "created_at": 1.0})
        db.execute("INSERT INTO tenants(name, token_hash, body) VALUES (?,?,?)", (name, f"h{i}", body))
    db.commit()
    db.close()
    store = LocalBlobStore(tmp_path / "checkpoints")
    _unit(store, "alice--run1")
    store.put("episodes/alice--run1/owner", b'{"epoch": 3}')
    _unit(store, f"sbckpt.alice.{HEX}", {"checkpoint_id": f"ck-{HEX}", "sandbox_id": "sb-1", "tenant": "alice"})
    store.put("sandbox-checkpoints/bases/sb-9", json.dumps({"tenant": "alice", "checkpoint_id": f"ck-{HEX}"}).encode())
    _unit(store, "epi--x--e1")
    journals = tmp_path / "journals"
    journals.mkdir()
    (journals / "alice--run1.jsonl.zst").write_bytes(b"j")

    state = SqliteDB(db_path)
    alice = state.get_tenant("alice")
    assert alice is not None and alice.legacy_keys
    assert migrate_legacy_keys(state, store, journals) == 2

    ep = episode_key(alice.uid, "run1")
    assert [m.episode_id for m in complete_units(store, ep)] == [ep]
    assert store.get(f"episodes/{ep}/owner") == b'{"epoch": 3}'
    assert list_unit_keys(store, "alice--run1") == [] and not store.list("episodes/alice--run1/")
    ck = complete_units(store, sandbox_checkpoint_episode(alice.uid, HEX))
    assert len(ck) == 1 and ck[0].meta["tenant"] == alice.uid
    assert json.loads(store.get("sandbox-checkpoints/bases/sb-9"))["tenant"] == alice.uid
    assert (journals / f"{ep}.jsonl.zst").read_bytes() == b"j"
    assert list_unit_keys(store, "epi--x--e1")  # not attributable: left where it was
    assert not any(t.legacy_keys for t in state.list_tenants())
    assert migrate_legacy_keys(state, store, journals) == 0
