"""Usage rows in SQLite, in the state store's database file (``HOME/state.db``), so
accounting outlives the sandboxes and the server. Own connection and lock: usage
flushes never wait behind audit appends."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsec.models.usage import LabelQuota, SandboxUsage, UsageGroup, UsageTotals

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
  sandbox_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, tenant_name TEXT NOT NULL, labels TEXT NOT NULL,
  started_at REAL NOT NULL, ended_at REAL, cpu_seconds REAL NOT NULL, memory_gb_seconds REAL NOT NULL,
  exec_count INTEGER NOT NULL, bytes_written INTEGER NOT NULL, sandbox_seconds REAL NOT NULL);
CREATE INDEX IF NOT EXISTS usage_tenant ON usage(tenant, started_at);
CREATE INDEX IF NOT EXISTS usage_ended ON usage(ended_at);
CREATE TABLE IF NOT EXISTS usage_labels (
  tenant TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, sandbox_id TEXT NOT NULL,
  PRIMARY KEY (tenant, key, value, sandbox_id));
CREATE INDEX IF NOT EXISTS usage_labels_sb ON usage_labels(sandbox_id);
CREATE TABLE IF NOT EXISTS usage_quotas (
  tenant TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, max_sandboxes INTEGER, max_cpu_seconds REAL,
  PRIMARY KEY (tenant, key, value));
"""

_SUMS = ("COUNT(*), COALESCE(SUM(u.cpu_seconds),0), COALESCE(SUM(u.memory_gb_seconds),0), "
         "COALESCE(SUM(u.exec_count),0), COALESCE(SUM(u.bytes_written),0), COALESCE(SUM(u.sandbox_seconds),0)")
_COLS = ("u.sandbox_id, u.labels, u.started_at, u.ended_at, u.cpu_seconds, u.memory_gb_seconds, u.exec_count, "
         "u.bytes_written, u.sandbox_seconds")


def _totals(row: tuple[Any, ...]) -> UsageTotals:
    return UsageTotals(sandboxes=row[0], cpu_seconds=row[1], memory_gb_seconds=row[2], exec_count=row[3],
                       bytes_written=row[4], sandbox_seconds=row[5])


def _where(tenant: str, labels: dict[str, str]) -> tuple[str, list[Any]]:
    """Rows of ``tenant`` carrying every label of the filter (an unknown label: none)."""
    sql, args = "u.tenant=?", [tenant]
    for k, v in sorted(labels.items()):
        sql += (" AND EXISTS (SELECT 1 FROM usage_labels l WHERE l.tenant=u.tenant AND l.key=? AND l.value=?"
                " AND l.sandbox_id=u.sandbox_id)")
        args += [k, v]
    return sql, args


class UsageStore:
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

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, args: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # --- writes ------------------------------------------------------------------------
    def upsert(self, rows: list[tuple[str, str, SandboxUsage]]) -> None:
        """(tenant uid, tenant name, usage) rows; labels are written once per sandbox."""
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for uid, name, u in rows:
                    self._db.execute(
                        "INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(sandbox_id) DO UPDATE SET "
                        "ended_at=excluded.ended_at, cpu_seconds=excluded.cpu_seconds, "
                        "memory_gb_seconds=excluded.memory_gb_seconds, exec_count=excluded.exec_count, "
                        "bytes_written=excluded.bytes_written, sandbox_seconds=excluded.sandbox_seconds",
                        (u.sandbox_id, uid, name, json.dumps(u.labels), u.started_at, u.ended_at, u.cpu_seconds,
                         u.memory_gb_seconds, u.exec_count, u.bytes_written, u.sandbox_seconds))
                    self._db.executemany("INSERT OR IGNORE INTO usage_labels VALUES (?,?,?,?)",
                                         [(uid, k, v, u.sandbox_id) for k, v in u.labels.items()])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def prune(self, ended_before: float) -> int:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                ids = [(r[0],) for r in self._db.execute(
                    "SELECT sandbox_id FROM usage WHERE ended_at IS NOT NULL AND ended_at < ?", (ended_before,))]
                self._db.executemany("DELETE FROM usage_labels WHERE sandbox_id=?", ids)
                self._db.executemany("DELETE FROM usage WHERE sandbox_id=?", ids)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return len(ids)

    def open_sandboxes(self) -> list[str]:
        """Sandboxes with no end recorded (the server stopped while they lived)."""
        return [r[0] for r in self._q("SELECT sandbox_id FROM usage WHERE ended_at IS NULL")]

    def close_sandboxes(self, ids: list[str], ended_at: float) -> None:
        with self._lock:
            self._db.executemany("UPDATE usage SET ended_at=? WHERE sandbox_id=? AND ended_at IS NULL",
                                 [(ended_at, i) for i in ids])

    # --- reads -------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> tuple[str, SandboxUsage] | None:
        rows = self._q(f"SELECT u.tenant, {_COLS} FROM usage u WHERE u.sandbox_id=?", (sandbox_id,))
        return (rows[0][0], _row(rows[0][1:])) if rows else None

    def totals(self, tenant: str, labels: dict[str, str]) -> UsageTotals:
        where, args = _where(tenant, labels)
        return _totals(self._q(f"SELECT {_SUMS} FROM usage u WHERE {where}", args)[0])

    def groups(self, tenant: str, labels: dict[str, str], key: str) -> list[UsageGroup]:
        """Totals per value of label ``key`` ('' for matching sandboxes without it)."""
        where, args = _where(tenant, labels)
        rows = self._q(f"SELECT COALESCE(g.value, ''), {_SUMS} FROM usage u LEFT JOIN usage_labels g "
                       f"ON g.tenant=u.tenant AND g.sandbox_id=u.sandbox_id AND g.key=? WHERE {where} "
                       "GROUP BY COALESCE(g.value, '') ORDER BY 1", [key, *args])
        return [UsageGroup(value=r[0], totals=_totals(r[1:])) for r in rows]

    def sandboxes(self, tenant: str, labels: dict[str, str], limit: int) -> list[SandboxUsage]:
        where, args = _where(tenant, labels)
        rows = self._q(f"SELECT {_COLS} FROM usage u WHERE {where} ORDER BY u.started_at DESC LIMIT ?",
                       [*args, limit])
        return [_row(r) for r in rows]

    def cpu_seconds(self, tenant: str, key: str, value: str) -> float:
        return float(self.totals(tenant, {key: value}).cpu_seconds)

    # --- quotas ------------------------------------------------------------------------
    def put_quota(self, tenant: str, q: LabelQuota) -> None:
        k, v = q.key_value
        self._q("INSERT OR REPLACE INTO usage_quotas VALUES (?,?,?,?,?)",
                (tenant, k, v, q.max_sandboxes, q.max_cpu_seconds))

    def delete_quota(self, tenant: str, key: str, value: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM usage_quotas WHERE tenant=? AND key=? AND value=?",
                                    (tenant, key, value)).rowcount > 0

    def quotas(self) -> dict[tuple[str, str, str], LabelQuota]:
        return {(r[0], r[1], r[2]): LabelQuota(label=f"{r[1]}={r[2]}", max_sandboxes=r[3], max_cpu_seconds=r[4])
                for r in self._q("SELECT tenant, key, value, max_sandboxes, max_cpu_seconds FROM usage_quotas")}


def _row(r: tuple[Any, ...]) -> SandboxUsage:
    return SandboxUsage(sandbox_id=r[0], labels=json.loads(r[1]), started_at=r[2], ended_at=r[3], sandboxes=1,
                        cpu_seconds=r[4], memory_gb_seconds=r[5], exec_count=r[6], bytes_written=r[7],
                        sandbox_seconds=r[8])
