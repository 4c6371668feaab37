"""Episodes under ``dsec serve --cluster``: placed by the scheduler, run on a node, resumed
on another node when theirs is lost.

An episode's steps and their fs capture run on the node that holds its sandbox (each
node's own engine, dsec.checkpoints.node_episodes; units in the SHARED checkpoint store).
This is the control plane's side, with the engine's interface for the episode routes:

- ``open`` places the episode like any create (tenant admission and quotas, the
  scheduler's queue and capacity: ``SandboxService.create_as`` with an ``EpisodeOpener``
  that the driver runs on the node it picked), under a sandbox id chosen here; an episode
  already running on a live node is re-opened there (new owner epoch).
- Every other call goes to the episode's node.
- Node lost (the heartbeat's judgement): each of its episodes is opened again through the
  scheduler on another node, at once, without waiting for its client. That node restores
  it from its newest complete unit; the log decides what ran, so nothing executes twice:
  a step that was in flight at the loss is retried here under the same step index, and
  comes back either as the logged result (it was committed before the loss) or runs live
  once (it was not). The client keeps its epoch: the control plane maps it to the new
  node's epoch (the move took a new owner epoch in the store, so the old node, if it
  still runs, is fenced at its next unit).

Limits: the episode -> node map lives in this API server's memory (one control plane per
cluster; a restarted server finds an episode again on the client's next open, from its
units); a sandbox a node replaces mid-episode (after a failed unit) is not re-accounted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from dsec import errors
from dsec.checkpoints import owners
from dsec.checkpoints.host import EPISODE_TENANT
from dsec.cluster.membership import NodeState, placeable
from dsec.cluster.router import least_loaded
from dsec.ids import new_sandbox_id
from dsec.models import ExecRequest, SandboxInfo, SandboxSpec
from dsec.models.episode import CheckpointRef, EpisodeInfo, StepResult

log = logging.getLogger("dsec.cluster")


class EpisodeOpener:
    """A create that opens (or resumes) an episode on the node the scheduler placed it on
    (the driver calls ``build_on`` with that node's agent). Called directly (a server
    without the scheduler) it opens on the router's least-loaded ready node."""

    def __init__(self, router: Any, key: str, spec: SandboxSpec | None) -> None:
        self.router, self.key, self.spec = router, key, spec
        self.episode: EpisodeInfo | None = None
        self.node = ""

    async def build_on(self, node_id: str, agent: Any, spec: SandboxSpec, sandbox_id: str,
                       tenant: str, fence: int | None = None) -> SandboxInfo:
        """``fence``: the scheduler leader's token (a deposed leader's open is refused)."""
        out = await agent.episode("open", self.key, {
            "spec": self.spec.model_dump(mode="json") if self.spec is not None else None,
            "sandbox_id": sandbox_id or None, "tenant": tenant or None, "fence": fence})
        self.episode, self.node = out["episode"], node_id
        sandbox: SandboxInfo = out["sandbox"]
        return sandbox

    async def __call__(self, spec: SandboxSpec, sandbox_id: str, tenant: str) -> SandboxInfo:
        counts = {n: 0 for n in self.router.agents if placeable(self.router.states.get(n, NodeState.ready))}
        if not counts:
            raise errors.CapacityExhausted("no node of the cluster is ready (all lost or draining)", retry_after=5.0)
        nid = least_loaded(counts)
        return await self.build_on(nid, self.router.agents[nid], spec, sandbox_id, tenant)

    def release(self) -> None:
        """Nothing is held before the node opens it."""


class ClusterEpisodes:
    """``EpisodeEngine``'s route-facing interface over the cluster (see module docstring)."""

    def __init__(self, settings: Any, store: Any, router: Any, services: Any) -> None:
        self.settings, self.store, self.router, self.services = settings, store, router, services
        self.where: dict[str, str] = {}  # episode key -> node id
        self.sandbox: dict[str, str] = {}  # episode key -> the sandbox id it is accounted under
        self.tenants: dict[str, Any] = {}  # episode key -> TenantRecord (moves run outside requests)
        self.client_epoch: dict[str, int] = {}  # the epoch its client got from its last open
        self.node_epoch: dict[str, int] = {}  # the epoch its node's engine holds
        self.moves: dict[str, asyncio.Future[None]] = {}  # key -> move after a node loss, in progress
        self.moved: dict[str, dict[str, Any]] = {}  # key -> {from, to, seconds} of its last move
        self._locks: dict[str, asyncio.Lock] = {}

    # --- placement ------------------------------------------------------------------------
    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _logged_spec(self, key: str) -> SandboxSpec | None:
        """The spec the episode's newest restorable unit records (what a resume builds)."""
        units = await asyncio.to_thread(owners.restorable, self.store, key)
        return SandboxSpec.model_validate(units[0].spec) if units else None

    async def _place(self, key: str, spec: SandboxSpec | None, tenant: Any) -> EpisodeInfo:
        """Open ``key`` on the node the scheduler picks, admitted and accounted like a create."""
        shape = spec or await self._logged_spec(key) or SandboxSpec()
        opener = EpisodeOpener(self.router, key, spec)
        # A fresh request id: the sandbox id keys the placement (an old one would answer
        # with the sandbox that died with its node).
        await self.services.sandboxes.create_as(tenant, shape.model_copy(update={"request_id": None}),
                                                new_sandbox_id(), opener)
        ep = opener.episode
        assert ep is not None and ep.sandbox_id
        self.where[key], self.sandbox[key], self.node_epoch[key] = opener.node, ep.sandbox_id, ep.epoch
        self.tenants[key] = tenant
        return ep

    def _agent(self, key: str) -> tuple[str, Any]:
        nid = self.where.get(key)
        if nid is None:
            raise errors.NotFound(f"episode {key.split('--', 1)[-1]!r} is not open on this server; open it first "
                                  "(Episode.open resumes it from its checkpoints)", episode_id=key)
        return nid, self.router.agents[nid]

    # --- node loss ------------------------------------------------------------------------
    def on_node_lost(self, nid: str) -> None:
        """Heartbeat hook: open every episode of ``nid`` again elsewhere, now."""
        for key in [k for k, n in self.where.items() if n == nid]:
            if key in self.moves:
                continue
            fut = asyncio.ensure_future(self._move(key, nid))
            self.moves[key] = fut
            fut.add_done_callback(lambda f, k=key: self.moves.pop(k, None) if self.moves.get(k) is f else None)

    async def _move(self, key: str, nid: str) -> None:
        t0 = time.monotonic()
        async with self._lock(key):
            if self.where.get(key) != nid:
                return  # already re-opened elsewhere (its client's open got there first)
            old = self.sandbox.pop(key, None)
            if old is not None:  # given up with its node (destroyed there when it comes back)
                await self.services.sandboxes.reaped(old, f"node {nid} lost; episode moved to another node")
            try:
                await self._place(key, None, self.tenants[key])
            except errors.DSecError as e:
                log.error("episode %s (lost with node %s) could not be resumed elsewhere: %s", key, nid, e.message)
                self.moved[key] = {"from": nid, "to": None, "error": e.message}
                return
        self.moved[key] = {"from": nid, "to": self.where[key], "seconds": round(time.monotonic() - t0, 3)}
        log.warning("episode %s (lost with node %s) resumed on %s in %.2fs", key, nid, self.where[key],
                    time.monotonic() - t0)

    async def _after_loss(self, key: str, nid: str) -> None:
        """A call to ``nid`` ended with NodeLost: wait for the episode's move (started by the
        heartbeat that judged the node lost, which may still be on its way); NodeLost when
        the move failed or none finished in time."""
        s = self.settings
        deadline = time.monotonic() + s.cluster_node_lost_after_s + 2 * s.cluster_heartbeat_timeout_s + \
            s.api_create_wait_s
        name = key.split("--", 1)[-1]
        while self.where.get(key) == nid:
            if time.monotonic() > deadline:
                raise errors.NodeLost(f"episode {name!r}: node {nid} does not answer and the episode could not be "
                                      "resumed elsewhere yet; open it again", node=nid)
            fut = self.moves.get(key)
            if fut is not None:
                await asyncio.shield(fut)
                continue
            if self.router.states.get(nid) is NodeState.lost:
                last = self.moved.get(key, {})
                if last.get("from") == nid and last.get("to") is None:  # tried, and it failed
                    raise errors.NodeLost(f"episode {name!r}: node {nid} lost and resuming it elsewhere failed: "
                                          f"{last.get('error')}; open it again", node=nid)
                self.on_node_lost(nid)  # judged lost before this episode was tracked there
                continue
            await asyncio.sleep(0.1)

    async def _forward(self, key: str, op: str, args: dict[str, Any], epoch: int | None = None,
                       fenced: bool = True) -> Any:
        """``op`` on the episode's node; after a node loss, once more on its new node (the
        same call: a step keeps its index, so the log makes it run at most once)."""
        if fenced and epoch is not None:
            owners.check_fence(key, epoch, self.client_epoch.get(key, epoch))
        for attempt in (0, 1):
            nid, agent = self._agent(key)
            if self.router.states.get(nid) is NodeState.lost or key in self.moves:
                await self._after_loss(key, nid)
                nid, agent = self._agent(key)
            try:
                return await agent.episode(op, key, {**args, "epoch": self.node_epoch.get(key)} if fenced else args)
            except errors.NodeLost:
                if attempt:
                    raise
                await self._after_loss(key, nid)
        raise AssertionError("unreachable")

    # --- the engine's interface (dsec.api.episodes) ------------------------------------------
    async def open(self, key: str, spec: SandboxSpec | None = None) -> EpisodeInfo:
        tenant = EPISODE_TENANT.get()
        async with self._lock(key):
            nid = self.where.get(key)
            if nid is not None and self.router.states.get(nid) is not NodeState.lost:
                try:
                    out = await self.router.agents[nid].episode(
                        "open", key, {"sandbox_id": new_sandbox_id(), "tenant": getattr(tenant, "name", None)})
                    ep: EpisodeInfo = out["episode"]
                except errors.NodeLost:
                    ep = await self._place(key, spec, tenant)
            else:
                ep = await self._place(key, spec, tenant)
            self.node_epoch[key] = self.client_epoch[key] = ep.epoch
            self.tenants[key] = tenant
            return ep

    async def step(self, key: str, step: int, req: ExecRequest, epoch: int | None = None) -> StepResult:
        res: StepResult = await self._forward(key, "step", {"step": step, "request": req}, epoch)
        return res

    async def save_context(self, key: str, context: object, epoch: int | None = None) -> CheckpointRef:
        ref: CheckpointRef = await self._forward(key, "save_context", {"context": context}, epoch)
        return ref

    async def context(self, key: str) -> object | None:
        return await self._forward(key, "context", {}, fenced=False)

    async def checkpoint(self, key: str, weights_ref: str | None = None, meta: dict[str, Any] | None = None,
                         epoch: int | None = None) -> CheckpointRef:
        ref: CheckpointRef = await self._forward(key, "checkpoint", {"weights_ref": weights_ref, "meta": meta},
                                                 epoch)
        return ref

    async def resume(self, key: str) -> EpisodeInfo:
        if key not in self.where:
            return await self.open(key)
        info: EpisodeInfo = await self._forward(key, "resume", {}, fenced=False)
        return info.model_copy(update={"epoch": self.client_epoch.get(key, info.epoch)})

    async def info(self, key: str) -> EpisodeInfo:
        info: EpisodeInfo = await self._forward(key, "info", {}, fenced=False)
        return info.model_copy(update={"epoch": self.client_epoch.get(key, info.epoch)})

    def export(self, key: str) -> bytes:
        from dsec.checkpoints.engine import EpisodeEngine
        return EpisodeEngine.export_from(self.store, key)

    async def close(self, key: str, epoch: int | None = None) -> None:
        if key not in self.where:
            return
        if epoch is not None:  # a stale owner's close must not take the new owner's sandbox away
            owners.check_fence(key, epoch, self.client_epoch.get(key, epoch))
        async with self._lock(key):
            nid = self.where[key]
            if self.router.states.get(nid) is not NodeState.lost:
                await self.router.agents[nid].episode("close", key, {"epoch": self.node_epoch.get(key)})
            sid = self.sandbox.pop(key, None)
            for d in (self.where, self.tenants, self.client_epoch, self.node_epoch):
                d.pop(key, None)
            if sid is not None:  # destroyed by the node's engine: free its place and record it
                driver = self.services.scheduler
                if driver is not None:
                    driver.sched.on_released(sid, driver.clock())
                    driver._wake.set()
                await self.services.sandboxes.reaped(sid, "episode closed")

    async def purge(self, key_prefix: str) -> int:
        """A removed tenant's episodes: close the open ones, destroy what their markers name,
        delete their keys (parts are left to garbage collection, as on one node)."""
        if not key_prefix or "/" in key_prefix:
            raise errors.InvalidArgument(f"refusing to purge episodes with prefix {key_prefix!r}")
        for key in [k for k in self.where if k.startswith(key_prefix)]:
            try:
                await self.close(key)
            except errors.DSecError as e:
                log.warning("closing episode %s of a removed tenant: %s", key, e.message)
        keys = await asyncio.to_thread(self.store.list, f"episodes/{key_prefix}")
        for key in keys:
            parts = key.split("/")
            if len(parts) == 4 and parts[2] == "sandboxes":
                try:
                    await self.router.destroy(parts[3])
                except errors.DSecError:
                    pass
        for key in keys:
            await asyncio.to_thread(self.store.delete, key)
        return len({k.split("/")[1] for k in keys})
