"""State records and the async ``StateStore`` protocol (what must outlive a server process).

Records are small pydantic models; backends store them however suits them. Every method
is a coroutine and no backend blocks the event loop: SQLite runs on one worker thread of
its own, Redis speaks ``redis.asyncio``. Two servers on one Redis share everything here
(tenants, request ids, sandbox records, leases, pools, preemption records, episode
epochs), so any of them can answer any request.

Writes that decide ownership are conditional (compare-and-set), never read-then-write:
``claim_episode`` / ``episode_cas`` / ``lease_acquire`` are atomic in both backends (a
Lua script in Redis, one ``BEGIN IMMEDIATE`` transaction in SQLite).

A backend that cannot be reached raises ``dsec.errors.StateUnavailable`` (503 + Retry-After);
one whose schema version differs from ``SCHEMA_VERSION`` refuses to open
(``StateSchemaMismatch``), naming both versions.
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


# Bump when a record's layout changes incompatibly; a server refuses a store written by
# another version (mixing them would corrupt it). 1 = the pre-Redis SQLite layout.
SCHEMA_VERSION = 2


class Lease(BaseModel):
    """A named lease (scheduler leader, pool owner...): ``token`` grows by one at every new
    holder, so a deposed holder's fencing token is always below the current one."""

    name: str
    holder: str
    token: int = Field(..., ge=1, description="Fencing token: monotonic per lease name")
    expires_at: float


@runtime_checkable
class StateStore(Protocol):
    """Everything the control plane must keep across a crash. Tenant-scoped keys take the
    tenant's uid (``dsec.state.keys``), never its name."""

    url: str  # where it lives (shown in errors; a redis URL never carries its password here)

    async def open(self) -> None:
        """Connect, create the schema or check its version (``StateSchemaMismatch``)."""

    async def close(self) -> None: ...
    async def schema_version(self) -> int | None: ...

    # tenants
    async def put_tenant(self, rec: TenantRecord) -> None: ...
    async def get_tenant(self, name: str) -> TenantRecord | None: ...
    async def tenant_by_token_hash(self, token_hash: str) -> TenantRecord | None: ...
    async def list_tenants(self) -> list[TenantRecord]: ...
    async def delete_tenant(self, name: str) -> bool: ...
    async def purge_tenant(self, uid: str) -> int:
        """Delete what the tenant ``uid`` left in the store that a request could reach
        (idempotency keys); its sandboxes' audit stays orphaned (owned by a uid no tenant
        has) until the retention prune. Returns the records deleted."""

    # idempotent create
    async def idem_reserve(self, rec: IdempotencyRecord) -> IdempotencyRecord:
        """Insert ``rec`` unless (tenant, request_id) exists (atomically); return the stored record."""

    async def idem_complete(self, tenant: str, request_id: str, info: dict[str, Any]) -> None: ...
    async def idem_delete(self, tenant: str, request_id: str) -> None: ...

    # sandboxes (kept after death so audit stays reachable); the owner is the tenant's uid
    async def record_sandbox(self, sandbox_id: str, tenant: str, created_at: float, node: str = "") -> None: ...
    async def sandbox_owner(self, sandbox_id: str) -> str | None: ...
    async def sandbox_node(self, sandbox_id: str) -> str | None: ...
    async def mark_dead(self, sandbox_ids: list[str], ts: float) -> None: ...
    async def live_sandbox_ids(self) -> list[str]: ...

    # audit
    async def append_audit(self, records: list[AuditRecord]) -> None: ...
    async def audit(self, sandbox_id: str, limit: int = 1000) -> list[AuditRecord]: ...

    async def prune(self, dead_before: float) -> int:
        """Drop sandboxes (with their audit) dead before ``dead_before`` and old idempotency keys."""

    # documents: pools, preemption records, ... (one JSON object per (kind, key))
    async def put_doc(self, kind: str, key: str, body: dict[str, Any]) -> None: ...
    async def get_doc(self, kind: str, key: str) -> dict[str, Any] | None: ...
    async def delete_doc(self, kind: str, key: str) -> bool: ...
    async def list_docs(self, kind: str) -> dict[str, dict[str, Any]]: ...

    # leases (leader election, ...): conditional, fenced
    async def lease_acquire(self, name: str, holder: str, ttl_s: float, now: float) -> Lease | None:
        """Take or renew ``name`` for ``holder`` unless another holder's lease is unexpired.
        A new holder gets token = previous token + 1; a renewal keeps its token."""

    async def lease_takeover(self, name: str, holder: str, from_holder: str, ttl_s: float,
                             now: float, min_token: int = 0) -> Lease | None:
        """Take ``name`` from ``from_holder`` now, expired or not (its process is known to be
        gone: its port refuses connections); the token grows, to at least ``min_token``
        (a holder taking it from itself lifts its token above a fence some node already
        saw, e.g. after the store was wiped). None if the lease is no longer ``from_holder``'s."""

    async def lease_get(self, name: str) -> Lease | None: ...
    async def lease_release(self, name: str, holder: str) -> bool: ...

    # episode ownership: the epoch is the fencing token of an episode's owner
    async def episode_epoch(self, episode_key: str) -> int | None: ...
    async def claim_episode(self, episode_key: str, floor: int = 0) -> int:
        """Atomically become the episode's newest owner: epoch = 1 + max(stored, floor)."""

    async def episode_cas(self, episode_key: str, expect: int | None, new: int) -> bool:
        """Set the epoch to ``new`` only if it is still ``expect`` (None = no owner yet)."""

    async def delete_episode(self, episode_key: str) -> None: ...
