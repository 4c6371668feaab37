"""SQLite (WAL) state store: the embedded single-machine default.

``SqliteDB`` is the synchronous core (also used by offline tools with no event loop);
``SqliteStateStore`` is the async ``StateStore`` over it: every call runs on ONE worker
thread of its own, so the event loop never waits on SQLite (a busy_timeout wait behind
another process's write can last seconds) and calls stay in submission order.

One connection guarded by a lock: SQLite serialises writers anyway, and a single
connection keeps the page cache warm. ``synchronous=NORMAL`` in WAL mode is durable
across process crashes (only an OS crash can lose the last transactions), which is the
right trade for audit appends at exec rate.

Conditional writes (episode epochs, leases) run in one ``BEGIN IMMEDIATE`` transaction:
it takes the write lock before reading, so two processes on one file cannot both read
the old value.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from dsec import errors
from dsec.state.keys import new_tenant_uid
from dsec.state.store import SCHEMA_VERSION, AuditRecord, IdempotencyRecord, Lease, TenantRecord

T = TypeVar("T")

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
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS docs (kind TEXT NOT NULL, key TEXT NOT NULL, body TEXT NOT NULL,
  PRIMARY KEY (kind, key));
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, token INTEGER NOT NULL,
  expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (key TEXT PRIMARY KEY, epoch INTEGER NOT NULL);
"""


def schema_mismatch(url: str, found: int) -> errors.StateSchemaMismatch:
    return errors.StateSchemaMismatch(
        f"state store {url} has schema version {found}, this server speaks version {SCHEMA_VERSION}: "
        "run a server of the matching version, or point --state / DSEC_STATE_URL at another store",
        url=url, found=found, expected=SCHEMA_VERSION)


class SqliteDB:
    """The synchronous SQLite state (see the module docstring)."""

    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.url = f"sqlite:///{path}"
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            found = self._stored_version()
            if found is not None and found != SCHEMA_VERSION:
                self._db.close()
                raise schema_mismatch(self.url, found)
            self._db.executescript(_SCHEMA)
            cols = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
            if "node" not in cols:  # schema 1 -> 2: sandboxes remember their node
                self._db.execute("ALTER TABLE sandboxes ADD COLUMN node TEXT")
            self._db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))
            self._migrate_tenant_uids()

    def _stored_version(self) -> int | None:
        """None: a new file or a schema-1 file (no meta table; upgraded in place)."""
        if not self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone():
            return None
        row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else None

    def schema_version(self) -> int | None:
        with self._lock:
            return self._stored_version()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that holds the write lock from its first read."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

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
            n = self._db.execute("DELETE FROM idempotency WHERE tenant=?", (uid,)).rowcount
            # Its episodes' epochs: a uid is fixed-length hex, so the prefix is exact (keys.py).
            return n + self._db.execute("DELETE FROM episodes WHERE substr(key, 1, ?) = ?",
                                        (len(uid) + 2, uid + "--")).rowcount

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
    def record_sandbox(self, sandbox_id: str, tenant: str, created_at: float, node: str = "") -> None:
        self._q("INSERT OR IGNORE INTO sandboxes(id, tenant, created_at, node) VALUES (?,?,?,?)",
                (sandbox_id, tenant, created_at, node or None))

    def sandbox_owner(self, sandbox_id: str) -> str | None:
        rows = self._q("SELECT tenant FROM sandboxes WHERE id=?", (sandbox_id,))
        return rows[0][0] if rows else None

    def sandbox_node(self, sandbox_id: str) -> str | None:
        rows = self._q("SELECT node FROM sandboxes WHERE id=?", (sandbox_id,))
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

    # --- documents -----------------------------------------------------------------
    def put_doc(self, kind: str, key: str, body: dict[str, Any]) -> None:
        self._q("INSERT OR REPLACE INTO docs(kind, key, body) VALUES (?,?,?)", (kind, key, json.dumps(body)))

    def get_doc(self, kind: str, key: str) -> dict[str, Any] | None:
        rows = self._q("SELECT body FROM docs WHERE kind=? AND key=?", (kind, key))
        return json.loads(rows[0][0]) if rows else None

    def delete_doc(self, kind: str, key: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM docs WHERE kind=? AND key=?", (kind, key)).rowcount > 0

    def list_docs(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(b) for k, b in self._q("SELECT key, body FROM docs WHERE kind=? ORDER BY key", (kind,))}

    # --- leases --------------------------------------------------------------------
    def lease_acquire(self, name: str, holder: str, ttl_s: float, now: float) -> Lease | None:
        with self._tx() as db:
            row = db.execute("SELECT holder, token, expires_at FROM leases WHERE name=?", (name,)).fetchone()
            if row is not None and row[0] != holder and row[2] > now:
                return None
            token = (row[1] if row[0] == holder else row[1] + 1) if row is not None else 1
            db.execute("INSERT OR REPLACE INTO leases(name, holder, token, expires_at) VALUES (?,?,?,?)",
                       (name, holder, token, now + ttl_s))
        return Lease(name=name, holder=holder, token=token, expires_at=now + ttl_s)

    def lease_takeover(self, name: str, holder: str, from_holder: str, ttl_s: float, now: float,
                       min_token: int = 0) -> Lease | None:
        with self._tx() as db:
            row = db.execute("SELECT holder, token FROM leases WHERE name=?", (name,)).fetchone()
            if row is None or row[0] != from_holder:
                return None
            token = max(row[1] + 1, min_token)
            db.execute("UPDATE leases SET holder=?, token=?, expires_at=? WHERE name=?",
                       (holder, token, now + ttl_s, name))
        return Lease(name=name, holder=holder, token=token, expires_at=now + ttl_s)

    def lease_get(self, name: str) -> Lease | None:
        rows = self._q("SELECT holder, token, expires_at FROM leases WHERE name=?", (name,))
        return Lease(name=name, holder=rows[0][0], token=rows[0][1], expires_at=rows[0][2]) if rows else None

    def lease_release(self, name: str, holder: str) -> bool:
        # Expire it rather than delete it: the token must keep growing across holders.
        with self._lock:
            return self._db.execute("UPDATE leases SET expires_at=0 WHERE name=? AND holder=?",
                                    (name, holder)).rowcount > 0

    # --- episode ownership ----------------------------------------------------------
    def episode_epoch(self, episode_key: str) -> int | None:
        rows = self._q("SELECT epoch FROM episodes WHERE key=?", (episode_key,))
        return int(rows[0][0]) if rows else None

    def claim_episode(self, episode_key: str, floor: int = 0) -> int:
        with self._tx() as db:
            row = db.execute("SELECT epoch FROM episodes WHERE key=?", (episode_key,)).fetchone()
            epoch = 1 + max(row[0] if row else 0, floor)
            db.execute("INSERT OR REPLACE INTO episodes(key, epoch) VALUES (?,?)", (episode_key, epoch))
        return epoch

    def episode_cas(self, episode_key: str, expect: int | None, new: int) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT epoch FROM episodes WHERE key=?", (episode_key,)).fetchone()
            if (row[0] if row else None) != expect:
                return False
            db.execute("INSERT OR REPLACE INTO episodes(key, epoch) VALUES (?,?)", (episode_key, new))
        return True

    def delete_episode(self, episode_key: str) -> None:
        self._q("DELETE FROM episodes WHERE key=?", (episode_key,))


_Job = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]"]


def _settle(done: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, value, err in done:
        if fut.cancelled():  # its caller went away; the call itself has run (as with run_in_executor)
            continue
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(value)


class SqliteStateStore:
    """Async ``StateStore`` over ``SqliteDB``: calls run in submission order on the store's
    own thread. Calls made in the same event-loop iteration share one hop to that thread
    and one back (a warm hand-over sends its owner row, dead mark and request-id answer
    together; concurrent requests' writes ride along): each hop is two thread wake-ups,
    which on a loaded machine cost more than the SQL (issue 15)."""

    def __init__(self, path: Path | str) -> None:
        self.db = SqliteDB(path)  # opens (and checks the schema) at once: a bad file fails at start
        self.url = self.db.url
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-state")
        self._pending: dict[asyncio.AbstractEventLoop, list[_Job]] = {}  # not yet handed to the thread

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        jobs = self._pending.get(loop)
        if jobs is None:
            jobs = self._pending[loop] = []
            loop.call_soon(self._hand_over, loop)  # after the rest of this iteration's calls
        jobs.append((fn, args, fut))
        return await fut

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        jobs = self._pending.pop(loop, [])
        try:
            self._pool.submit(self._run_jobs, loop, jobs)
        except RuntimeError as e:  # shut down (closed store)
            _settle([(fut, None, e) for _, _, fut in jobs])

    @staticmethod
    def _run_jobs(loop: asyncio.AbstractEventLoop, jobs: list[_Job]) -> None:
        done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        for fn, args, fut in jobs:
            try:
                done.append((fut, fn(*args), None))
            except BaseException as e:  # noqa: BLE001 - handed to its caller, as run_in_executor does
                done.append((fut, None, e))
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
            loop.call_soon_threadsafe(_settle, done)

    async def on_worker(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the store's thread (the API server gives it the loop's CPU priority)."""
        return await self._run(fn)

    async def open(self) -> None:
        pass  # SqliteDB opened in __init__

    async def close(self) -> None:
        await self._run(self.db.close)
        self._pool.shutdown(wait=False)

    async def schema_version(self) -> int | None:
        return await self._run(self.db.schema_version)

    async def put_tenant(self, rec: TenantRecord) -> None:
        await self._run(self.db.put_tenant, rec)

    async def get_tenant(self, name: str) -> TenantRecord | None:
        return await self._run(self.db.get_tenant, name)

    async def tenant_by_token_hash(self, token_hash: str) -> TenantRecord | None:
        return await self._run(self.db.tenant_by_token_hash, token_hash)

    async def list_tenants(self) -> list[TenantRecord]:
        return await self._run(self.db.list_tenants)

    async def delete_tenant(self, name: str) -> bool:
        return await self._run(self.db.delete_tenant, name)

    async def purge_tenant(self, uid: str) -> int:
        return await self._run(self.db.purge_tenant, uid)

    async def idem_reserve(self, rec: IdempotencyRecord) -> IdempotencyRecord:
        return await self._run(self.db.idem_reserve, rec)

    async def idem_complete(self, tenant: str, request_id: str, info: dict[str, Any]) -> None:
        await self._run(self.db.idem_complete, tenant, request_id, info)

    async def idem_delete(self, tenant: str, request_id: str) -> None:
        await self._run(self.db.idem_delete, tenant, request_id)

    async def record_sandbox(self, sandbox_id: str, tenant: str, created_at: float, node: str = "") -> None:
        await self._run(self.db.record_sandbox, sandbox_id, tenant, created_at, node)

    async def sandbox_owner(self, sandbox_id: str) -> str | None:
        return await self._run(self.db.sandbox_owner, sandbox_id)

    async def sandbox_node(self, sandbox_id: str) -> str | None:
        return await self._run(self.db.sandbox_node, sandbox_id)

    async def mark_dead(self, sandbox_ids: list[str], ts: float) -> None:
        await self._run(self.db.mark_dead, sandbox_ids, ts)

    async def live_sandbox_ids(self) -> list[str]:
        return await self._run(self.db.live_sandbox_ids)

    async def append_audit(self, records: list[AuditRecord]) -> None:
        await self._run(self.db.append_audit, records)

    async def audit(self, sandbox_id: str, limit: int = 1000) -> list[AuditRecord]:
        return await self._run(self.db.audit, sandbox_id, limit)

    async def prune(self, dead_before: float) -> int:
        return await self._run(self.db.prune, dead_before)

    async def put_doc(self, kind: str, key: str, body: dict[str, Any]) -> None:
        await self._run(self.db.put_doc, kind, key, body)

    async def get_doc(self, kind: str, key: str) -> dict[str, Any] | None:
        return await self._run(self.db.get_doc, kind, key)

    async def delete_doc(self, kind: str, key: str) -> bool:
        return await self._run(self.db.delete_doc, kind, key)

    async def list_docs(self, kind: str) -> dict[str, dict[str, Any]]:
        return await self._run(self.db.list_docs, kind)

    async def lease_acquire(self, name: str, holder: str, ttl_s: float, now: float) -> Lease | None:
        return await self._run(self.db.lease_acquire, name, holder, ttl_s, now)

    async def lease_get(self, name: str) -> Lease | None:
        return await self._run(self.db.lease_get, name)

    async def lease_takeover(self, name: str, holder: str, from_holder: str, ttl_s: float,
                             now: float, min_token: int = 0) -> Lease | None:
        return await self._run(self.db.lease_takeover, name, holder, from_holder, ttl_s, now, min_token)

    async def lease_release(self, name: str, holder: str) -> bool:
        return await self._run(self.db.lease_release, name, holder)

    async def episode_epoch(self, episode_key: str) -> int | None:
        return await self._run(self.db.episode_epoch, episode_key)

    async def claim_episode(self, episode_key: str, floor: int = 0) -> int:
        return await self._run(self.db.claim_episode, episode_key, floor)

    async def episode_cas(self, episode_key: str, expect: int | None, new: int) -> bool:
        return await self._run(self.db.episode_cas, episode_key, expect, new)

    async def delete_episode(self, episode_key: str) -> None:
        await self._run(self.db.delete_episode, episode_key)
