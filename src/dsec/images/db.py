"""SQLite metadata of the node-local image store: images, names, per-image layer index,
layer use stats, leases, build cache and access order. SQLite gives us crash-safe,
process-safe updates (WAL) that cost ~0.1 ms, which keeps overlay prepare cheap."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS images (id TEXT PRIMARY KEY, manifest_digest TEXT NOT NULL, info TEXT NOT NULL,
  created_at REAL NOT NULL, last_used REAL, uses INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS names (name TEXT PRIMARY KEY, image_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS image_layers (image_id TEXT NOT NULL, idx INTEGER NOT NULL, digest TEXT NOT NULL,
  diff_id TEXT NOT NULL, size INTEGER NOT NULL, media_type TEXT NOT NULL, PRIMARY KEY (image_id, idx));
CREATE INDEX IF NOT EXISTS image_layers_diff ON image_layers (diff_id);
CREATE TABLE IF NOT EXISTS layer_stats (diff_id TEXT PRIMARY KEY, last_used REAL NOT NULL, uses INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS blob_use (digest TEXT PRIMARY KEY, last_used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (key TEXT NOT NULL, object TEXT NOT NULL, created REAL NOT NULL,
  PRIMARY KEY (key, object));
CREATE INDEX IF NOT EXISTS leases_object ON leases (object);
CREATE TABLE IF NOT EXISTS build_cache (key TEXT PRIMARY KEY, digest TEXT NOT NULL, diff_id TEXT NOT NULL,
  size INTEGER NOT NULL, media_type TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS access_order (image_id TEXT NOT NULL, diff_id TEXT NOT NULL, seq INTEGER NOT NULL,
  first_at REAL NOT NULL, ready_ms REAL NOT NULL, PRIMARY KEY (image_id, diff_id));
"""


class MetaDB:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        self._lock = threading.RLock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: writers across processes queue here)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def q(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple]:  # type: ignore[type-arg]
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- leases ---------------------------------------------------------------------
    def add_lease(self, key: str, objects: list[str]) -> None:
        now = time.time()
        with self.tx() as c:
            c.executemany("INSERT OR IGNORE INTO leases VALUES (?,?,?)", [(key, o, now) for o in objects])

    def drop_lease(self, key: str) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM leases WHERE key=?", (key,))

    def leased_objects(self) -> set[str]:
        return {r[0] for r in self.q("SELECT DISTINCT object FROM leases")}

    def leases(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for key, obj in self.q("SELECT key, object FROM leases ORDER BY key, object"):
            out.setdefault(key, []).append(obj)
        return out
