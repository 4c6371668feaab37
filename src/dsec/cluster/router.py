"""ClusterRouter: many node agents behind one ``NodeAgent``, for the API service.

The API service (tenancy, quotas, audit) talks to ONE ``NodeAgent``; on a cluster that is
this router: node id -> agent, sandbox id -> node. Per-sandbox calls go to the node that
holds the sandbox (learned from every create/list answer, which name their node in
``SandboxInfo.node``; an id it has not seen is looked up on every node once). Views are
the cluster's: ``list`` merges every node's list (tenant quotas count sandboxes
cluster-wide), ``capacity`` is what one sandbox may ask for on the largest READY node (a
sandbox never spans nodes; lost and draining nodes take none) with the ready nodes'
total sandbox count as its cap, ``ready_capacities`` each ready node's own.

Placement is the scheduler driver's (it gets ``agents``, one entry per node); the
router's own ``create`` (a server without the scheduler) spreads by fewest sandboxes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from dsec import errors
from dsec.cluster.membership import NodeState, check_transition, placeable
from dsec.models import ExecRequest, SandboxInfo, SandboxSpec
from dsec.node.api import (
    ImageLayers,
    LayerIndex,
    NodeAgent,
    NodeCapacity,
    NodeHealth,
    NodeUsage,
    RestoreSource,
)

CLUSTER_NODE_ID = "cluster"
log = logging.getLogger("dsec.cluster")


def cluster_capacity(caps: list[NodeCapacity]) -> NodeCapacity:
    """The limits a single sandbox meets on this cluster (pure): the largest node's
    cpu/memory/disk, every isolation some node offers, the sum of sandbox caps."""
    if not caps:
        raise errors.CapacityExhausted("the cluster has no nodes (start them with `dsec cluster up` or "
                                       "`ray start` with a dsec_node_<ID> resource)", retry_after=5.0)
    return NodeCapacity(node_id=CLUSTER_NODE_ID, cpu=max(c.cpu for c in caps), memory=max(c.memory for c in caps),
                        disk=max(c.disk for c in caps), max_sandboxes=sum(c.max_sandboxes for c in caps),
                        isolation=sorted({i for c in caps for i in c.isolation}))


def least_loaded(counts: Mapping[str, int]) -> str:
    """The node with the fewest sandboxes (ties: lowest id) — the fallback spread (pure)."""
    return min(sorted(counts), key=lambda n: counts[n])


class ClusterRouter:
    """``NodeAgent`` over several node agents (see module docstring)."""

    def __init__(self, agents: Mapping[str, NodeAgent]) -> None:
        self.node_id = CLUSTER_NODE_ID
        self.agents: dict[str, NodeAgent] = dict(agents)
        self.where: dict[str, str] = {}  # sandbox id -> node id
        # ready / draining / lost (dsec.cluster.membership); the heartbeat loop moves them.
        self.states: dict[str, NodeState] = {n: NodeState.ready for n in self.agents}
        # Sandboxes the control plane gave up when their node was lost (node id -> ids):
        # a node that comes back destroys them before it is ready again.
        self.given_up: dict[str, set[str]] = {}
        self.heartbeats: Any = None  # dsec.cluster.serve.Heartbeats under `dsec serve --cluster`
        self._started_at = 0.0
        # Loops that live as long as the router (e.g. picking up nodes that join).
        self.background: list[Callable[[], Awaitable[None]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        for nid, agent in self.agents.items():
            self._watch(nid, agent)

    def node_view(self) -> list[dict[str, Any]]:
        """Each node's state as the control plane sees it (GET /v1/nodes)."""
        hb = self.heartbeats
        now = time.monotonic()
        out = []
        for nid in sorted(self.agents):
            last = hb.last_ok.get(nid) if hb is not None else None
            out.append({"id": nid, "state": self.states.get(nid, NodeState.ready).value,
                        "sandboxes": sum(1 for n in self.where.values() if n == nid),
                        "given_up": len(self.given_up.get(nid, ())),
                        "last_heartbeat_age_s": round(now - last, 3) if last is not None else None,
                        "lost_at": hb.lost_at.get(nid) if hb is not None else None,
                        "lost_detect_s": hb.detect_s.get(nid) if hb is not None else None,
                        "reconciled": hb.reconciled.get(nid, []) if hb is not None else [],
                        "restored": (hb.recovery.restored.get(nid, {}) if hb is not None and hb.recovery is not None
                                     else {})})
        return out

    # --- routing ------------------------------------------------------------------------
    def _learn(self, info: SandboxInfo, node_id: str) -> SandboxInfo:
        self.where[info.id] = info.node or node_id
        return info

    def _watch(self, node_id: str, agent: NodeAgent) -> None:
        """Learn placements the scheduler driver makes on the agent directly (it holds the
        same agents): the first exec of a new sandbox then goes straight to its node instead
        of asking every node where it is (agents without the hook: asked once, as before)."""
        if hasattr(agent, "on_placed"):
            agent.on_placed = lambda info, n=node_id: self._learn(info, n)  # type: ignore[attr-defined]

    def add_node(self, node_id: str, agent: NodeAgent) -> None:
        """A node that joined: the map is rebound, never mutated, so a call iterating the
        old one (a cluster-wide list) finishes on the nodes it started with."""
        self._watch(node_id, agent)
        self.agents = {**self.agents, node_id: agent}
        self.states = {**self.states, node_id: NodeState.ready}

    def set_state(self, node_id: str, target: NodeState) -> NodeState:
        """Move a node along the transition table (Conflict naming it otherwise)."""
        if node_id not in self.agents:
            raise errors.NotFound(f"node {node_id!r} is not a node of this cluster (nodes: "
                                  f"{', '.join(sorted(self.agents)) or 'none'})", node=node_id)
        current = self.states.get(node_id, NodeState.ready)
        if current is not target:
            check_transition(node_id, current, target)
            self.states = {**self.states, node_id: target}
        return current

    def live_agents(self) -> dict[str, NodeAgent]:
        """Nodes that are not lost (a lost node's calls would only answer NodeLost)."""
        return {n: a for n, a in self.agents.items() if self.states.get(n) is not NodeState.lost}

    def _check_reachable(self, node_id: str, sandbox_id: str) -> None:
        if self.states.get(node_id) is NodeState.lost:
            raise errors.NodeLost(f"sandbox {sandbox_id}: node lost ({node_id} stopped answering heartbeats); "
                                  "create a new sandbox or restore a checkpoint", node=node_id, sandbox_id=sandbox_id)

    async def node_of(self, sandbox_id: str) -> str:
        nid = self.where.get(sandbox_id)
        if nid is not None and nid in self.agents:
            self._check_reachable(nid, sandbox_id)
            return nid
        for n, ids in self.given_up.items():
            if sandbox_id in ids:
                self._check_reachable(n, sandbox_id)

        async def probe(n: str, a: NodeAgent) -> str | None:
            try:
                await a.get(sandbox_id)
                return n
            except errors.NotFound:
                return None

        live = self.live_agents()
        for found in await asyncio.gather(*(probe(n, a) for n, a in live.items()), return_exceptions=True):
            if isinstance(found, str):
                self.where[sandbox_id] = found
                return found
        raise errors.NotFound(f"sandbox {sandbox_id} not found on any node of the cluster", sandbox_id=sandbox_id)

    async def _on(self, sandbox_id: str) -> NodeAgent:
        return self.agents[await self.node_of(sandbox_id)]

    # --- the node(s) --------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(a.start() for a in self.agents.values()))
        self._started_at = time.time()
        await self.list()  # learn where every existing sandbox lives
        self._tasks = [asyncio.create_task(loop(), name="dsec-cluster-bg") for loop in self.background]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await asyncio.gather(*(a.close() for a in self.agents.values()), return_exceptions=True)

    def ready_capacities(self) -> list[NodeCapacity]:
        """Each ready node's capacity: the cluster view admission judges against (a lost
        node holds nothing, a draining one takes no new sandbox)."""
        return [a.capacity() for n, a in self.agents.items() if placeable(self.states.get(n, NodeState.ready))]

    def capacity(self) -> NodeCapacity:
        """What one sandbox may ask for on the ready nodes (see ``cluster_capacity``)."""
        caps = self.ready_capacities()
        if not caps and self.agents:
            states = ", ".join(f"{n}: {self.states.get(n, NodeState.ready).value}" for n in sorted(self.agents))
            raise errors.CapacityExhausted(f"no node of the cluster is ready ({states}); retry when one is back "
                                           "or undrained", retry_after=5.0)
        return cluster_capacity(caps)

    async def usage(self) -> NodeUsage:
        us = await asyncio.gather(*(a.usage() for a in self.live_agents().values()))
        return NodeUsage(node_id=self.node_id, cpu_busy=sum(u.cpu_busy for u in us) / max(len(us), 1),
                         sandboxes=sum(u.sandboxes for u in us), active_execs=sum(u.active_execs for u in us))

    async def health(self) -> NodeHealth:
        agents = self.agents  # nodes may join meanwhile (add_node rebinds, never mutates)
        hs = await asyncio.gather(*(a.health() for a in agents.values()), return_exceptions=True)
        problems = [f"{n}: {h}" if isinstance(h, BaseException) else f"{n}: {p}"
                    for n, h in zip(agents, hs)
                    for p in ([h] if isinstance(h, BaseException) else h.problems)]
        ok = [h for h in hs if isinstance(h, NodeHealth)]
        return NodeHealth(node_id=self.node_id, ok=bool(ok) and not problems, pid=os.getpid(),
                          started_at=self._started_at, sandboxes=sum(h.sandboxes for h in ok),
                          isolation=sorted({i for h in ok for i in h.isolation}), problems=problems)

    async def layer_index(self) -> LayerIndex:
        seen: dict[str, ImageLayers] = {}
        for idx in await asyncio.gather(*(a.layer_index() for a in self.live_agents().values())):
            for img in idx.images:
                seen.setdefault(img.image_id, img)
        return LayerIndex(node_id=self.node_id, images=list(seen.values()))

    async def layer_indexes(self) -> dict[str, LayerIndex]:
        """Each node's own index (the scheduler's image-aware placement input)."""
        agents = self.agents
        idx = await asyncio.gather(*(a.layer_index() for a in agents.values()))
        return dict(zip(agents, idx))

    async def resolve_image(self, ref: str) -> ImageLayers:
        for r in await asyncio.gather(*(a.resolve_image(ref) for a in self.live_agents().values()),
                                      return_exceptions=True):
            if isinstance(r, ImageLayers):
                return r
        raise errors.NotFound(f"image {ref!r} not found on any node; import it with `dsec image import`", image=ref)

    # --- lifecycle ----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, restore: RestoreSource | None = None,
                     fence: int | None = None) -> SandboxInfo:
        counts = {n: 0 for n in self.agents if placeable(self.states.get(n, NodeState.ready))}
        if not counts:
            raise errors.CapacityExhausted("no node of the cluster is ready (all lost or draining)", retry_after=5.0)
        for nid in self.where.values():
            if nid in counts:
                counts[nid] += 1
        nid = least_loaded(counts)
        info = await self.agents[nid].create(spec, sandbox_id=sandbox_id, tenant=tenant, pooled=pooled,
                                             restore=restore, fence=fence)
        return self._learn(info, nid)

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None = None, *,
                    fence: int | None = None) -> SandboxInfo:
        return await (await self._on(sandbox_id)).claim(sandbox_id, spec, tenant, fence=fence)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await (await self._on(sandbox_id)).get(sandbox_id)

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> list[SandboxInfo]:
        """Every reachable node's sandboxes: a lost node's sandboxes are unreachable (they
        answer NodeLost one by one) and must not take the whole cluster's listing down."""
        agents = self.live_agents()
        per = await asyncio.gather(*(a.list(labels, tenant) for a in agents.values()), return_exceptions=True)
        out = []
        for nid, infos in zip(agents, per):
            if isinstance(infos, errors.NodeLost):
                log.warning("listing node %s: %s", nid, infos.message)
                continue
            if isinstance(infos, BaseException):
                raise infos
            out += [self._learn(i, nid) for i in infos]
        return sorted(out, key=lambda i: i.created_at)

    async def raise_fence(self, token: int) -> int:
        """Every reachable node's bar (the lowest answer: a node already past ``token`` refuses)."""
        got = await asyncio.gather(*(a.raise_fence(token) for a in self.live_agents().values()))
        return min(got, default=token)

    async def destroy(self, sandbox_id: str, *, fence: int | None = None) -> None:
        try:
            agent = await self._on(sandbox_id)
        except errors.NotFound:
            # Not live anywhere: a node that knew it (already destroyed) answers quietly,
            # as a single node does; nobody knowing it is NotFound.
            done = await asyncio.gather(*(a.destroy(sandbox_id, fence=fence) for a in self.live_agents().values()),
                                        return_exceptions=True)
            if all(isinstance(d, errors.NotFound) for d in done):
                raise
            return
        await agent.destroy(sandbox_id, fence=fence)
        self.where.pop(sandbox_id, None)

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        return await (await self._on(sandbox_id)).set_timeout(sandbox_id, timeout)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        return await (await self._on(sandbox_id)).reset(sandbox_id)

    async def cpu_used(self, sandbox_id: str) -> float | None:
        return await (await self._on(sandbox_id)).cpu_used(sandbox_id)

    # --- exec / files / network / checkpoints: the node that holds the sandbox -------------
    async def exec(self, sandbox_id: str, req: ExecRequest) -> Any:
        return await (await self._on(sandbox_id)).exec(sandbox_id, req)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[Any]:
        agent = await self._on(sandbox_id)
        async for ev in agent.exec_stream(sandbox_id, req):
            yield ev

    async def processes(self, sandbox_id: str) -> Any:
        return await (await self._on(sandbox_id)).processes(sandbox_id)

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        await (await self._on(sandbox_id)).kill_process(sandbox_id, pid, signal)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await (await self._on(sandbox_id)).read_file(sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await (await self._on(sandbox_id)).write_file(sandbox_id, path, data, mode)

    async def list_files(self, sandbox_id: str, path: str) -> Any:
        return await (await self._on(sandbox_id)).list_files(sandbox_id, path)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await (await self._on(sandbox_id)).remove_file(sandbox_id, path, recursive)

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None:
        await (await self._on(sandbox_id)).upload_tar(sandbox_id, path, tar_bytes)

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await (await self._on(sandbox_id)).download_tar(sandbox_id, path)

    async def update_network(self, sandbox_id: str, allow: list[str]) -> SandboxInfo:
        return await (await self._on(sandbox_id)).update_network(sandbox_id, allow)

    async def network_denied_events(self, sandbox_id: str, since_seq: int = 0) -> Any:
        return await (await self._on(sandbox_id)).network_denied_events(sandbox_id, since_seq)

    async def checkpoint(self, sandbox_id: str, tenant: str) -> Any:
        return await (await self._on(sandbox_id)).checkpoint(sandbox_id, tenant)
