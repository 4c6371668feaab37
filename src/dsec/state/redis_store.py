"""Redis state store (``redis.asyncio``): shared by every API server of a deployment.

Layout (every key under ``prefix``, default ``dsec:``):

* ``schema`` - the schema version (written once with SET NX; a differing value refuses to open)
* ``tenant:<name>`` JSON body, ``th:<token hash>`` -> name, ``tenants`` set of names
* ``idem:<uid>:<request id>`` hash, ``idem_t:<uid>`` set of request ids, ``idem_time`` zset (prune)
* ``sb:<id>`` hash (tenant, created_at, node, dead_at), ``sb_live`` set, ``sb_dead`` zset by death time
* ``audit:<sandbox id>`` list of JSON records
* ``docs:<kind>`` hash key -> JSON (pools, preemption records, ...)
* ``lease:<name>`` hash (holder, token, expires_at)
* ``epoch:<episode key>`` the episode owner's epoch

Every multi-key write and every conditional write is one Lua script: Redis runs a script
atomically, so two servers racing for an episode or a lease serialise there, and a
connection lost mid-write leaves either all of it or none. The uid part of a key has a
fixed shape (``keys.TENANT_UID_RE``), so ``<uid>:<request id>`` splits one way only.

A lost connection surfaces as ``StateUnavailable`` (503 + Retry-After); redis-py's pool
reconnects on the next command, so the server recovers by itself when Redis is back.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc

from dsec import errors
from dsec.state.keys import new_tenant_uid
from dsec.state.sqlite import schema_mismatch
from dsec.state.store import SCHEMA_VERSION, AuditRecord, IdempotencyRecord, Lease, TenantRecord

P = ParamSpec("P")
T = TypeVar("T")

_UNREACHABLE = (rexc.ConnectionError, rexc.TimeoutError, rexc.BusyLoadingError, OSError)

_PUT_TENANT = """
local old = redis.call('GET', KEYS[1])
if old then
  local oh = cjson.decode(old)['token_hash']
  if oh ~= ARGV[3] then redis.call('DEL', ARGV[1] .. 'th:' .. oh) end
end
local owner = redis.call('GET', ARGV[1] .. 'th:' .. ARGV[3])
if owner and owner ~= ARGV[2] then return redis.error_reply('token hash in use by another tenant') end
redis.call('SET', KEYS[1], ARGV[4])
redis.call('SET', ARGV[1] .. 'th:' .. ARGV[3], ARGV[2])
redis.call('SADD', ARGV[1] .. 'tenants', ARGV[2])
return 1
"""
_BY_TOKEN = """
local name = redis.call('GET', KEYS[1])
if not name then return false end
return redis.call('GET', ARGV[1] .. 'tenant:' .. name)
"""
_DEL_TENANT = """
local old = redis.call('GET', KEYS[1])
if not old then return 0 end
redis.call('DEL', ARGV[1] .. 'th:' .. cjson.decode(old)['token_hash'], KEYS[1])
redis.call('SREM', ARGV[1] .. 'tenants', ARGV[2])
return 1
"""
# KEYS: idem hash, idem_t set, idem_time zset; ARGV: request id, member, sandbox id, done, info, created_at
_IDEM_RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'sandbox_id', ARGV[3], 'done', ARGV[4], 'info', ARGV[5], 'created_at', ARGV[6])
  redis.call('SADD', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[2])
end
return redis.call('HMGET', KEYS[1], 'sandbox_id', 'done', 'info', 'created_at')
"""
_IDEM_COMPLETE = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'done', '1', 'info', ARGV[1]) end
return 1
"""
_RECORD_SB = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'tenant', ARGV[2], 'created_at', ARGV[3], 'node', ARGV[4])
  redis.call('SADD', KEYS[2], ARGV[1])
end
return 1
"""
# KEYS: sb_live, sb_dead; ARGV: prefix, ts, ids...
_MARK_DEAD = """
for i = 3, #ARGV do
  local k = ARGV[1] .. 'sb:' .. ARGV[i]
  if redis.call('EXISTS', k) == 1 and redis.call('HEXISTS', k, 'dead_at') == 0 then
    redis.call('HSET', k, 'dead_at', ARGV[2])
    redis.call('SREM', KEYS[1], ARGV[i])
    redis.call('ZADD', KEYS[2], ARGV[2], ARGV[i])
  end
end
return 1
"""
_LEASE = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token', 'expires_at')
if cur[1] and cur[1] ~= ARGV[1] and tonumber(cur[3]) > tonumber(ARGV[2]) then return false end
local token = 1
if cur[1] then
  token = tonumber(cur[2])
  if cur[1] ~= ARGV[1] then token = token + 1 end
end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token, 'expires_at', ARGV[3])
return token
"""
# KEYS: lease; ARGV: holder, from_holder, expires_at, min_token
_LEASE_TAKEOVER = """
local cur = redis.call('HMGET', KEYS[1], 'holder', 'token')
if not cur[1] or cur[1] ~= ARGV[2] then return false end
local token = math.max(tonumber(cur[2]) + 1, tonumber(ARGV[4]))
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token, 'expires_at', ARGV[3])
return token
"""
_LEASE_RELEASE = """
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then redis.call('HSET', KEYS[1], 'expires_at', '0') return 1 end
return 0
"""
_CLAIM = """
local e = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), tonumber(ARGV[1])) + 1
redis.call('SET', KEYS[1], e)
return e
"""
_CAS = """
local cur = redis.call('GET', KEYS[1])
if (cur == false and ARGV[1] == '') or cur == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) return 1 end
return 0
"""


def redacted(url: str) -> str:
    """The URL without its password (errors and logs name the store, never its secret)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _guarded(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """Redis unreachable -> ``StateUnavailable`` (the one error the API maps to 503)."""
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except _UNREACHABLE as exc:
            self = args[0]
            raise errors.StateUnavailable(
                f"state store {self.url} is unreachable ({exc.__class__.__name__}: {exc}); nothing was "  # type: ignore[attr-defined]
                "changed: retry after the Retry-After delay", retry_after=self.retry_after) from None  # type: ignore[attr-defined]
    return wrapper


REDIS_MAX_CONNECTIONS = 100  # per API server: Redis answers each call in well under a ms


class RedisStateStore:
    def __init__(self, url: str, *, prefix: str = "dsec:", timeout_s: float = 2.0, retry_after: float = 1.0) -> None:
        self.url, self.prefix, self.retry_after = redacted(url), prefix, retry_after
        # Short timeouts: a request must answer 503 quickly when Redis is gone, not hang.
        # A blocking pool: past REDIS_MAX_CONNECTIONS calls in flight a call waits (up to
        # timeout_s) for a free connection; the default pool failed it at once with
        # "Too many connections" (a bulk kill of 200 sandboxes answered 503 for some).
        self._pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=REDIS_MAX_CONNECTIONS, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, decode_responses=True, retry_on_timeout=False)
        self._r = aioredis.Redis(connection_pool=self._pool)
        self._scripts = {name: self._r.register_script(src) for name, src in (
            ("put_tenant", _PUT_TENANT), ("by_token", _BY_TOKEN), ("del_tenant", _DEL_TENANT),
            ("idem_reserve", _IDEM_RESERVE), ("idem_complete", _IDEM_COMPLETE), ("record_sb", _RECORD_SB),
            ("mark_dead", _MARK_DEAD), ("lease", _LEASE), ("lease_release", _LEASE_RELEASE),
            ("lease_takeover", _LEASE_TAKEOVER),
            ("claim", _CLAIM), ("cas", _CAS))}

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[name](keys=keys, args=args)

    async def open(self) -> None:
        """Connect and check the schema version: a clear error naming the URL if either fails."""
        try:
            await self._r.ping()
            await self._r.set(self._k("schema"), SCHEMA_VERSION, nx=True)
            found = int(await self._r.get(self._k("schema")) or SCHEMA_VERSION)
        except _UNREACHABLE as exc:
            raise errors.StateUnavailable(
                f"cannot reach the state store {self.url} ({exc.__class__.__name__}: {exc}): start Redis there "
                "or fix --state / DSEC_STATE_URL", url=self.url, retry_after=self.retry_after) from None
        if found != SCHEMA_VERSION:
            raise schema_mismatch(self.url, found)

    async def close(self) -> None:
        await self._r.aclose()
        await self._pool.disconnect()

    @_guarded
    async def schema_version(self) -> int | None:
        v = await self._r.get(self._k("schema"))
        return int(v) if v is not None else None

    # --- tenants -----------------------------------------------------------------
    @_guarded
    async def put_tenant(self, rec: TenantRecord) -> None:
        if not rec.uid:
            rec.uid = new_tenant_uid()
        try:
            await self._script("put_tenant", [self._k("tenant", rec.name)],
                               [self.prefix, rec.name, rec.token_hash, rec.model_dump_json()])
        except rexc.ResponseError as exc:
            if "token hash in use" in str(exc):
                raise errors.Conflict("token already belongs to another tenant") from None
            raise

    @_guarded
    async def get_tenant(self, name: str) -> TenantRecord | None:
        body = await self._r.get(self._k("tenant", name))
        return TenantRecord.model_validate_json(body) if body else None

    @_guarded
    async def tenant_by_token_hash(self, token_hash: str) -> TenantRecord | None:
        body = await self._script("by_token", [self._k("th", token_hash)], [self.prefix])
        return TenantRecord.model_validate_json(body) if body else None

    @_guarded
    async def list_tenants(self) -> list[TenantRecord]:
        names = sorted(await self._r.smembers(self._k("tenants")))
        if not names:
            return []
        bodies = await self._r.mget([self._k("tenant", n) for n in names])
        return [TenantRecord.model_validate_json(b) for b in bodies if b]

    @_guarded
    async def delete_tenant(self, name: str) -> bool:
        return bool(await self._script("del_tenant", [self._k("tenant", name)], [self.prefix, name]))

    @_guarded
    async def purge_tenant(self, uid: str) -> int:
        rids = list(await self._r.smembers(self._k("idem_t", uid)))
        epochs = [k async for k in self._r.scan_iter(match=self._k("epoch", uid + "--*"), count=1000)]
        async with self._r.pipeline(transaction=True) as p:
            for rid in rids:
                p.delete(self._k("idem", uid, rid))
                p.zrem(self._k("idem_time"), f"{uid}:{rid}")
            p.delete(self._k("idem_t", uid))
            if epochs:
                p.delete(*epochs)
            await p.execute()
        return len(rids) + len(epochs)

    # --- idempotency ---------------------------------------------------------------
    @_guarded
    async def idem_reserve(self, rec: IdempotencyRecord) -> IdempotencyRecord:
        sid, done, info, created = await self._script(
            "idem_reserve", [self._k("idem", rec.tenant, rec.request_id), self._k("idem_t", rec.tenant),
                             self._k("idem_time")],
            [rec.request_id, f"{rec.tenant}:{rec.request_id}", rec.sandbox_id, int(rec.done),
             json.dumps(rec.info) if rec.info is not None else "", repr(rec.created_at)])
        return IdempotencyRecord(tenant=rec.tenant, request_id=rec.request_id, sandbox_id=sid, done=done == "1",
                                 info=json.loads(info) if info else None, created_at=float(created))

    @_guarded
    async def idem_complete(self, tenant: str, request_id: str, info: dict[str, Any]) -> None:
        await self._script("idem_complete", [self._k("idem", tenant, request_id)], [json.dumps(info)])

    @_guarded
    async def idem_delete(self, tenant: str, request_id: str) -> None:
        async with self._r.pipeline(transaction=True) as p:
            p.delete(self._k("idem", tenant, request_id))
            p.srem(self._k("idem_t", tenant), request_id)
            p.zrem(self._k("idem_time"), f"{tenant}:{request_id}")
            await p.execute()

    # --- sandboxes -----------------------------------------------------------------
    @_guarded
    async def record_sandbox(self, sandbox_id: str, tenant: str, created_at: float, node: str = "") -> None:
        await self._script("record_sb", [self._k("sb", sandbox_id), self._k("sb_live")],
                           [sandbox_id, tenant, repr(created_at), node])

    @_guarded
    async def sandbox_owner(self, sandbox_id: str) -> str | None:
        return await self._r.hget(self._k("sb", sandbox_id), "tenant")  # type: ignore[no-any-return]

    @_guarded
    async def sandbox_node(self, sandbox_id: str) -> str | None:
        v = await self._r.hget(self._k("sb", sandbox_id), "node")
        return v or None

    @_guarded
    async def mark_dead(self, sandbox_ids: list[str], ts: float) -> None:
        if sandbox_ids:
            await self._script("mark_dead", [self._k("sb_live"), self._k("sb_dead")],
                               [self.prefix, repr(ts), *sandbox_ids])

    @_guarded
    async def live_sandbox_ids(self) -> list[str]:
        return list(await self._r.smembers(self._k("sb_live")))

    # --- audit ---------------------------------------------------------------------
    @_guarded
    async def append_audit(self, records: list[AuditRecord]) -> None:
        if not records:
            return
        async with self._r.pipeline(transaction=True) as p:
            for r in records:
                p.rpush(self._k("audit", r.sandbox_id), r.model_dump_json())
            await p.execute()

    @_guarded
    async def audit(self, sandbox_id: str, limit: int = 1000) -> list[AuditRecord]:
        rows = await self._r.lrange(self._k("audit", sandbox_id), 0, max(0, limit) - 1) if limit > 0 else []
        return [AuditRecord.model_validate_json(r) for r in rows]

    @_guarded
    async def prune(self, dead_before: float) -> int:
        ids = await self._r.zrangebyscore(self._k("sb_dead"), "-inf", f"({dead_before!r}")
        old = await self._r.zrangebyscore(self._k("idem_time"), "-inf", f"({dead_before!r}")
        async with self._r.pipeline(transaction=True) as p:
            for i in ids:
                p.delete(self._k("sb", i), self._k("audit", i))
                p.zrem(self._k("sb_dead"), i)
            for m in old:
                uid, _, rid = m.partition(":")
                p.delete(self._k("idem", uid, rid))
                p.srem(self._k("idem_t", uid), rid)
                p.zrem(self._k("idem_time"), m)
            await p.execute()
        return len(ids)

    # --- documents -----------------------------------------------------------------
    @_guarded
    async def put_doc(self, kind: str, key: str, body: dict[str, Any]) -> None:
        await self._r.hset(self._k("docs", kind), key, json.dumps(body))

    @_guarded
    async def get_doc(self, kind: str, key: str) -> dict[str, Any] | None:
        v = await self._r.hget(self._k("docs", kind), key)
        return json.loads(v) if v else None

    @_guarded
    async def delete_doc(self, kind: str, key: str) -> bool:
        return bool(await self._r.hdel(self._k("docs", kind), key))

    @_guarded
    async def list_docs(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in sorted((await self._r.hgetall(self._k("docs", kind))).items())}

    # --- leases --------------------------------------------------------------------
    @_guarded
    async def lease_acquire(self, name: str, holder: str, ttl_s: float, now: float) -> Lease | None:
        token = await self._script("lease", [self._k("lease", name)], [holder, repr(now), repr(now + ttl_s)])
        return Lease(name=name, holder=holder, token=int(token), expires_at=now + ttl_s) if token else None

    @_guarded
    async def lease_takeover(self, name: str, holder: str, from_holder: str, ttl_s: float,
                             now: float, min_token: int = 0) -> Lease | None:
        token = await self._script("lease_takeover", [self._k("lease", name)],
                                   [holder, from_holder, repr(now + ttl_s), str(min_token)])
        return Lease(name=name, holder=holder, token=int(token), expires_at=now + ttl_s) if token else None

    @_guarded
    async def lease_get(self, name: str) -> Lease | None:
        h = await self._r.hgetall(self._k("lease", name))
        return Lease(name=name, holder=h["holder"], token=int(h["token"]), expires_at=float(h["expires_at"])) \
            if h else None

    @_guarded
    async def lease_release(self, name: str, holder: str) -> bool:
        return bool(await self._script("lease_release", [self._k("lease", name)], [holder]))

    # --- episode ownership ----------------------------------------------------------
    @_guarded
    async def episode_epoch(self, episode_key: str) -> int | None:
        v = await self._r.get(self._k("epoch", episode_key))
        return int(v) if v is not None else None

    @_guarded
    async def claim_episode(self, episode_key: str, floor: int = 0) -> int:
        return int(await self._script("claim", [self._k("epoch", episode_key)], [int(floor)]))

    @_guarded
    async def episode_cas(self, episode_key: str, expect: int | None, new: int) -> bool:
        return bool(await self._script("cas", [self._k("epoch", episode_key)],
                                       ["" if expect is None else str(int(expect)), int(new)]))

    @_guarded
    async def delete_episode(self, episode_key: str) -> None:
        await self._r.delete(self._k("epoch", episode_key))
