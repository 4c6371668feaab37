"""Tenant-scoped keys (issue 18 #1/#7): unambiguous composite keys, immutable tenant uids,
and the migration of stores written before uids existed."""

from __future__ import annotations

import itertools
import json
import sqlite3
from pathlib import Path

import pytest

from dsec import errors
from dsec.api.auth import TenantAuth
from dsec.state import IdempotencyRecord, SqliteDB, SqliteStateStore
from dsec.state.keys import (
    TENANT_UID_RE,
    episode_key,
    episode_key_prefix,
    new_tenant_uid,
    sandbox_checkpoint_episode,
    sandbox_checkpoint_prefix,
    split_episode_key,
)


def test_episode_keys_are_injective() -> None:
    """No two (tenant, episode id) pairs share a key, whatever separators the ids contain
    (the old ``<name>--<id>`` made (epi, x--e1) and (epi--x, e1) the same key); and a key
    splits back into exactly its parts."""
    uids = [new_tenant_uid() for _ in range(3)]
    ids = ["e1", "x--e1", "x--", "a-b", "a--b--c", "T0", "e.1", "x-" * 40 + "z"]
    keys = {}
    for uid, ep in itertools.product(uids, ids):
        k = episode_key(uid, ep)
        assert k not in keys, (k, keys.get(k), (uid, ep))
        keys[k] = (uid, ep)
        assert split_episode_key(k) == (uid, ep)
        assert k.startswith(episode_key_prefix(uid))
        assert not any(k.startswith(episode_key_prefix(o)) for o in uids if o != uid)


def test_episode_key_refuses_bad_parts() -> None:
    """A name is not a uid, and an id that is not one path segment is refused (422)."""
    uid = new_tenant_uid()
    for bad_uid in ("epi", "epi--x", "T" + "0" * 23, "t" + "0" * 24, ""):
        with pytest.raises(errors.InvalidArgument):
            episode_key(bad_uid, "e1")
    for bad_id in ("", "../x", "a/b", "-x", "x" * 97, ".hidden"):
        with pytest.raises(errors.InvalidArgument):
            episode_key(uid, bad_id)
    with pytest.raises(ValueError):
        split_episode_key("epi--x--e1")  # a legacy name-keyed episode is not a tenant key


def test_sandbox_checkpoint_keys_do_not_nest() -> None:
    """Tenant ``a``'s checkpoint prefix never matches tenant ``ab``'s (or a uid's) keys."""
    a, ab = sandbox_checkpoint_episode("a", "0" * 24), sandbox_checkpoint_episode("ab", "0" * 24)
    assert ("episodes/" + ab).startswith(sandbox_checkpoint_prefix("ab"))
    assert not ("episodes/" + ab).startswith(sandbox_checkpoint_prefix("a"))
    assert ("episodes/" + a).startswith(sandbox_checkpoint_prefix("a"))
    for bad in ("a.b", "a/b", ""):
        with pytest.raises(errors.InvalidArgument):
            sandbox_checkpoint_episode(bad, "0" * 24)


def test_uids_never_equal_a_tenant_name() -> None:
    """A uid has an uppercase letter no tenant name may have: legacy name-owned rows can
    never be mistaken for a uid's."""
    import re

    from dsec.models.api import TENANT_NAME_PATTERN
    for _ in range(50):
        uid = new_tenant_uid()
        assert TENANT_UID_RE.match(uid) and not re.match(TENANT_NAME_PATTERN, uid)


async def test_recreated_tenant_gets_a_new_uid(tmp_path: Path) -> None:
    """Creating a tenant again under a removed one's name gives a different uid; the uid is
    stable across reopen; re-issuing a token for the SAME tenant keeps it."""
    state = SqliteStateStore(tmp_path / "s.db")
    auth = TenantAuth(state)
    first, _ = await auth.create_tenant("bob")
    await state.delete_tenant("bob")
    second, _ = await auth.create_tenant("bob")
    assert first.uid != second.uid and TENANT_UID_RE.match(second.uid)
    await state.close()
    state = SqliteStateStore(tmp_path / "s.db")
    assert (await state.get_tenant("bob")).uid == second.uid  # type: ignore[union-attr]
    again, _ = await TenantAuth(state).create_tenant("bob2", uid=second.uid)
    assert again.uid == second.uid


def test_purge_tenant_drops_its_idempotency_keys(tmp_path: Path) -> None:
    """Purging a uid deletes its request ids only; another tenant's stay."""
    s = SqliteDB(tmp_path / "s.db")
    u1, u2 = new_tenant_uid(), new_tenant_uid()
    s.idem_reserve(IdempotencyRecord(tenant=u1, request_id="r", sandbox_id="sb-1", created_at=1))
    s.idem_reserve(IdempotencyRecord(tenant=u2, request_id="r", sandbox_id="sb-2", created_at=1))
    assert s.purge_tenant(u1) == 1
    assert s.idem_reserve(IdempotencyRecord(tenant=u1, request_id="r", sandbox_id="sb-3", created_at=2)
                          ).sandbox_id == "sb-3"
    assert s.idem_reserve(IdempotencyRecord(tenant=u2, request_id="r", sandbox_id="x", created_at=2)
                          ).sandbox_id == "sb-2"


def test_legacy_store_is_migrated_to_uids(tmp_path: Path) -> None:
    """A state DB written before uids existed: on open, every tenant gets a uid and its
    idempotency keys and sandbox ownership (hence its audit logs) move to it; rows of a
    tenant removed before the upgrade stay under its name, reachable by nobody."""
    path = tmp_path / "s.db"
    SqliteDB(path).close()  # schema
    db = sqlite3.connect(path)
    body = json.dumps({"name": "alice", "token_hash": "h1", "admin": False, "created_at": 1.0})
    db.execute("INSERT INTO tenants(name, token_hash, body) VALUES ('alice', 'h1', ?)", (body,))
    db.execute("INSERT INTO idempotency VALUES ('alice', 'r1', 'sb-a', 1, '{\"id\": \"sb-a\"}', 1.0)")
    db.execute("INSERT INTO sandboxes(id, tenant, created_at, dead_at) VALUES ('sb-a', 'alice', 1.0, NULL)")
    db.execute("INSERT INTO sandboxes(id, tenant, created_at, dead_at) VALUES ('sb-gone', 'carol', 1.0, 2.0)")  # carol removed earlier
    db.commit()
    db.close()
    s = SqliteDB(path)
    alice = s.get_tenant("alice")
    assert alice is not None and TENANT_UID_RE.match(alice.uid)
    assert s.sandbox_owner("sb-a") == alice.uid
    assert s.idem_reserve(IdempotencyRecord(tenant=alice.uid, request_id="r1", sandbox_id="x", created_at=2)
                          ).sandbox_id == "sb-a"
    assert s.sandbox_owner("sb-gone") == "carol"  # orphaned: no uid equals a name
    s.close()
    assert SqliteDB(path).get_tenant("alice").uid == alice.uid  # type: ignore[union-attr]
