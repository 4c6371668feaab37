"""Embedded state: tenants, idempotency keys, sandbox ownership and audit records.

``StateStore`` is the protocol; ``SqliteStateStore`` (WAL) is the embedded default and
``MemoryStateStore``-style tests simply use SQLite on ``:memory:``.
"""

from dsec.state.sqlite import SqliteStateStore
from dsec.state.store import AuditRecord, IdempotencyRecord, StateStore, TenantRecord

__all__ = ["AuditRecord", "IdempotencyRecord", "SqliteStateStore", "StateStore", "TenantRecord"]
