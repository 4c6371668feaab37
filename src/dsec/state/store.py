"""State records and the ``StateStore`` protocol (what the API/control plane persist).

Records are small pydantic models; backends store them however suits them. Methods are
synchronous and fast (a local SQLite call is ~10-50 µs); async callers batch (audit) or
push to a thread where it matters.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field


class TenantRecord(BaseModel):
    name: str
    uid: str = Field("", description="Immutable internal id (dsec.state.keys.new_tenant_uid), assigned at "
                     "creation; every tenant-scoped datum is keyed by it, so a tenant re-created under the "
                     "same name starts empty. Empty only in a record written before uids existed "
                     "(SqliteStateStore assigns one when it opens the store)")
    legacy_keys: bool = Field(False, description="Given its uid by the upgrade migration: its episodes and "
                              "checkpoints may still be under its name in the blob store until the next "
                              "server start moves them (dsec.checkpoints.migrate_keys)")
    token_hash: str = Field(..., description="sha256 hex of the token; the token itself is never stored")
    admin: bool = False
    max_sandboxes: int | None = Field(None, description="Max concurrent sandboxes (None = node limit)")
    max_cpu: float | None = Field(None, description="Max total CPUs over live sandboxes")
    max_memory: int | None = Field(None, description="Max total memory bytes over live sandboxes")
    images: list[str] | None = Field(None, description="Image name globs this tenant may use (None = all)")
    created_at: float = 0.0


class IdempotencyRecord(BaseModel):
    tenant: str = Field(..., description="The tenant's uid (not its name)")
    request_id: str
    sandbox_id: str
    done: bool = False
    info: dict[str, Any] | None = Field(None, description="SandboxInfo as created (returned on replay)")
    created_at: float = 0.0


class AuditRecord(BaseModel):
    sandbox_id: str
    tenant: str
    ts: float
    kind: str = Field(..., description="create | exec | process | file_write | file_remove | upload | kill | ...")
    data: dict[str, Any] = Field(default_factory=dict)


@runtime_checkable
class StateStore(Protocol):
    def close(self) -> None: ...

    # tenants
    def put_tenant(self, rec: TenantRecord) -> None: ...
    def get_tenant(self, name: str) -> TenantRecord | None: ...
    def tenant_by_token_hash(self, token_hash: str) -> TenantRecord | None: ...
    def list_tenants(self) -> list[TenantRecord]: ...
    def delete_tenant(self, name: str) -> bool: ...
    def purge_tenant(self, uid: str) -> int:
        """Delete what the tenant ``uid`` left in the store that a request could reach
        (idempotency keys); its sandboxes' audit stays orphaned (owned by a uid no tenant
        has) until the retention prune. Returns the rows deleted."""

    # idempotent create
    def idem_reserve(self, rec: IdempotencyRecord) -> IdempotencyRecord:
        """Insert ``rec`` unless (tenant, request_id) exists; return the stored record."""

    def idem_complete(self, tenant: str, request_id: str, info: dict[str, Any]) -> None: ...
    def idem_delete(self, tenant: str, request_id: str) -> None: ...

    # sandbox ownership (kept after death so audit stays reachable); the owner is the tenant's uid
    def record_sandbox(self, sandbox_id: str, tenant: str, created_at: float) -> None: ...
    def sandbox_owner(self, sandbox_id: str) -> str | None: ...
    def mark_dead(self, sandbox_ids: list[str], ts: float) -> None: ...
    def live_sandbox_ids(self) -> list[str]: ...

    # audit
    def append_audit(self, records: list[AuditRecord]) -> None: ...
    def audit(self, sandbox_id: str, limit: int = 1000) -> list[AuditRecord]: ...

    def prune(self, dead_before: float) -> int:
        """Drop sandboxes (with their audit) dead before ``dead_before`` and old idempotency keys."""
