"""The StateStore contract: every backend (SQLite, real Redis) behaves the same.

Each test states the behaviour the control plane relies on; the same test runs on both
stores, so a server on Redis and one on SQLite are interchangeable.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dsec import errors
from dsec.state import SCHEMA_VERSION, AuditRecord, IdempotencyRecord, StateStore, TenantRecord
from dsec.state.keys import episode_key, new_tenant_uid


def _tenant(name: str, h: str, **kw) -> TenantRecord:
    return TenantRecord(name=name, uid=new_tenant_uid(), token_hash=h, created_at=time.time(), **kw)


async def test_tenants_roundtrip_and_token_lookup(store: StateStore) -> None:
    """Tenants are found by name and by token hash; a re-issued token retires the old hash."""
    a = _tenant("alice", "h1", max_sandboxes=3, images=["py*"])
    await store.put_tenant(a)
    await store.put_tenant(_tenant("bob", "h2", admin=True))
    assert (await store.get_tenant("alice")) == a
    assert (await store.tenant_by_token_hash("h2")).name == "bob"
    assert [t.name for t in await store.list_tenants()] == ["alice", "bob"]
    await store.put_tenant(a.model_copy(update={"token_hash": "h3"}))
    assert await store.tenant_by_token_hash("h1") is None
    assert (await store.tenant_by_token_hash("h3")).uid == a.uid
    assert await store.delete_tenant("alice") is True
    assert await store.delete_tenant("alice") is False
    assert await store.get_tenant("alice") is None and await store.tenant_by_token_hash("h3") is None


async def test_put_tenant_assigns_uid_once(store: StateStore) -> None:
    """A record without uid gets one, which the stored body keeps."""
    rec = TenantRecord(name="u", token_hash="hu")
    await store.put_tenant(rec)
    assert rec.uid and (await store.get_tenant("u")).uid == rec.uid


async def test_idempotency_reserve_is_first_writer_wins(store: StateStore) -> None:
    """Concurrent reservations of one request id all see the first writer's sandbox id;
    complete stores the answer; delete lets a retry start afresh."""
    uid = new_tenant_uid()
    recs = await asyncio.gather(*(store.idem_reserve(IdempotencyRecord(
        tenant=uid, request_id="r:1", sandbox_id=f"sb{i}", created_at=time.time())) for i in range(8)))
    assert len({r.sandbox_id for r in recs}) == 1 and not any(r.done for r in recs)
    await store.idem_complete(uid, "r:1", {"id": recs[0].sandbox_id, "x": [1, 2]})
    again = await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id="r:1", sandbox_id="other"))
    assert again.done and again.info == {"id": recs[0].sandbox_id, "x": [1, 2]}
    other_tenant = await store.idem_reserve(IdempotencyRecord(tenant=new_tenant_uid(), request_id="r:1",
                                                              sandbox_id="sbX"))
    assert other_tenant.sandbox_id == "sbX"  # request ids are per tenant
    await store.idem_delete(uid, "r:1")
    fresh = await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id="r:1", sandbox_id="sbN"))
    assert fresh.sandbox_id == "sbN" and not fresh.done


async def test_purge_tenant_removes_request_ids_and_episode_epochs(store: StateStore) -> None:
    """Removing a tenant leaves none of its request ids or episode epochs reachable."""
    uid, other = new_tenant_uid(), new_tenant_uid()
    for rid in ("a", "b"):
        await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id=rid, sandbox_id="s" + rid))
    await store.idem_reserve(IdempotencyRecord(tenant=other, request_id="a", sandbox_id="keep"))
    await store.claim_episode(episode_key(uid, "e1"))
    await store.claim_episode(episode_key(other, "e1"))
    assert await store.purge_tenant(uid) == 3
    assert (await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id="a", sandbox_id="new"))).sandbox_id == "new"
    assert (await store.idem_reserve(IdempotencyRecord(tenant=other, request_id="a", sandbox_id="x"))).sandbox_id == "keep"
    assert await store.episode_epoch(episode_key(uid, "e1")) is None
    assert await store.episode_epoch(episode_key(other, "e1")) == 1


async def test_sandbox_records_owner_node_liveness_and_audit(store: StateStore) -> None:
    """Sandboxes keep owner and node after death (audit stays reachable) until pruned."""
    uid = new_tenant_uid()
    await store.record_sandbox("s1", uid, 1.0, node="n1")
    await store.record_sandbox("s1", "intruder", 2.0, node="n2")  # first record wins
    await store.record_sandbox("s2", uid, 1.0)
    assert await store.sandbox_owner("s1") == uid and await store.sandbox_node("s1") == "n1"
    assert await store.sandbox_node("s2") is None and await store.sandbox_owner("nope") is None
    assert sorted(await store.live_sandbox_ids()) == ["s1", "s2"]
    await store.append_audit([AuditRecord(sandbox_id="s1", tenant=uid, ts=float(i), kind="exec",
                                          data={"i": i}) for i in range(5)])
    got = await store.audit("s1", limit=3)
    assert [r.data["i"] for r in got] == [0, 1, 2] and got[0].kind == "exec"
    await store.mark_dead(["s1", "unknown"], 10.0)
    await store.mark_dead(["s1"], 50.0)  # the first death time stays
    assert await store.live_sandbox_ids() == ["s2"]
    assert await store.sandbox_owner("s1") == uid
    assert await store.prune(dead_before=10.0) == 0  # dead at 10: not before 10
    await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id="old", sandbox_id="x", created_at=5.0))
    assert await store.prune(dead_before=11.0) == 1
    assert await store.sandbox_owner("s1") is None and await store.audit("s1") == []
    assert (await store.idem_reserve(IdempotencyRecord(tenant=uid, request_id="old", sandbox_id="y"))).sandbox_id == "y"


async def test_documents(store: StateStore) -> None:
    """Pools and preemption records: one JSON object per (kind, key), kinds apart."""
    await store.put_doc("pool", "python", {"size": 4, "members": ["a", "b"]})
    await store.put_doc("pool", "busybox", {"size": 1})
    await store.put_doc("preempted", "python", {"x": 1})
    assert await store.get_doc("pool", "python") == {"size": 4, "members": ["a", "b"]}
    assert list(await store.list_docs("pool")) == ["busybox", "python"]
    assert await store.delete_doc("pool", "python") is True and await store.delete_doc("pool", "python") is False
    assert await store.get_doc("pool", "python") is None and await store.get_doc("preempted", "python") == {"x": 1}


async def test_lease_fencing_tokens(store: StateStore) -> None:
    """One holder at a time; a renewal keeps its token; each new holder gets a higher token,
    even after a release, so a deposed holder's token is always stale."""
    a = await store.lease_acquire("leader", "A", ttl_s=5, now=100.0)
    assert a is not None and a.token == 1
    assert await store.lease_acquire("leader", "B", ttl_s=5, now=101.0) is None
    assert (await store.lease_acquire("leader", "A", ttl_s=5, now=102.0)).token == 1
    b = await store.lease_acquire("leader", "B", ttl_s=5, now=107.5)  # A's lease expired at 107
    assert b is not None and b.token == 2 and (await store.lease_get("leader")).holder == "B"
    assert await store.lease_release("leader", "A") is False
    assert await store.lease_release("leader", "B") is True
    c = await store.lease_acquire("leader", "A", ttl_s=5, now=108.0)
    assert c is not None and c.token == 3


async def test_concurrent_lease_acquire_one_winner(store: StateStore) -> None:
    """Racing candidates: exactly one gets the lease."""
    got = await asyncio.gather(*(store.lease_acquire("l", f"h{i}", 10, 1.0) for i in range(10)))
    assert sum(g is not None for g in got) == 1


async def test_episode_claims_are_atomic(store: StateStore) -> None:
    """Concurrent claims of one episode get distinct epochs (no two openers share one), and
    the stored epoch is the largest: exactly one claimer is the current owner."""
    key = episode_key(new_tenant_uid(), "ep")
    epochs = await asyncio.gather(*(store.claim_episode(key) for _ in range(20)))
    assert sorted(epochs) == list(range(1, 21))
    assert await store.episode_epoch(key) == 20
    assert await store.claim_episode(key, floor=41) == 42  # above every unit's writer too


async def test_episode_cas(store: StateStore) -> None:
    """Compare-and-set: only the writer that saw the current epoch moves it."""
    key = episode_key(new_tenant_uid(), "ep")
    assert await store.episode_cas(key, 1, 2) is False
    assert await store.episode_cas(key, None, 1) is True
    assert await store.episode_cas(key, None, 5) is False
    res = await asyncio.gather(*(store.episode_cas(key, 1, 2 + i) for i in range(6)))
    assert res.count(True) == 1
    await store.delete_episode(key)
    assert await store.episode_epoch(key) is None


async def test_schema_version_written_and_mismatch_refused(store: StateStore, tmp_path, request, new_store) -> None:
    """The store records its schema version; a store with another version refuses to open,
    naming both versions and the store."""
    assert await store.schema_version() == SCHEMA_VERSION
    if store.url.startswith("sqlite"):
        store.db._q("UPDATE meta SET value='99' WHERE key='schema_version'")  # type: ignore[attr-defined]
        with pytest.raises(errors.StateSchemaMismatch, match="schema version 99.*speaks version"):
            new_store("sqlite", tmp_path, None)
    else:
        await store._r.set(store._k("schema"), "99")  # type: ignore[attr-defined]
        other = new_store("redis", tmp_path, request.getfixturevalue("redis_srv"), prefix=store.prefix)  # type: ignore[attr-defined]
        with pytest.raises(errors.StateSchemaMismatch, match="schema version 99.*speaks version") as ei:
            await other.open()
        assert store.url in str(ei.value)
        await other.close()
