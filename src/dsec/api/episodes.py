"""Episode routes: logged, checkpointed, resumable agent episodes (see dsec.checkpoints.engine).

Wire-up (one line in the app factory)::

    from dsec.api.episodes import include_episodes
    include_episodes(app, engine)       # engine: dsec.checkpoints.engine.EpisodeEngine

Episode ids are per tenant: the engine stores them under ``dsec.state.keys.episode_key``
(the tenant's immutable uid, fixed-length, then ``--`` and the id), so no tenant name or
episode id can reach another tenant's episode, and a re-created tenant starts empty.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Header, Path, Request, Response
from pydantic import BaseModel, Field

from dsec.checkpoints.engine import EpisodeEngine
from dsec.checkpoints.host import EPISODE_TENANT
from dsec.models import ExecRequest, SandboxSpec
from dsec.models.episode import CheckpointRef, EpisodeInfo, StepResult
from dsec.state.keys import episode_key

router = APIRouter(prefix="/v1/episodes", tags=["episodes"])
EpisodeId = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$", description="Episode id")]


class OpenRequest(BaseModel):
    spec: SandboxSpec | None = Field(None, description="Sandbox to create; ignored when resuming")


class StepRequest(BaseModel):
    step: int = Field(..., ge=0, description="Index of this command in the agent loop (0-based)")
    request: ExecRequest


class CheckpointRequest(BaseModel):
    weights_ref: str | None = Field(None, max_length=4096, description="Where the model weights are")
    meta: dict[str, Any] = Field(default_factory=dict)


async def _engine(request: Request) -> EpisodeEngine:
    return request.app.state.episodes


async def _tenant(request: Request) -> Any:
    # Own dependency (same auth as every route) so this router does not track deps.py's shape.
    tenant = await request.app.state.services.auth.authenticate(request.headers.get("authorization"))
    # Sandboxes the engine makes or destroys during this call are the tenant's (admission,
    # quotas, scheduler): a plain async dependency runs in the endpoint's task, so the
    # engine's awaits (and the tasks they start) see it.
    EPISODE_TENANT.set(tenant)
    return tenant


Engine = Annotated[EpisodeEngine, Depends(_engine)]
Tenant = Annotated[Any, Depends(_tenant)]
EPOCH_HEADER = "x-dsec-episode-epoch"
# The owner epoch ``open`` returned; a write with an older one is refused (409 episode_fenced).
Epoch = Annotated[int | None, Header(alias=EPOCH_HEADER, ge=0, description="Owner epoch from open (fencing)")]


def _key(t: Any, episode_id: str) -> str:
    return episode_key(t.uid, episode_id)


def _public(info: EpisodeInfo, episode_id: str) -> EpisodeInfo:
    return info.model_copy(update={"id": episode_id})


@router.post("/{episode_id}/open", response_model=EpisodeInfo, summary="Create or resume an episode")
async def open_(episode_id: EpisodeId, req: OpenRequest, eng: Engine, t: Tenant, request: Request) -> EpisodeInfo:
    if req.spec is not None:  # judged like any create's spec: an episode is no way around its checks
        await request.app.state.services.sandboxes.check_spec(t, req.spec)
    return _public(await eng.open(_key(t, episode_id), req.spec), episode_id)


@router.post("/{episode_id}/steps", response_model=StepResult,
             summary="Run step N live, or return its logged result if already logged")
async def step(episode_id: EpisodeId, req: StepRequest, eng: Engine, t: Tenant, epoch: Epoch = None) -> StepResult:
    return await eng.step(_key(t, episode_id), req.step, req.request, epoch)


@router.put("/{episode_id}/context", response_model=CheckpointRef, summary="Save agent runtime state")
async def save_context(episode_id: EpisodeId, eng: Engine, t: Tenant, context: Annotated[Any, Body()],
                       epoch: Epoch = None) -> CheckpointRef:
    ref = await eng.save_context(_key(t, episode_id), context, epoch)
    return ref.model_copy(update={"episode_id": episode_id})


@router.get("/{episode_id}/context", summary="The last saved agent context (null if none)")
async def get_context(episode_id: EpisodeId, eng: Engine, t: Tenant) -> Any:
    return await eng.context(_key(t, episode_id))


@router.post("/{episode_id}/checkpoint", response_model=CheckpointRef, summary="Atomic checkpoint unit")
async def checkpoint(episode_id: EpisodeId, req: CheckpointRequest, eng: Engine, t: Tenant,
                     epoch: Epoch = None) -> CheckpointRef:
    ref = await eng.checkpoint(_key(t, episode_id), req.weights_ref, req.meta, epoch)
    return ref.model_copy(update={"episode_id": episode_id})


@router.post("/{episode_id}/resume", response_model=EpisodeInfo, summary="Restore a stopped episode")
async def resume(episode_id: EpisodeId, eng: Engine, t: Tenant) -> EpisodeInfo:
    return _public(await eng.resume(_key(t, episode_id)), episode_id)


@router.get("/{episode_id}", response_model=EpisodeInfo)
async def info(episode_id: EpisodeId, eng: Engine, t: Tenant) -> EpisodeInfo:
    return _public(await eng.info(_key(t, episode_id)), episode_id)


@router.get("/{episode_id}/export", summary="Trajectory as zstd-compressed JSONL")
async def export(episode_id: EpisodeId, eng: Engine, t: Tenant) -> Response:
    import asyncio
    data = await asyncio.to_thread(eng.export, _key(t, episode_id))
    return Response(data, media_type="application/zstd")


@router.delete("/{episode_id}", status_code=204, summary="Close: destroy the sandbox, keep checkpoints")
async def close(episode_id: EpisodeId, eng: Engine, t: Tenant, epoch: Epoch = None) -> Response:
    await eng.close(_key(t, episode_id), epoch)
    return Response(status_code=204)


def include_episodes(app: FastAPI, engine: EpisodeEngine) -> None:
    app.state.episodes = engine
    if not any(getattr(r, "path", "").startswith(router.prefix) for r in app.router.routes):
        app.include_router(router)  # idempotent: a later call only swaps the engine


def install_episodes(app: FastAPI, services: Any) -> EpisodeEngine:
    """Build the engine for the app's node (real sandboxes) and mount the routes.

    The one line for ``create_app``: ``install_episodes(app, services)``.
    """
    from dsec.blobs import open_checkpoint_store
    from dsec.checkpoints.migrate_keys import migrate_legacy_keys
    from dsec.checkpoints.nodehost import NodeEpisodeHost
    s = services.settings
    store = open_checkpoint_store(s)
    # Tenants from before uids: their episodes/checkpoints move to uid keys (once, at start).
    legacy_db = getattr(services.state, "db", None)  # SqliteDB: the only store that predates uids
    if legacy_db is not None:
        migrate_legacy_keys(legacy_db, store, s.checkpoint_journal_dir or s.home / "journals")
    # Episode epochs in the shared state store: ownership is a compare-and-set there.
    engine = EpisodeEngine(s, store, NodeEpisodeHost(services.node, services.sandboxes), state=services.state)
    include_episodes(app, engine)
    return engine


def install_cluster_episodes(app: FastAPI, services: Any) -> Any:
    """The routes over a cluster (``dsec serve --cluster``): episodes are placed by the
    scheduler, run on their node and resumed elsewhere after a loss
    (dsec.cluster.episodes.ClusterEpisodes, the engine's interface for these routes)."""
    from dsec.blobs import open_checkpoint_store
    from dsec.cluster.episodes import ClusterEpisodes

    eps = ClusterEpisodes(services.settings, open_checkpoint_store(services.settings), services.node, services)
    hb = getattr(services.node, "heartbeats", None)
    if hb is not None:
        hb.episodes = eps  # node lost -> its episodes resume elsewhere
    include_episodes(app, eps)  # type: ignore[arg-type]
    return eps
