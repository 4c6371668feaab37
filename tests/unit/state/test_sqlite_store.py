"""SQLite state store (its synchronous core ``SqliteDB``): durable across reopen."""

from __future__ import annotations

from pathlib import Path

from dsec.state import AuditRecord, IdempotencyRecord, TenantRecord
from dsec.state import SqliteDB as SqliteStateStore


def test_tenants_roundtrip_and_token_lookup(tmp_path: Path) -> None:
    """Tenants are found by token hash and survive a reopen (restart)."""
    s = SqliteStateStore(tmp_path / "s.db")
    s.put_tenant(TenantRecord(name="a", token_hash="h1", max_cpu=4, images=["py*"]))
    s.close()
    s = SqliteStateStore(tmp_path / "s.db")
    rec = s.tenant_by_token_hash("h1")
    assert rec is not None and rec.name == "a" and rec.max_cpu == 4 and rec.images == ["py*"]
    assert s.tenant_by_token_hash("h2") is None
    assert s.delete_tenant("a") and not s.delete_tenant("a")
    assert s.list_tenants() == []


def test_idempotency_reserve_returns_first_writer(tmp_path: Path) -> None:
    """A second reservation of the same (tenant, request id) gets the first sandbox id back."""
    s = SqliteStateStore(tmp_path / "s.db")
    first = s.idem_reserve(IdempotencyRecord(tenant="a", request_id="r", sandbox_id="sb-1", created_at=1))
    again = s.idem_reserve(IdempotencyRecord(tenant="a", request_id="r", sandbox_id="sb-2", created_at=2))
    other = s.idem_reserve(IdempotencyRecord(tenant="b", request_id="r", sandbox_id="sb-3", created_at=2))
    assert first.sandbox_id == again.sandbox_id == "sb-1" and not again.done
    assert other.sandbox_id == "sb-3"
    s.idem_complete("a", "r", {"id": "sb-1"})
    done = s.idem_reserve(IdempotencyRecord(tenant="a", request_id="r", sandbox_id="x", created_at=3))
    assert done.done and done.info == {"id": "sb-1"}


def test_audit_kept_until_retention_then_pruned(tmp_path: Path) -> None:
    """Audit of a dead sandbox stays until it has been dead past the cutoff, live ones are never pruned."""
    s = SqliteStateStore(tmp_path / "s.db")
    s.record_sandbox("sb-1", "a", 10)
    s.record_sandbox("sb-2", "a", 10)
    s.append_audit([AuditRecord(sandbox_id=sid, tenant="a", ts=11, kind="exec", data={"argv": ["ls"]})
                    for sid in ("sb-1", "sb-2")])
    s.mark_dead(["sb-1"], 20)
    assert s.live_sandbox_ids() == ["sb-2"]
    assert s.prune(dead_before=15) == 0 and len(s.audit("sb-1")) == 1
    assert s.prune(dead_before=25) == 1
    assert s.audit("sb-1") == [] and s.sandbox_owner("sb-1") is None
    assert s.audit("sb-2")[0].data == {"argv": ["ls"]} and s.sandbox_owner("sb-2") == "a"
