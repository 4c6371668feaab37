"""The node's durable record of every sandbox it may have created (SQLite, WAL).

A row is written in state ``creating`` before any resource exists; every resource path
is derived from the sandbox id (``SandboxPaths``), so the reconciler can find and clean
whatever a crash left behind from the row alone.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from pydantic import BaseModel

from dsec.models import SandboxInfo, SandboxSpec, SandboxState


class SandboxRecord(BaseModel):
    info: SandboxInfo
    spec: SandboxSpec
    env: dict[str, str]
    workdir: str
    cgroup_parent: str = "dsec"


class RecordStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, state TEXT NOT NULL,"
            " body TEXT NOT NULL, updated REAL NOT NULL)")
        self._lock = threading.Lock()

    _UPSERT = ("INSERT INTO sandboxes (id, state, body, updated) VALUES (?, ?, ?, ?)"
               " ON CONFLICT(id) DO UPDATE SET state=excluded.state, body=excluded.body,"
               " updated=excluded.updated")

    def put(self, rec: SandboxRecord) -> None:
        with self._lock:
            self._db.execute(self._UPSERT, (rec.info.id, rec.info.state.value, rec.model_dump_json(), time.time()))

    def put_many(self, recs: list[SandboxRecord]) -> None:
        """Several records in one transaction (one commit: a recycle writes two ids at once)."""
        now = time.time()
        rows = [(r.info.id, r.info.state.value, r.model_dump_json(), now) for r in recs]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(self._UPSERT, rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
        return SandboxRecord.model_validate_json(row[0]) if row else None

    def all(self) -> list[SandboxRecord]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM sandboxes").fetchall()
        return [SandboxRecord.model_validate_json(r[0]) for r in rows]

    def delete(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def purge_retired(self, older_than: float) -> int:
        with self._lock:
            cur = self._db.execute("DELETE FROM sandboxes WHERE state IN (?, ?) AND updated < ?",
                                   (SandboxState.stopped.value, SandboxState.destroyed.value, older_than))
            return cur.rowcount

    def close(self) -> None:
        with self._lock:
            self._db.close()
