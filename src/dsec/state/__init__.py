"""Shared state: tenants, idempotency keys, sandbox records, audit, leases, pools,
preemption records and episode epochs.

``StateStore`` is the async protocol; ``SqliteStateStore`` (WAL) is the embedded default
and ``RedisStateStore`` the shared one (several API servers on one Redis). ``state_for``
picks one from a URL (``--state`` / ``DSEC_STATE_URL``); tests use SQLite on ``:memory:``.
"""

from __future__ import annotations

from pathlib import Path

from dsec import errors
from dsec.state.sqlite import SqliteDB, SqliteStateStore
from dsec.state.store import SCHEMA_VERSION, AuditRecord, IdempotencyRecord, Lease, StateStore, TenantRecord


def state_for(url: str, home: Path, retry_after: float = 1.0, timeout_s: float = 2.0) -> StateStore:
    """The store named by ``url``: ``redis://HOST:PORT/DB`` (also ``rediss://``, ``unix://``),
    ``sqlite:///PATH``, or empty for ``HOME/state.db``. Call ``await store.open()`` next."""
    if not url:
        return SqliteStateStore(home / "state.db")
    if url.startswith(("redis://", "rediss://", "unix://")):
        from dsec.state.redis_store import RedisStateStore
        return RedisStateStore(url, retry_after=retry_after, timeout_s=timeout_s)
    if url.startswith("sqlite://"):
        return SqliteStateStore(url.removeprefix("sqlite://"))  # sqlite:///abs/path -> /abs/path
    raise errors.InvalidArgument(f"unsupported state store URL {url!r}: use redis://HOST:PORT/DB or "
                                 "sqlite:///PATH (empty: DSEC_HOME/state.db)", field="state_url")


__all__ = ["SCHEMA_VERSION", "AuditRecord", "IdempotencyRecord", "Lease", "SqliteDB", "SqliteStateStore",
           "StateStore", "TenantRecord", "state_for"]
