"""UsageLedger: the API process's accounting of what each sandbox really uses.

It follows the node's sandboxes (hand-over -> teardown hooks of the local
``SandboxManager``), samples their cgroup counters every ``usage_sample_interval_s``
(one worker-thread hop for all of them), keeps running totals in memory, writes them to
SQLite every ``usage_flush_interval_s`` and at death, answers usage queries scoped to
one tenant, exports Prometheus counters whose labels are only the operator's
``usage_prometheus_labels`` (at most ``usage_prometheus_max_values`` values each, the
rest as ``_other``), and enforces per-label quotas at admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from dsec.accounting.meter import Accum, Counters, advance, next_interval, read_counters
from dsec.accounting.store import UsageStore
from dsec.config import Settings
from dsec.errors import NotFound, QuotaExceeded
from dsec.models.sandbox import parse_labels as _parse_labels
from dsec.models.usage import LabelQuota, SandboxUsage, UsageGroup, UsageReport
from dsec.state.store import StateStore, TenantRecord

log = logging.getLogger("dsec.usage")

OTHER = "_other"
_LIVE_STATES = ("idle", "running")


@dataclass
class _Entry:
    sandbox_id: str
    tenant_uid: str | None  # None until known (a warm member's owner is recorded after hand-over)
    tenant_name: str
    labels: dict[str, str]
    started_at: float
    scratch: Path
    acc: Accum = field(default_factory=Accum)
    exec_count: int = 0
    ended_at: float | None = None
    prom: tuple[str, ...] = ()
    interval: float = 0.0  # seconds between its samples now (next_interval)
    due: float = 0.0  # time.monotonic() of its next sample

    def usage(self, now: float) -> SandboxUsage:
        end = self.ended_at if self.ended_at is not None else now
        return SandboxUsage(sandbox_id=self.sandbox_id, labels=self.labels, started_at=self.started_at,
                            ended_at=self.ended_at, sandboxes=1, cpu_seconds=self.acc.cpu_seconds,
                            memory_gb_seconds=self.acc.memory_gb_seconds, exec_count=self.exec_count,
                            bytes_written=self.acc.bytes_written, sandbox_seconds=max(0.0, end - self.started_at))


def prom_label_name(key: str) -> str:
    """A sandbox label key as a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, no '__')."""
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    return name if re.match(r"^[a-zA-Z][a-zA-Z0-9_]*$", name) else "l_" + name.lstrip("_")


class BoundedValues:
    """The first ``cap`` distinct values of each exported key keep their own series; later
    ones share ``_other`` (a run id per training run must not grow Prometheus forever)."""

    def __init__(self, keys: list[str], cap: int) -> None:
        self.keys, self.cap = list(keys), cap
        self.seen: dict[str, set[str]] = {k: set() for k in self.keys}

    def key_of(self, labels: dict[str, str], tenant: str) -> tuple[str, ...]:
        out = []
        for k in self.keys:
            v = tenant if k == "tenant" else labels.get(k, "")
            seen = self.seen[k]
            if v and v not in seen:
                if len(seen) >= self.cap:
                    v = OTHER
                else:
                    seen.add(v)
            out.append(v)
        return tuple(out)


class UsageCollector(Collector):
    _NAMES = (("dsec_usage_cpu_seconds", "CPU-seconds used by sandboxes (cgroup cpuacct)"),
              ("dsec_usage_memory_gb_seconds", "Memory cgroup usage integrated over time, GiB x s"),
              ("dsec_usage_execs", "Commands run in sandboxes through the API"),
              ("dsec_usage_bytes_written", "Growth of sandboxes' writable layers, bytes"),
              ("dsec_usage_sandbox_seconds", "Sandbox lifetime from hand-over, seconds"))

    def __init__(self, keys: list[str]) -> None:
        self.labels = [prom_label_name(k) for k in keys]
        self.values: dict[tuple[str, ...], list[float]] = {}

    def add(self, key: tuple[str, ...], i: int, amount: float) -> None:
        if amount:
            self.values.setdefault(key, [0.0] * 5)[i] += amount

    def collect(self) -> Iterator[Metric]:
        for i, (name, doc) in enumerate(self._NAMES):
            fam = CounterMetricFamily(name, doc, labels=self.labels)
            for key, vals in sorted(self.values.items()):
                fam.add_metric(list(key), vals[i])
            yield fam


async def _maybe_await(value: Any) -> Any:
    """State store calls are coroutines in the async store, plain values in the old one."""
    return await value if inspect.isawaitable(value) else value


def parse_labels(items: list[str]) -> dict[str, str]:
    return _parse_labels(items, hint=" (e.g. run=r1)")


class UsageLedger:
    def __init__(self, settings: Settings, state: StateStore, store: UsageStore | None = None,
                 cgroup_parent: str = "dsec", owners: Callable[[str], str | None] | None = None) -> None:
        self.settings = settings
        self.state = state
        # sandbox id -> owner uid as the API service recorded it (in memory: the hooks that
        # call it run inside the node's state changes and must not wait on the store).
        self.owners = owners or (lambda _sid: None)
        self.store = store or UsageStore(settings.home / "state.db")
        self.cgroup_parent = cgroup_parent
        self.live: dict[str, _Entry] = {}
        self._dirty: set[str] = set()
        self._ended: dict[str, _Entry] = {}
        self._pending: dict[str, tuple[str, dict[str, str]]] = {}  # admitted creates not live yet
        self._quotas: dict[tuple[str, str, str], LabelQuota] = {}
        self._bounded = BoundedValues(settings.usage_prometheus_labels, settings.usage_prometheus_max_values)
        self.collector = UsageCollector(settings.usage_prometheus_labels)
        self._manager: Any = None
        self._task: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        self._last_prune = 0.0
        self.clock: Callable[[], float] = time.monotonic  # when samples are due (tests pass a fake)

    # --- wiring ------------------------------------------------------------------------
    def attach(self, manager: Any) -> None:
        """Follow a local SandboxManager's sandboxes: tracked from hand-over (state idle),
        sampled one last time just before their cgroups go (teardown hook)."""
        self._manager = manager
        manager.on_state_change.append(self._on_state)
        manager.before_teardown.append(self._on_teardown)

    async def start(self) -> None:
        self._quotas = await asyncio.to_thread(self.store.quotas)
        if self._manager is not None:  # sandboxes adopted after a restart: resume their totals
            for rec in list(self._manager.live.values()):
                if rec.info.state.value in _LIVE_STATES and rec.info.id not in self.live:
                    prior = await asyncio.to_thread(self.store.get, rec.info.id)
                    self._track(rec.info, prior[1] if prior else None)
        stale = [s for s in await asyncio.to_thread(self.store.open_sandboxes) if s not in self.live]
        for sid in stale:  # died while the server was down: ended at their last flushed time
            got = await asyncio.to_thread(self.store.get, sid)
            if got is not None:
                await asyncio.to_thread(self.store.close_sandboxes, [sid],
                                        got[1].started_at + got[1].sandbox_seconds)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="dsec-usage")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.sample(force=True)
            await self.flush()
        self.store.close()

    # --- following sandboxes -----------------------------------------------------------
    async def _resolve_owner(self, e: _Entry) -> str:
        """The owner's uid: as the service recorded it, else the tenant of that name now."""
        uid = self.owners(e.sandbox_id)
        if uid is None and e.tenant_name:
            try:
                rec = await _maybe_await(self.state.get_tenant(e.tenant_name))
                uid = rec.uid if rec is not None else None
            except Exception:
                log.exception("usage: looking up tenant %r failed", e.tenant_name)
        return uid or f"name:{e.tenant_name}"

    def _track(self, info: Any, prior: SandboxUsage | None = None) -> None:
        assert self._manager is not None
        now = time.time()
        e = _Entry(sandbox_id=info.id, tenant_uid=self.owners(info.id), tenant_name=info.tenant or "",
                   labels=dict(info.labels), started_at=prior.started_at if prior else (info.started_at or now),
                   scratch=self._manager.paths(info.id).scratch)
        if prior is not None:
            e.acc.cpu_seconds, e.acc.memory_gb_seconds = prior.cpu_seconds, prior.memory_gb_seconds
            e.acc.bytes_written, e.exec_count = prior.bytes_written, prior.exec_count
        e.prom = self._bounded.key_of(e.labels, e.tenant_name)
        # Baseline now: what runc/init used before the hand-over is not the user's.
        advance(e.acc, read_counters(self.cgroup_parent, info.id, e.scratch, now))
        e.interval = self.settings.usage_sample_interval_s
        e.due = self.clock() + e.interval
        self.live[info.id] = e
        self._dirty.add(info.id)

    def _on_state(self, info: Any) -> None:
        if info.state.value == "idle" and info.id not in self.live:
            try:
                self._track(info)
            except Exception:  # accounting must never fail a create
                log.exception("usage: tracking %s failed", info.id)

    def _on_teardown(self, sandbox_id: str) -> None:
        e = self.live.pop(sandbox_id, None)
        if e is None:
            return
        now = time.time()
        self._fold(e, read_counters(self.cgroup_parent, sandbox_id, e.scratch, now))
        e.ended_at = now
        self._dirty.discard(sandbox_id)
        self._ended[sandbox_id] = e

    def _fold(self, e: _Entry, c: Counters) -> None:
        t0 = e.acc.last.t if e.acc.last is not None else c.t
        cpu, mem, written = advance(e.acc, c, ramp_s=self.settings.usage_sample_interval_s)
        for i, v in enumerate((cpu, mem, 0.0, float(written), max(0.0, c.t - t0))):
            self.collector.add(e.prom, i, v)

    def count_exec(self, sandbox_id: str) -> None:
        e = self.live.get(sandbox_id)
        if e is not None:
            e.exec_count += 1
            self._dirty.add(sandbox_id)
            # A command runs: sample it at the base interval again (it was perhaps backed off).
            e.interval = self.settings.usage_sample_interval_s
            e.due = min(e.due, self.clock() + e.interval)
            self.collector.add(e.prom, 2, 1.0)

    # --- sampling and persistence ---------------------------------------------------------
    async def sample(self, force: bool = False, which: Callable[[_Entry], bool] | None = None) -> None:
        """Read the counters of every sandbox that is due (``next_interval``: idle ones back
        off), or of all (``force``: a quota check or report needs them now), optionally only
        those ``which`` selects. The reads run in a worker thread; the work per interval is
        O(sandboxes whose counters move), not O(live sandboxes)."""
        mono = self.clock()
        entries = [e for e in self.live.values() if (force or e.due <= mono) and (which is None or which(e))]
        if not entries:
            return
        parent = self.cgroup_parent
        base, cap = self.settings.usage_sample_interval_s, self.settings.usage_idle_sample_max_s

        def read() -> list[Counters]:
            return [read_counters(parent, e.sandbox_id, e.scratch, time.time()) for e in entries]

        for e, c in zip(entries, await asyncio.to_thread(read)):
            if self.live.get(e.sandbox_id) is e:  # not torn down while we read
                prev = e.acc.last
                self._fold(e, c)
                e.interval = next_interval(prev, c, e.interval, base, cap)
                e.due = mono + e.interval
                self._dirty.add(e.sandbox_id)

    async def flush(self) -> None:
        async with self._flush_lock:
            now = time.time()
            ended, self._ended = self._ended, {}
            todo = [*ended.values(), *(e for s in self._dirty if (e := self.live.get(s)))]
            self._dirty.clear()
            for e in todo:
                if e.tenant_uid is None:
                    e.tenant_uid = await self._resolve_owner(e)
            rows = [(e.tenant_uid or "", e.tenant_name, e.usage(now)) for e in todo]
            try:
                await asyncio.to_thread(self.store.upsert, rows)
            except BaseException:
                self._ended.update(ended)  # written next time
                raise

    async def _loop(self) -> None:
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.usage_sample_interval_s)
            try:
                await self.sample()
                if time.monotonic() - last_flush >= self.settings.usage_flush_interval_s or self._ended:
                    await self.flush()
                    last_flush = time.monotonic()
                if time.time() - self._last_prune > 3600:
                    self._last_prune = time.time()
                    await asyncio.to_thread(self.store.prune, time.time() - self.settings.usage_retention_s)
            except Exception:
                log.exception("usage sampling failed; retrying next interval")

    # --- queries -------------------------------------------------------------------------
    async def report(self, tenant: TenantRecord, labels: dict[str, str], group_by: str | None = None,
                     limit: int = 100) -> UsageReport:
        """The tenant's own sandboxes matching every label (none match an unknown label:
        an empty report, not an error). Live sandboxes count up to now: the tenant's matching
        ones are sampled first (idle ones may be sampled rarely, ``next_interval``)."""
        uid = tenant.uid
        await self.sample(force=True, which=lambda e: (
            self._owned_by(e, tenant) and all(e.labels.get(k) == v for k, v in labels.items())))
        await self.flush()
        totals = await asyncio.to_thread(self.store.totals, uid, labels)
        rows = await asyncio.to_thread(self.store.sandboxes, uid, labels, limit) if limit > 0 else []
        groups: list[UsageGroup] = []
        if group_by == "tenant":
            groups = [UsageGroup(value=tenant.name, totals=totals)] if totals.sandboxes else []
        elif group_by:
            groups = await asyncio.to_thread(self.store.groups, uid, labels, group_by)
        return UsageReport(labels=labels, totals=totals, group_by=group_by, groups=groups, sandboxes=rows,
                           truncated=totals.sandboxes > len(rows))

    # --- per-label quotas ----------------------------------------------------------------
    def quotas(self, tenant: TenantRecord) -> list[LabelQuota]:
        return [q for (uid, _, _), q in sorted(self._quotas.items()) if uid == tenant.uid]

    async def set_quota(self, tenant: TenantRecord, q: LabelQuota) -> LabelQuota:
        """Takes effect for the next create; live sandboxes above it keep running."""
        await asyncio.to_thread(self.store.put_quota, tenant.uid, q)
        self._quotas[(tenant.uid, *q.key_value)] = q
        return q

    async def delete_quota(self, tenant: TenantRecord, label: str) -> None:
        k, v = parse_labels([label]).popitem()
        if not await asyncio.to_thread(self.store.delete_quota, tenant.uid, k, v):
            raise NotFound(f"no usage quota on label {label!r}; list them with GET /v1/usage/quotas", label=label)
        self._quotas.pop((tenant.uid, k, v), None)

    @staticmethod
    def _owned_by(e: _Entry, tenant: TenantRecord) -> bool:
        return e.tenant_uid == tenant.uid or (e.tenant_uid is None and e.tenant_name == tenant.name)

    def live_count(self, tenant: TenantRecord, key: str, value: str) -> int:
        uid = tenant.uid
        n = sum(1 for e in self.live.values() if e.labels.get(key) == value and self._owned_by(e, tenant))
        return n + sum(1 for u, lb in self._pending.values() if u == uid and lb.get(key) == value)

    async def admit(self, tenant: TenantRecord, labels: dict[str, str], sandbox_id: str) -> None:
        """Refuse (429 naming the quota and label) a create whose labels hit a quota, else
        hold a place for it until ``release``. Call under the tenant's admission lock."""
        for k, v in sorted(labels.items()):
            q = self._quotas.get((tenant.uid, k, v))
            if q is None:
                continue
            if q.max_sandboxes is not None:
                n = self.live_count(tenant, k, v)
                if n + 1 > q.max_sandboxes:
                    raise QuotaExceeded(
                        f"usage quota max_sandboxes={q.max_sandboxes} of label {k}={v} reached: {n} sandboxes with "
                        "that label are live; kill some or raise the quota (PUT /v1/usage/quotas)",
                        quota="max_sandboxes", label=f"{k}={v}", limit=q.max_sandboxes, in_use=n,
                        retry_after=self.settings.api_retry_after_s)
            if q.max_cpu_seconds is not None:
                # Only the sandboxes this quota counts: a create must not read 1,000 cgroups.
                await self.sample(force=True, which=lambda e, k=k, v=v: e.labels.get(k) == v and self._owned_by(e, tenant))
                await self.flush()
                used = await asyncio.to_thread(self.store.cpu_seconds, tenant.uid, k, v)
                if used >= q.max_cpu_seconds:
                    raise QuotaExceeded(
                        f"usage quota max_cpu_seconds={q.max_cpu_seconds:g} of label {k}={v} used up: sandboxes "
                        f"with that label used {used:.3f} CPU-seconds; raise the quota (PUT /v1/usage/quotas) "
                        "or use another label value", quota="max_cpu_seconds", label=f"{k}={v}",
                        limit=q.max_cpu_seconds, in_use=round(used, 6))
        self._pending[sandbox_id] = (tenant.uid, dict(labels))

    def release(self, sandbox_id: str) -> None:
        self._pending.pop(sandbox_id, None)
