"""The bundle of components one API app serves (passed to ``create_app``; no globals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dsec.api.audit import AuditLog
from dsec.api.auth import TenantAuth
from dsec.api.metrics import Metrics
from dsec.api.service import Creator, SandboxService
from dsec.config import Settings
from dsec.models import ImageInfo
from dsec.errors import NotFound
from dsec.models.sandbox import SandboxState
from dsec.node.api import NodeAgent
from dsec.state.store import StateStore

log = logging.getLogger("dsec.api")


class ImageBackend(Protocol):
    """What the API needs from ``dsec.images.ImageStore`` (blocking; run in threads)."""

    def list(self) -> list[ImageInfo]: ...
    def resolve(self, ref: str) -> ImageInfo: ...
    def remove(self, ref: str) -> Any: ...


@dataclass
class Services:
    settings: Settings
    state: StateStore
    node: NodeAgent
    images: ImageBackend | None
    metrics: Metrics
    auth: TenantAuth
    audit: AuditLog
    sandboxes: SandboxService
    started_at: float = field(default_factory=time.time)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    scheduler: Any = None

    @classmethod
    def build(cls, settings: Settings, node: NodeAgent, state: StateStore, images: ImageBackend | None = None,
              creator: Creator | None = None) -> Services:
        metrics = Metrics()
        audit = AuditLog(state, metrics, settings.api_audit_flush_s, settings.api_audit_max_chars)
        audit.watch_network(node, settings.net_denied_audit_poll_s, settings.net_denied_audit_distinct)
        if images is None:
            images = getattr(node, "images", None)
        check = None
        if images is not None:
            store = images
            seen: dict[str, float] = {}  # ref -> when it last resolved (skip the thread hop)
            lookups: dict[str, asyncio.Future[Any]] = {}  # ref -> lookup/pull in flight

            async def check(ref: str) -> None:  # NotFound naming the image, before any queueing
                now = time.monotonic()
                if now - seen.get(ref, -1e9) < settings.api_image_check_ttl_s:
                    return
                # A missing image with a registry is pulled here, before any queueing
                # (images/registry_ops.resolve_or_pull: single flight per ref, logged progress).
                # Concurrent checks of one ref share one worker thread, so creates waiting
                # for a pull never pile up in (and starve) the default thread pool.
                lookup = lookups.get(ref)
                if lookup is None:
                    lookup = asyncio.ensure_future(
                        asyncio.to_thread(getattr(store, "resolve_or_pull", store.resolve_fast), ref))
                    lookups[ref] = lookup
                    def done(f: asyncio.Future[Any], ref: str = ref) -> None:
                        lookups.pop(ref, None)
                        if not f.cancelled():
                            f.exception()  # retrieved even if every waiter went away

                    lookup.add_done_callback(done)
                await asyncio.shield(lookup)
                if len(seen) > 4096:
                    seen.clear()
                seen[ref] = now
        sandboxes = SandboxService(settings, node, state, metrics, audit, creator, image_check=check)
        return cls(settings=settings, state=state, node=node, images=images, metrics=metrics,
                   auth=TenantAuth(state), audit=audit, sandboxes=sandboxes)

    @property
    def tmp_dir(self) -> Path:
        d = self.settings.home / "tmp"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def attach_scheduler(self, driver: Any) -> None:
        """Send creates/kills through the control plane's ``SchedulerDriver`` (started and
        closed with these services). Kills of sandboxes the scheduler does not know (adopted
        after a restart) go straight to the node."""
        node = self.node

        async def destroy(sandbox_id: str) -> None:
            try:
                await driver.release(sandbox_id)
            except NotFound:
                await node.destroy(sandbox_id)

        from dsec.api.sched_metrics import SchedulerCollector

        self.scheduler = driver
        self.metrics.registry.register(SchedulerCollector(driver))
        self.sandboxes.set_placement(driver.create, destroy, route=driver.route)
        self.sandboxes.preempted = driver.preempted
        self.sandboxes.forget_preempted = driver.forget_preempted
        driver.on_reaped = self.sandboxes.reaped

    async def start(self) -> None:
        await self.node.start()
        if self.scheduler is not None:
            await self.scheduler.start()
        self.audit.start()
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="dsec-housekeeping"))
        self._tasks.append(asyncio.create_task(self._loop_lag(), name="dsec-loop-lag"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        await self.sandboxes.flush()
        if self.scheduler is not None:
            await self.scheduler.close()
        await self.audit.close()
        await self.node.close()

    async def _housekeeping(self) -> None:
        while True:
            try:
                pruned = await self.sandboxes.reconcile()
                if pruned:
                    log.info("pruned audit of %d sandboxes past retention", pruned)
            except Exception:
                log.exception("housekeeping failed; retrying next interval")
            await asyncio.sleep(self.settings.api_prune_interval_s)

    async def _loop_lag(self) -> None:
        period = self.settings.api_loop_lag_probe_s
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(period)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - t0 - period))

    async def refresh_metrics(self) -> None:
        """Scrape-time gauges: live sandboxes by state and component counters."""
        counts: dict[str, int] = {}
        for info in await self.node.list():
            counts[info.state.value] = counts.get(info.state.value, 0) + 1
        self.metrics.set_states(counts, [s.value for s in SandboxState])
        for comp in (self.node, self.images):
            stats = getattr(comp, "stats", None)
            if callable(stats):
                try:
                    self.metrics.absorb_stats(stats())
                except Exception:
                    log.exception("stats() of %s failed", type(comp).__name__)
