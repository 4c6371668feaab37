"""SQLite (WAL) state store: the embedded single-machine default.

One connection guarded by a lock: SQLite serialises writers anyway, and a single
connection keeps the page cache warm. ``synchronous=NORMAL`` in WAL mode is durable
across process crashes (only an OS crash can lose the last transactions), which is the
right trade for audit appends at exec rate.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from dsec.state.keys import new_tenant_uid
from dsec.state.store import AuditRecord, IdempotencyRecord, TenantRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
  name TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
  tenant TEXT NOT NULL, request_id TEXT NOT NULL, sandbox_id TEXT NOT NULL,
  done INTEGER NOT NULL DEFAULT 0, info TEXT, created_at REAL NOT NULL,
  PRIMARY KEY (tenant, request_id));
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL, dead_at REAL);
CREATE INDEX IF NOT EXISTS sandboxes_dead ON sandboxes(dead_at);
CREATE TABLE IF NOT EXISTS audit (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT NULL, tenant TEXT NOT NULL,
  ts REAL NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_sandbox ON audit(sandbox_id, seq);
"""


class SqliteStateStore:
    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
            self._migrate_tenant_uids()

    def _migrate_tenant_uids(self) -> None:
        """Give every tenant written before uids existed one, and move the rows it owns
        (idempotency keys, sandbox ownership, hence its audit) from its name to the uid,
        in one transaction. Rows of a name with no tenant record (a tenant deleted before
        this upgrade) stay under the name: no uid ever equals a name, so they are orphaned.
        Episodes and checkpoints in the blob store are moved at the next server start
        (``legacy_keys``; dsec.checkpoints.migrate_keys)."""
        def legacy() -> list[TenantRecord]:
            recs = [TenantRecord.model_validate_json(b) for (b,) in self._db.execute("SELECT body FROM tenants")]
            return [r for r in recs if not r.uid]
        if not legacy():
            return
        self._db.execute("BEGIN IMMEDIATE")  # re-read under the write lock: another process may migrate too
        try:
            for rec in legacy():
                rec.uid, rec.legacy_keys = new_tenant_uid(), True
                self._db.execute("UPDATE tenants SET body=? WHERE name=?", (rec.model_dump_json(), rec.name))
                self._db.execute("UPDATE idempotency SET tenant=? WHERE tenant=?", (rec.uid, rec.name))
                self._db.execute("UPDATE sandboxes SET tenant=? WHERE tenant=?", (rec.uid, rec.name))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # --- tenants -----------------------------------------------------------------
    def put_tenant(self, rec: TenantRecord) -> None:
        if not rec.uid:
            rec.uid = new_tenant_uid()  # assigned once; the stored body keeps it for good
        self._q("INSERT OR REPLACE INTO tenants(name, token_hash, body) VALUES (?,?,?)",
                (rec.name, rec.token_hash, rec.model_dump_json()))

    def get_tenant(self, name: str) -> TenantRecord | None:
        rows = self._q("SELECT body FROM tenants WHERE name=?", (name,))
        return TenantRecord.model_validate_json(rows[0][0]) if rows else None

    def tenant_by_token_hash(self, token_hash: str) -> TenantRecord | None:
        rows = self._q("SELECT body FROM tenants WHERE token_hash=?", (token_hash,))
        return TenantRecord.model_validate_json(rows[0][0]) if rows else None

    def list_tenants(self) -> list[TenantRecord]:
        return [TenantRecord.model_validate_json(r[0]) for r in self._q("SELECT body FROM tenants ORDER BY name")]

    def delete_tenant(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM tenants WHERE name=?", (name,)).rowcount > 0

    def purge_tenant(self, uid: str) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM idempotency WHERE tenant=?", (uid,)).rowcount

    # --- idempotency ---------------------------------------------------------------
    def idem_reserve(self, rec: IdempotencyRecord) -> IdempotencyRecord:
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO idempotency(tenant, request_id, sandbox_id, done, info, created_at)"
                " VALUES (?,?,?,?,?,?)",
                (rec.tenant, rec.request_id, rec.sandbox_id, int(rec.done),
                 json.dumps(rec.info) if rec.info is not None else None, rec.created_at))
            row = self._db.execute(
                "SELECT sandbox_id, done, info, created_at FROM idempotency WHERE tenant=? AND request_id=?",
                (rec.tenant, rec.request_id)).fetchone()
        return IdempotencyRecord(tenant=rec.tenant, request_id=rec.request_id, sandbox_id=row[0],
                                 done=bool(row[1]), info=json.loads(row[2]) if row[2] else None,
                                 created_at=row[3])

    def idem_complete(self, tenant: str, request_id: str, info: dict[str, Any]) -> None:
        self._q("UPDATE idempotency SET done=1, info=? WHERE tenant=? AND request_id=?",
                (json.dumps(info), tenant, request_id))

    def idem_delete(self, tenant: str, request_id: str) -> None:
        self._q("DELETE FROM idempotency WHERE tenant=? AND request_id=?", (tenant, request_id))

    # --- sandboxes -----------------------------------------------------------------
    def record_sandbox(self, sandbox_id: str, tenant: str, created_at: float) -> None:
        self._q("INSERT OR IGNORE INTO sandboxes(id, tenant, created_at) VALUES (?,?,?)",
                (sandbox_id, tenant, created_at))

    def sandbox_owner(self, sandbox_id: str) -> str | None:
        rows = self._q("SELECT tenant FROM sandboxes WHERE id=?", (sandbox_id,))
        return rows[0][0] if rows else None

    def mark_dead(self, sandbox_ids: list[str], ts: float) -> None:
        if not sandbox_ids:
            return
        with self._lock:
            self._db.executemany("UPDATE sandboxes SET dead_at=? WHERE id=? AND dead_at IS NULL",
                                 [(ts, s) for s in sandbox_ids])

    def live_sandbox_ids(self) -> list[str]:
        return [r[0] for r in self._q("SELECT id FROM sandboxes WHERE dead_at IS NULL")]

    # --- audit ---------------------------------------------------------------------
    def append_audit(self, records: list[AuditRecord]) -> None:
        if not records:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT INTO audit(sandbox_id, tenant, ts, kind, data) VALUES (?,?,?,?,?)",
                    [(r.sandbox_id, r.tenant, r.ts, r.kind, json.dumps(r.data)) for r in records])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def audit(self, sandbox_id: str, limit: int = 1000) -> list[AuditRecord]:
        rows = self._q("SELECT sandbox_id, tenant, ts, kind, data FROM audit WHERE sandbox_id=?"
                       " ORDER BY seq LIMIT ?", (sandbox_id, limit))
        return [AuditRecord(sandbox_id=r[0], tenant=r[1], ts=r[2], kind=r[3], data=json.loads(r[4]))
                for r in rows]

    def prune(self, dead_before: float) -> int:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                ids = [r[0] for r in self._db.execute(
                    "SELECT id FROM sandboxes WHERE dead_at IS NOT NULL AND dead_at < ?", (dead_before,))]
                self._db.executemany("DELETE FROM audit WHERE sandbox_id=?", [(i,) for i in ids])
                self._db.executemany("DELETE FROM sandboxes WHERE id=?", [(i,) for i in ids])
                self._db.execute("DELETE FROM idempotency WHERE created_at < ?", (dead_before,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return len(ids)
