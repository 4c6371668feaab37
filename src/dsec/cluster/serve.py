"""``dsec serve --cluster ray://HEAD:PORT`` (or DSEC_CLUSTER): the API over a Ray cluster.

One node agent actor per DSec node of the cluster (started if missing: detached,
pinned), a ``ClusterRouter`` under the API service (sandbox id -> node; quotas and
limits from the cluster view) and the scheduler driver over every node's proxy, with
each node's real layer index registered for image-aware placement.

Not yet over the cluster (a single-node server keeps them): image management routes
(images live per node), episode forks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dsec import errors
from dsec.config import Settings

log = logging.getLogger("dsec.cluster")


def _run(coro: Any) -> Any:
    from dsec.cluster.local import _run as run
    return run(coro)


def connect_router(settings: Settings) -> Any:
    """Join the cluster, start/find every node's agent, return a started-ready router."""
    from dsec.cluster.ray import connect, ensure_agents
    from dsec.cluster.router import ClusterRouter

    assert settings.cluster
    connect(settings.cluster)
    agents = _run(ensure_agents(timeout_s=settings.cluster_agent_timeout_s))
    if not agents:
        raise errors.InvalidArgument(f"the Ray cluster at {settings.cluster!r} has no DSec nodes: start them with "
                                     "`ray start ... --resources '{\"dsec_node_<ID>\": 1}'` or `dsec cluster up`",
                                     field="cluster")
    log.info("cluster %s: nodes %s", settings.cluster, ", ".join(sorted(agents)))
    return ClusterRouter(agents)


def build_cluster(settings: Settings) -> Any:
    """Services for ``dsec serve --cluster``: state here, sandboxes on the cluster's nodes."""
    from dsec.api.services import Services
    from dsec.state import state_for

    settings.home.mkdir(parents=True, exist_ok=True)
    router = connect_router(settings)
    # As on one machine: SQLite under HOME, or the Redis every API server shares (--state).
    state = state_for(settings.state_url, settings.home, settings.api_retry_after_s, settings.state_timeout_s)
    services = Services.build(settings, router, state, images=None)
    driver = scheduler(settings, router) if settings.api_scheduler else None
    if driver is not None:
        services.attach_scheduler(driver)
        if settings.image_registry:
            services.sandboxes.set_image_check(driver.images_catalog.prefetch)
        from dsec.api.server import attach_election
        attach_election(services)  # one placing leader among the API servers on this cluster
    if driver is not None and settings.image_prefetch_enabled and settings.image_registry:
        from dsec.cluster.prefetch import Prefetcher
        driver.prefetcher = Prefetcher(settings, router, driver)
        router.background.append(driver.prefetcher.run)
    joins = Membership(settings, router, driver)
    router.background.append(joins.run)
    beats = Heartbeats(settings, router, driver)
    router.heartbeats = beats  # GET /v1/nodes reads it
    if driver is not None and settings.cluster_restore_lost:
        from dsec.blobs import open_checkpoint_store
        from dsec.cluster.checkpoints import ClusterCheckpoints

        beats.recovery = LostRecovery(router, driver, ClusterCheckpoints(settings, open_checkpoint_store(settings),
                                                                         router), state.get_tenant)
    router.background.append(beats.run)
    return services


class Heartbeats:
    """The control plane's side of node liveness (see dsec.cluster.membership): probe every
    node agent each ``cluster_heartbeat_interval_s``; mark a node lost (its sandboxes answer
    410 at once, the scheduler releases their capacity and places elsewhere); when a lost
    node answers again, have it destroy what was given up, then make it ready."""

    def __init__(self, settings: Settings, router: Any, driver: Any | None) -> None:
        self.settings, self.router, self.driver = settings, router, driver
        self.last_ok: dict[str, float] = {}
        self.lost_at: dict[str, float] = {}  # node id -> time.time() it was marked lost
        self.detect_s: dict[str, float] = {}  # node id -> last good heartbeat -> marked lost (s)
        self.reconciled: dict[str, list[str]] = {}  # node id -> sandboxes it destroyed on coming back
        self.recovery: LostRecovery | None = None  # restores checkpointed sandboxes of a lost node
        self.episodes: Any = None  # dsec.cluster.episodes.ClusterEpisodes: resumes a lost node's episodes
        self._bg: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        took = 0.0
        while True:
            # A pass that waited on a silent node (up to the heartbeat timeout) already used
            # its interval: the next starts at once, so detection stays near lost_after.
            await asyncio.sleep(max(0.0, self.settings.cluster_heartbeat_interval_s - took))
            t0 = time.monotonic()
            try:
                await self.beat()
            except Exception:  # the next pass retries; serving goes on
                log.exception("node heartbeat pass failed")
            took = time.monotonic() - t0

    async def _ray_alive(self) -> dict[str, bool]:
        from dsec.cluster.ray import dsec_nodes

        try:
            nodes = await asyncio.wait_for(asyncio.to_thread(dsec_nodes), self.settings.cluster_heartbeat_timeout_s)
        except Exception:  # noqa: BLE001 - Ray's view unknown this pass: judge by heartbeats alone
            return {}
        return {nid: bool(n.get("Alive")) for nid, n in nodes.items()}

    async def _probe(self, agent: Any) -> bool:
        timeout = self.settings.cluster_heartbeat_timeout_s
        try:
            if hasattr(agent, "probe"):
                await agent.probe(timeout)
            else:
                await asyncio.wait_for(agent.health(), timeout)
            return True
        except Exception:  # noqa: BLE001 - any failure is a missed heartbeat
            return False

    async def beat(self) -> None:
        from dsec.cluster.membership import NodeState, is_lost

        agents = self.router.agents
        alive, oks = await asyncio.gather(self._ray_alive(),
                                          asyncio.gather(*(self._probe(a) for a in agents.values())))
        now = time.monotonic()
        for nid, ok in zip(agents, oks):
            self.last_ok.setdefault(nid, now)
            if ok:
                self.last_ok[nid] = now
            state = self.router.states.get(nid, NodeState.ready)
            if state is NodeState.lost:
                if ok and alive.get(nid) is not False:
                    await self._come_back(nid)
            elif is_lost(alive.get(nid), self.last_ok[nid], now, self.settings.cluster_node_lost_after_s):
                self._lose(nid, now)

    def _lose(self, nid: str, now: float) -> None:
        from dsec.cluster.membership import NodeState

        self.router.set_state(nid, NodeState.lost)
        agent = self.router.agents[nid]
        if hasattr(agent, "mark_lost"):
            agent.mark_lost()  # calls in flight end with NodeLost now
        gone = {sid for sid, n in self.router.where.items() if n == nid}
        owned: list[tuple[str, str]] = []  # (sandbox id, tenant name) of users' sandboxes there
        if self.driver is not None and nid in self.driver.sched.cluster.nodes:
            residents = list(self.driver.sched.residents.get(nid, {}).values())
            gone |= {r.sandbox_id for r in residents}
            owned = sorted((r.sandbox_id, r.tenant) for r in residents if not r.pool and r.tenant)
            self.driver.sched.node_lost(nid, self.driver.clock())  # capacity released, placed creates retried
            self.driver._wake.set()
        self.router.given_up[nid] = self.router.given_up.get(nid, set()) | gone
        self.lost_at[nid] = time.time()
        self.detect_s[nid] = round(now - self.last_ok[nid], 3)
        log.warning("node %s lost (no good heartbeat for %.1fs): %d sandboxes given up", nid, self.detect_s[nid],
                    len(gone))
        if self.episodes is not None:
            self.episodes.on_node_lost(nid)
        if self.recovery is not None and owned:
            task = asyncio.ensure_future(self.recovery.run(nid, owned))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _come_back(self, nid: str) -> None:
        """Reconcile: destroy what the control plane gave up (the clients were told 410),
        account what else it holds, then it takes placements again."""
        from dsec.cluster.membership import NodeState

        agent = self.router.agents[nid]
        if hasattr(agent, "mark_back"):
            agent.mark_back()
        give = set(self.router.given_up.get(nid, set()))
        destroyed = []
        for info in await agent.list():
            if info.id in give:
                try:
                    await agent.destroy(info.id)
                except errors.NotFound:
                    pass
                destroyed.append(info.id)
        self.router.given_up.pop(nid, None)
        # Only its own entries: a given-up sandbox restored elsewhere keeps its new place.
        self.router.where = {s: n for s, n in self.router.where.items() if not (s in give and n == nid)}
        if self.driver is not None and nid in self.driver.sched.cluster.nodes:
            await self.driver._adopt(nid, agent)
            self.driver.sched.set_node_health(nid, True)
            self.driver._wake.set()
        self.router.set_state(nid, NodeState.ready)
        self.reconciled[nid] = sorted(destroyed)
        self.last_ok[nid] = time.monotonic()
        log.warning("node %s is back: destroyed %d given-up sandboxes, ready again", nid, len(destroyed))


def layer_changes(before: set[str], now: set[str]) -> tuple[list[str], list[str]]:
    """(added, removed) between two looks at one node's layer index (pure)."""
    return sorted(now - before), sorted(before - now)


class Membership:
    """Picks up DSec nodes that join the Ray cluster after the server started: starts
    their agent, adds them to the router and (with their layer index) to the scheduler.
    Every ``cluster_layer_sync_interval_s`` it also re-reads each node's layer index, so
    the scheduler's layer coverage follows what the nodes really hold (``sync_layers``)."""

    def __init__(self, settings: Settings, router: Any, driver: Any | None) -> None:
        self.settings, self.router, self.driver = settings, router, driver
        self.seen: dict[str, set[str]] = {}  # node -> layers its index showed at the last look
        self._synced = time.monotonic()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cluster_membership_interval_s)
            try:
                await self.refresh()
                if time.monotonic() - self._synced >= self.settings.cluster_layer_sync_interval_s:
                    self._synced = time.monotonic()
                    await self.sync_layers()
            except Exception:  # the next pass retries; serving goes on
                log.exception("looking for new cluster nodes failed")

    async def sync_layers(self) -> dict[str, tuple[list[str], list[str]]]:
        """Apply to the scheduler what each node's own layer index shows changed since the
        last look: a layer the node no longer holds (the cluster GC removed its image) stops
        counting for placement there; one it got (a pull, a peer fetch) counts. Only changes
        the node itself shows: a placement's optimistic addition (the node pulls on create)
        is never undone before the node had it. Returns node -> (added, removed)."""
        if self.driver is None:
            return {}
        sched = self.driver.sched
        out: dict[str, tuple[list[str], list[str]]] = {}
        for nid, agent in list(self.router.agents.items()):
            if nid not in sched.cluster.nodes:
                continue
            try:
                have = (await agent.layer_index()).digests()
            except Exception:  # noqa: BLE001, S112 - unreachable now: judged at the next look
                continue
            before = self.seen.get(nid)
            self.seen[nid] = have
            if before is None:
                continue
            added, removed = layer_changes(before, have)
            if added or removed:
                sched.layers_changed(nid, added, removed)
                out[nid] = (added, removed)
                log.info("node %s layers: +%d -%d (scheduler coverage updated)", nid, len(added), len(removed))
        return out

    async def refresh(self) -> list[str]:
        from dsec.cluster.ray import RayNodeProxy, dsec_nodes, ensure_agent

        nodes = await asyncio.to_thread(dsec_nodes)
        added = []
        for nid in sorted(n for n, info in nodes.items() if info.get("Alive") and n not in self.router.agents):
            proxy = RayNodeProxy(nid, await asyncio.to_thread(ensure_agent, nid),
                                 self.settings.cluster_agent_timeout_s)
            await proxy.start()
            index = await proxy.layer_index()
            if self.driver is not None:  # placeable from now on, its images known
                cap = proxy.capacity()
                self.driver.sched.upsert_node(nid, cap.cpu, cap.memory, cap.disk, max_sandboxes=cap.max_sandboxes,
                                              isolation=tuple(cap.isolation), gpus=cap.gpus, labels=cap.labels,
                                              layers=index.digests())
                self.seen[nid] = index.digests()  # sync_layers' first look
                self.driver.agents = {**self.driver.agents, nid: proxy}
                catalog = getattr(self.driver, "images_catalog", None)
                if catalog is not None:
                    catalog.add(index)
            self.router.add_node(nid, proxy)
            added.append(nid)
            log.info("node %s joined the cluster", nid)
        return added


class ImageCatalog:
    """image ref -> (layers, image id) from the nodes' layer indexes: the scheduler's
    image resolver (it registers an image's layers on first sight). An image no node
    holds is looked up in ``image_registry`` (its manifest only): the scheduler then
    places it like any image, scoring nodes by the bytes they miss, and the node it
    picks pulls the layers (peers first) before creating."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings
        self.by_name: dict[str, tuple[list[tuple[str, int]], str]] = {}

    def add(self, index: Any) -> None:
        for img in index.images:
            for name in img.names:
                for ref in (name, name.removesuffix(":latest")):
                    self.by_name.setdefault(ref, ([tuple(x) for x in img.layers], img.image_id))  # type: ignore[misc]

    async def prefetch(self, ref: str) -> None:
        """The API's image check, before the request is queued: an image no node holds
        is looked up in the registry in a worker thread, so the scheduler's (synchronous)
        lookup finds it cached instead of blocking the event loop on the registry's HTTP.
        NotFound naming the image when neither the nodes nor the registry have it."""
        if ref not in self.by_name:
            await asyncio.to_thread(self, ref)

    def __call__(self, ref: str) -> tuple[list[tuple[str, int]], str]:
        hit = self.by_name.get(ref)
        if hit is None and self.settings is not None:
            from dsec.images.registry_ops import remote_layers
            try:
                found = remote_layers(self.settings, ref)
            except errors.NotFound:
                found = None
            if found is not None:
                hit = self.by_name.setdefault(ref, found)
        if hit is None:
            where = f" nor in registry {self.settings.image_registry}" if self.settings and \
                self.settings.image_registry else ""
            raise errors.NotFound(f"image {ref!r} is on no node of the cluster{where}; import it on a node "
                                  "or push it to the registry (image_registry)", image=ref)
        return hit


def scheduler(settings: Settings, router: Any) -> Any:
    """The control plane over every node: image-aware (each node's real layer index)."""
    from dsec.control.driver import SchedulerDriver
    from dsec.control.scheduler import Scheduler

    indexes = _run(router.layer_indexes())
    catalog = ImageCatalog(settings)
    for idx in indexes.values():
        catalog.add(idx)
    sched = Scheduler(settings)
    for nid, agent in router.agents.items():  # where each image's layers already are
        cap = agent.capacity()
        sched.upsert_node(nid, cap.cpu, cap.memory, cap.disk, max_sandboxes=cap.max_sandboxes,
                          isolation=tuple(cap.isolation), gpus=cap.gpus, labels=cap.labels,
                          layers=indexes[nid].digests())
    driver = SchedulerDriver(sched, router.agents, settings, image_resolver=catalog)
    driver.images_catalog = catalog  # type: ignore[attr-defined]  # grown by Membership
    return driver


class LostRecovery:
    """Sandboxes of a lost node that have a checkpoint come back on another node: the
    latest checkpoint is restored through the scheduler (queued, placed, accounted like
    any create) under the SAME sandbox id, so clients that got 410 meanwhile find it
    again. Sandboxes without a checkpoint stay lost (410). Files are the checkpoint's;
    what ran after it is not replayed."""

    def __init__(self, router: Any, driver: Any, checkpoints: Any, get_tenant: Any) -> None:
        self.router, self.driver, self.checkpoints, self.get_tenant = router, driver, checkpoints, get_tenant
        self.restored: dict[str, dict[str, str]] = {}  # node id -> {sandbox id: new node}

    async def run(self, nid: str, owned: list[tuple[str, str]]) -> None:
        from dsec.cluster.checkpoints import RestoreCreator
        from dsec.models import SandboxSpec
        from dsec.node.api import RestoreSource

        for sid, tenant in owned:
            try:
                rec = await self.get_tenant(tenant)
                if rec is None:
                    continue
                cks = await self.checkpoints.list(rec.uid, sid)
                if not cks:
                    continue
                ck = max(cks, key=lambda c: c.created_at)
                meta = await self.checkpoints.load(rec.uid, ck.id)
                spec = SandboxSpec.model_validate(meta.spec).model_copy(update={"request_id": f"recover-{ck.id}"})
                info = await self.driver.create(spec, sid, tenant, via=RestoreCreator(
                    self.router, RestoreSource(tenant=rec.uid, checkpoint_id=ck.id)))
            except errors.DSecError as e:
                log.error("restoring %s (lost with node %s) failed: %s", sid, nid, e.message)
                continue
            self.router.where[sid] = info.node or ""
            self.restored.setdefault(nid, {})[sid] = info.node or ""
            log.warning("sandbox %s (lost with node %s) restored on %s from checkpoint %s", sid, nid, info.node,
                        ck.id)
