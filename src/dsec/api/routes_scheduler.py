"""Control-plane views: a request's queue position/ETA (its tenant) and the scheduler's
state (admin: node allocation against the overcommit bound, queue, pools, counters)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from pydantic import BaseModel, Field, ValidationError

from dsec.api.auth import require_admin
from dsec.api.deps import Ctx, read_body_limited
from dsec.cluster.demand import pending_demand, ray_bundles
from dsec.control.driver import lease_key
from dsec.control.leader import PEER_HEADER, PLACE_PATH, LeaderView, PlaceRequest, peer_ok, peer_secret
from dsec.errors import Forbidden, InvalidArgument, NotFound, NotLeader
from dsec.models import SandboxSpec

router = APIRouter(tags=["scheduler"])


class RequestStatus(BaseModel):
    request_id: str
    state: str  # queued | placed | created | failed
    position: int = 0
    eta_s: float = 0.0
    sandbox_id: str | None = None
    error: str | None = None


class NodeAllocation(BaseModel):
    node_id: str
    healthy: bool
    cpu: float
    cpu_allocated: float
    cpu_bound: float  # overcommit bound: admissions stop here
    memory: int
    memory_allocated: int
    sandboxes: int
    creating: int
    warm: int
    warm_ids: list[str]  # idle pool members (no tenant sees them)
    predicted_load: float


class SchedulerState(BaseModel):
    leader: str | None = Field(None, description="URL of the API server that makes placement decisions now "
                               "(the holder of the scheduler lease; None while none holds it)")
    leadership: LeaderView | None = Field(None, description="This server's view of the election (None: no "
                                          "election, this server always places)")
    queue_depth: int
    queue_capacity: int
    backpressure: bool
    placements_per_s: float
    nodes: list[NodeAllocation]
    stats: dict[str, int]
    pending_demand: dict[str, Any] = Field(
        default_factory=dict, description="What the cluster cannot place now (dsec.cluster.demand): `shapes` "
        "[{cpu, memory, disk, isolation, gpu, count}] and the same as Ray autoscaler `ray_bundles`")
    prefetch: dict[str, Any] | None = Field(None, description="The image prefetcher (dsec.cluster.prefetch) on a "
                                            "cluster: `stats` (passes, jobs, done, failed, skipped, bytes), "
                                            "`inflight` {node: image}, `recent` jobs, `last_pass` (popular images "
                                            "and their likely nodes); None when it does not run")


class PoolShape(BaseModel):
    image: str
    isolation: str
    cpu: float
    cpu_request: float
    memory: int
    disk: int
    network: bool
    floor: int
    target: int
    ready: int
    creating: int


class PoolList(BaseModel):
    pools: list[PoolShape]


class PoolFloor(BaseModel):
    """Keep ``size`` sandboxes of this shape warm (pre-created, initialised), whatever the
    recent demand; size 0 returns the shape to demand-driven sizing."""

    spec: SandboxSpec
    size: int = Field(ge=0, le=4096)


def _driver(ctx: Any) -> Any:
    driver = ctx.svc.scheduler
    if driver is None:
        raise NotFound("this server places creates without the scheduler (DSEC_API_SCHEDULER=0)")
    return driver


@router.get("/v1/requests/{request_id}", response_model=RequestStatus,
            summary="Where your create request is: queue position and ETA, or its sandbox")
async def request_status(request_id: Annotated[str, Path(min_length=1, max_length=256, pattern=r"^[!-~]+$")],
                         ctx: Ctx) -> RequestStatus:
    t = _driver(ctx).sched.tickets.get(f"{ctx.tenant.name}/{request_id}")
    if t is None:
        raise NotFound(f"request {request_id!r} is unknown: never submitted with this request_id, withdrawn, "
                       "or forgotten after the idempotency window")
    return RequestStatus(request_id=request_id, state=t.state, position=t.position, eta_s=round(t.eta_s, 3),
                         sandbox_id=t.sandbox_id, error=t.error)


@router.get("/v1/scheduler", response_model=SchedulerState, summary="Scheduler state (admin)")
async def scheduler_state(ctx: Ctx) -> SchedulerState:
    require_admin(ctx.tenant)
    sched = _driver(ctx).sched
    ratio = sched.s.overcommit_ratio
    nodes = [NodeAllocation(node_id=n.node_id, healthy=n.healthy, cpu=n.cpu, cpu_allocated=round(n.used_cpu, 3),
                            cpu_bound=round(n.cpu * ratio, 3), memory=n.memory, memory_allocated=n.used_memory,
                            sandboxes=n.count, creating=n.inflight, warm=n.warm_count,
                            warm_ids=sorted(r.sandbox_id for r in sched.residents[n.node_id].values() if r.pool),
                            predicted_load=round(n.predicted, 3))
             for n in sched.cluster.node_list]
    shapes = demand_of(_driver(ctx))
    elector = _driver(ctx).leader
    view = elector.view() if elector is not None else None
    return SchedulerState(leader=view.leader if view is not None else ctx.svc.settings.api_advertise_url or None,
                          leadership=view, queue_depth=sched.depth(), queue_capacity=sched.s.queue_capacity,
                          backpressure=sched.bp.active, placements_per_s=round(sched.drain_rate, 2),
                          nodes=nodes, stats=dict(sched.stats),
                          pending_demand={"shapes": [s.model_dump() for s in shapes],
                                          "ray_bundles": ray_bundles(shapes)},
                          prefetch=_prefetch_view(_driver(ctx)))


def _prefetch_view(driver: Any) -> dict[str, Any] | None:
    p = getattr(driver, "prefetcher", None)
    if p is None:
        return None
    return {"stats": dict(p.stats), "inflight": dict(p.busy), "recent": list(p.results[-10:]),
            "last_pass": dict(p.last_pass)}


def demand_of(driver: Any) -> Any:
    """The driver's pending demand now (see dsec.cluster.demand)."""
    return pending_demand(list(driver.sched.pending.values()), driver.clock(), driver.s.cluster_demand_min_age_s)


class ClusterNode(BaseModel):
    id: str
    state: str = Field(..., description="ready | draining | lost (dsec.cluster.membership)")
    sandboxes: int = Field(..., description="Sandboxes the control plane knows on this node")
    given_up: int = Field(0, description="Sandboxes given up when the node was lost (destroyed when it comes back)")
    last_heartbeat_age_s: float | None = None
    lost_at: float | None = Field(None, description="Unix time the node was last marked lost")
    lost_detect_s: float | None = Field(None, description="Last good heartbeat -> marked lost, seconds")
    reconciled: list[str] = Field(default_factory=list, description="Sandboxes it destroyed when it came back")
    restored: dict[str, str] = Field(default_factory=dict, description="Its checkpointed sandboxes restored "
                                     "elsewhere after the loss: sandbox id -> new node")


def _cluster(ctx: Any) -> Any:
    node = ctx.svc.node
    if not hasattr(node, "node_view"):
        raise NotFound("this server drives one node; node states exist under `dsec serve --cluster`")
    return node


@router.get("/v1/nodes", response_model=list[ClusterNode], summary="Cluster nodes and their states (admin)")
async def cluster_nodes(ctx: Ctx) -> list[ClusterNode]:
    require_admin(ctx.tenant)
    return [ClusterNode.model_validate(r) for r in _cluster(ctx).node_view()]


class DrainRequest(BaseModel):
    migrate: bool = Field(False, description="Checkpoint its running sandboxes and restore them elsewhere "
                          "(same sandbox ids); without it they run until they end")


NodeId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[!-~]+$")]


@router.post("/v1/nodes/{node_id}/drain", summary="Stop placements on a node; optionally migrate its sandboxes (admin)")
async def drain_node(node_id: NodeId, body: DrainRequest, ctx: Ctx, request: Request) -> dict[str, Any]:
    from dsec.cluster.drain import drain

    require_admin(ctx.tenant)
    router_ = _cluster(ctx)

    async def tenant_uid(name: str) -> str:
        rec = await ctx.svc.state.get_tenant(name)
        if rec is None:
            raise NotFound(f"tenant {name!r} of a sandbox on node {node_id} no longer exists", tenant=name)
        return str(rec.uid)

    res = await drain(router_, ctx.svc.scheduler, getattr(request.app.state, "checkpoints", None), node_id,
                      migrate=body.migrate, tenant_uid=tenant_uid)
    return res.model_dump()


@router.post("/v1/nodes/{node_id}/undrain", summary="A draining node takes placements again (admin)")
async def undrain_node(node_id: NodeId, ctx: Ctx) -> dict[str, Any]:
    from dsec.cluster.drain import undrain

    require_admin(ctx.tenant)
    return undrain(_cluster(ctx), ctx.svc.scheduler, node_id).model_dump()


@router.get("/v1/pools", response_model=PoolList, summary="Warm pools per shape (admin)")
async def pools(ctx: Ctx) -> PoolList:
    require_admin(ctx.tenant)
    return PoolList.model_validate(_driver(ctx).pool_status() or {"pools": []})


@router.put("/v1/pools", response_model=PoolList, summary="Set a shape's minimum warm pool size (admin)")
async def set_pool(body: PoolFloor, ctx: Ctx) -> PoolList:
    require_admin(ctx.tenant)
    if body.spec.network:
        raise InvalidArgument("warm pools are built without an allow-list (network=None or []): the "
                              "allow-list is applied at hand-over", field="spec.network")
    return PoolList.model_validate(_driver(ctx).set_pool(body.spec, body.size))


OwnerName = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[!-~]+$",
                                description="Lease owner (run id / client session), as given at create")]


class LeaseStatus(BaseModel):
    owner: str
    sandboxes: int
    reap_after_s: float  # silence after which the owner's sandboxes are reaped


class LeaseReleased(BaseModel):
    owner: str
    released: list[str]


@router.post("/v1/leases/{owner}/heartbeat", response_model=LeaseStatus,
             summary="Renew an owner lease (sandboxes created with this owner live while it is renewed)")
async def heartbeat(owner: OwnerName, ctx: Ctx) -> LeaseStatus:
    held, reap_after = _driver(ctx).heartbeat(lease_key(ctx.tenant.name, owner))
    return LeaseStatus(owner=owner, sandboxes=held, reap_after_s=reap_after)


@router.delete("/v1/leases/{owner}", response_model=LeaseReleased,
               summary="Release an owner lease: its sandboxes are killed now")
async def release(owner: OwnerName, ctx: Ctx) -> LeaseReleased:
    ids = await _driver(ctx).release_owner(lease_key(ctx.tenant.name, owner))
    return LeaseReleased(owner=owner, released=ids)


@router.post(PLACE_PATH, include_in_schema=False, status_code=201)
async def peer_place(request: Request) -> Response:
    """A follower API server hands a placement to this one, the scheduler leader
    (``dsec.control.leader.PlacementForwarder``). Authenticated by the deployment's peer
    secret, not a tenant token: the follower already authenticated and admitted it."""
    svc = request.app.state.services
    driver = svc.scheduler
    if driver is None or driver.leader is None:
        raise NotFound("this server runs no scheduler election")
    presented = request.headers.get(PEER_HEADER)
    cached = getattr(request.app.state, "peer_secret", None)
    if not peer_ok(presented, cached or ""):
        request.app.state.peer_secret = cached = await peer_secret(svc.state)
        if not peer_ok(presented, cached):
            raise Forbidden(f"peer placement refused: missing or wrong {PEER_HEADER} secret")
    try:
        req = PlaceRequest.model_validate_json(await read_body_limited(request, svc.settings.api_max_json_bytes))
    except ValidationError as e:
        raise InvalidArgument(f"bad peer placement: {e.errors()[0].get('msg', 'invalid')}") from None
    if not driver.leader.is_leader:
        raise NotLeader("this server is not the scheduler leader (any more)", retry_after=0.5,
                        leader=driver.leader.leader_url)
    via = None
    if req.restore is not None:
        from dsec.cluster.checkpoints import RestoreCreator
        via = RestoreCreator(svc.node, req.restore)
    info = await driver.place_here(req.spec, req.sandbox_id, req.tenant, via=via)
    return Response(info.model_dump_json(), status_code=201, media_type="application/json")
