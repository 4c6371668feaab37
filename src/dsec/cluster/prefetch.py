"""Image prefetch on a cluster: the scheduler leader's executor of
``dsec.control.prefetch`` (the decisions are there, pure).

Every ``image_prefetch_interval_s``, on the leader only (a follower decides nothing):

1. popular images from the driver's ``ImageDemand`` (creates per image in the window);
   none: nothing else is done this pass;
2. every ready node's layer index (``NodeAgent.layer_index``): the real layers each
   holds (the scheduler's view is synced to it, both ways: a layer the cluster GC
   dropped is no longer counted as there) and each image's recorded access order;
3. ``plan``: for each popular image in ``image_registry``, the nodes the scheduler ranks
   first for its last requested shape (``image_prefetch_nodes``), those lacking layers;
4. each job is one ``prefetch`` call to that node (``NodePeers.admin``), which pulls the
   image through the very path a create's pull takes (peers first, digest verified,
   single flight per blob, one of the node's ``node_max_concurrent_pulls`` transfer slots
   at most, waiting while a create's pull runs), registers it under the name creates use
   and unpacks it. Done: the scheduler counts the node as holding the layers, so its
   score (and the warm-pool builder, which places members with the same score) now
   prefers it.

GC: a prefetch is a fetch like any other, so it counts as "asked for" for the cluster
GC's 24 h rule (``image_gc_unused_s``) from that moment; it does not renew that mark
afterwards. A prefetched image nobody uses is dropped by the GC like any other; the
prefetcher only refills it while the image stays popular (which means creates use it,
so the GC keeps it anyway), at most once per ``image_prefetch_retry_s`` per node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dsec.config import Settings
from dsec.control.placement import OursPolicy
from dsec.control.prefetch import PrefetchJob, likely_nodes, plan, popular, probe_request

log = logging.getLogger("dsec.cluster.prefetch")


class Prefetcher:
    def __init__(self, settings: Settings, router: Any, driver: Any) -> None:
        self.s, self.router, self.driver = settings, router, driver
        self.busy: dict[str, str] = {}  # node -> image being prefetched there
        self.tried: dict[tuple[str, str], float] = {}  # (node, image) -> when (monotonic) a job started
        self.access: dict[str, list[str]] = {}  # image name -> layer digests in first-demand order
        self.results: list[dict[str, Any]] = []  # the last jobs' outcomes (tests, logs)
        self.last_pass: dict[str, Any] = {}  # what the last pass saw (GET /v1/scheduler -> prefetch)
        self.stats = {"passes": 0, "jobs": 0, "done": 0, "failed": 0, "skipped": 0, "bytes": 0}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.s.image_prefetch_interval_s)
            try:
                if self.driver.leading():
                    await self.pass_once()
            except Exception:  # the next pass retries; serving goes on
                log.exception("image prefetch pass failed")

    async def pass_once(self) -> list[PrefetchJob]:
        """One pass (see module docstring); returns the jobs it started."""
        from dsec.images.registry_ops import pull_source

        s, sched = self.s, self.driver.sched
        self.stats["passes"] += 1
        now = self.driver.clock()
        hot = [name for name in popular(self.driver.image_demand.counts(now), s.image_prefetch_top_images,
                                        s.image_prefetch_min_creates)
               if pull_source(name, s.image_registry, True) is not None]
        room = s.image_prefetch_max_inflight - len(self.busy)
        self.last_pass = {"popular": hot, "likely": {}}
        if not hot or room <= 0:
            return []
        await self.refresh()
        policy = sched.policy if isinstance(sched.policy, OursPolicy) else OursPolicy(s)
        likely = {}
        for name in hot:
            image, last = sched.images.get(name), self.driver.image_demand.last.get(name)
            if image is not None and last is not None:
                likely[name] = likely_nodes(policy, probe_request(last), image, sched.cluster,
                                            s.image_prefetch_nodes)
        self.tried = {k: t for k, t in self.tried.items() if now - t < s.image_prefetch_retry_s}
        jobs = plan(hot, sched.images, likely, self.access, self.busy, self.tried, room)
        self.last_pass["likely"] = {name: [n.node_id for n in nodes] for name, nodes in likely.items()}
        for job in jobs:
            self.busy[job.node] = job.image
            self.tried[(job.node, job.image)] = now
            self.stats["jobs"] += 1
            task = asyncio.ensure_future(self._run(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return jobs

    async def refresh(self) -> None:
        """Every ready node's real layer index: the scheduler's view of its layers, and each
        image's first-demand order (the longest any node recorded)."""
        sched = self.driver.sched
        nodes = {nid: a for nid, a in self.router.agents.items()
                 if nid in sched.cluster.nodes and sched.cluster.nodes[nid].healthy}

        async def one(agent: Any) -> Any:
            try:
                return await agent.layer_index()
            except Exception:  # noqa: BLE001 - a node that cannot answer keeps its last view
                return None

        # What the scheduler believed before asking: a create that lands while the indexes
        # are read adds its image's layers, and an index read before it must not undo that.
        believed = {nid: set(sched.cluster.nodes[nid].layers) for nid in nodes}
        indexes = await asyncio.gather(*(one(a) for a in nodes.values()))
        for nid, index in zip(nodes, indexes):
            if index is None or nid not in sched.cluster.nodes:
                continue
            node = sched.cluster.nodes[nid]
            have = index.digests()
            if nid not in self.busy:  # a prefetch there may be mid-way: judged next pass
                sched.layers_changed(nid, sorted(have - node.layers), sorted((believed[nid] & node.layers) - have))
            for img in index.images:
                for name in img.names:
                    for ref in (name, name.removesuffix(":latest")):
                        if len(img.access_order) > len(self.access.get(ref, ())):
                            self.access[ref] = list(img.access_order)

    async def _run(self, job: PrefetchJob) -> None:
        agent = self.router.agents.get(job.node)
        t0 = time.monotonic()
        out: dict[str, Any] = {"node": job.node, "image": job.image, "layers": len(job.layers),
                               "bytes_planned": job.bytes}
        try:
            if agent is None or not hasattr(agent, "p2p_admin"):
                raise RuntimeError(f"node {job.node} has no image operations (not a Ray node agent)")
            res = await agent.p2p_admin("prefetch", {"ref": job.image, "order": job.layers})
            out.update(skipped=res.get("skipped", ""), seconds=round(time.monotonic() - t0, 3))
            status = res.get("status") or {}
            fetched = sum(v for k, v in (status.get("sources") or {}).items() if k != "local")
            out["bytes_fetched"] = fetched
            if res.get("skipped"):
                self.stats["skipped"] += 1
            else:
                self.stats["done"] += 1
                self.stats["bytes"] += fetched
            image = self.driver.sched.images.get(job.image)
            if image is not None and job.node in self.driver.sched.cluster.nodes and not res.get("skipped"):
                # The node holds the image now: the scheduler's score (and the pool builder) sees it.
                self.driver.sched.layers_changed(job.node, [d for d, _ in image.layers])
                self.driver._wake.set()
            log.info("prefetched %s onto node %s: %d bytes fetched in %.2fs%s", job.image, job.node, fetched,
                     out["seconds"], f" (skipped: {res['skipped']})" if res.get("skipped") else "")
        except Exception as e:  # noqa: BLE001 - logged; retried after image_prefetch_retry_s
            self.stats["failed"] += 1
            out["error"] = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            log.warning("prefetching %s onto node %s failed: %s", job.image, job.node, out["error"])
        finally:
            self.busy.pop(job.node, None)
            self.results = (self.results + [out])[-50:]
