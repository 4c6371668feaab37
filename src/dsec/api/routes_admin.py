"""Images, tenants, health and metrics routes."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import os
import tempfile
import time
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response

from dsec import __version__
from dsec.api.auth import require_admin
from dsec.api.deps import RAW_BODY, Ctx, Svc, read_body_limited
from dsec.models.api import (
    TENANT_NAME_PATTERN,
    Health,
    ImageBuildRequest,
    TenantCreate,
    TenantCreated,
    TenantInfo,
)
from dsec.errors import Conflict, NotFound
from dsec.models import ImageInfo

images = APIRouter(prefix="/v1/images", tags=["images"])
tenants = APIRouter(prefix="/v1/tenants", tags=["tenants"])
system = APIRouter(tags=["system"])

ImageRef = Annotated[str, Path(min_length=1, max_length=256, pattern=r"^[^\x00/][^\x00]*$")]


def _store(svc: Any) -> Any:
    if svc.images is None:
        raise NotFound("this server has no image store configured (images are managed on the node)")
    return svc.images


def _visible(t: Any, info: ImageInfo) -> bool:
    return t.images is None or any(fnmatch.fnmatchcase(n, g) for n in info.names for g in t.images)


@images.get("", response_model=list[ImageInfo], summary="Images this tenant may use")
async def list_images(ctx: Ctx) -> list[ImageInfo]:
    svc, t = ctx.svc, ctx.tenant
    found = await asyncio.to_thread(_store(svc).list)
    return [i for i in found if _visible(t, i)]


@images.get("/{ref:path}", response_model=ImageInfo)
async def get_image(ref: ImageRef, ctx: Ctx) -> ImageInfo:
    svc, t = ctx.svc, ctx.tenant
    info = await asyncio.to_thread(_store(svc).resolve, ref)
    if not _visible(t, info):
        raise NotFound(f"image {ref!r} not found (or not allowed for tenant {t.name!r})", image=ref)
    return info


@images.post("/import", response_model=ImageInfo, status_code=201, openapi_extra=RAW_BODY,
             summary="Import an OCI layout / docker-save archive (admin)")
async def import_image(request: Request, ctx: Ctx,
                       name: Annotated[str, Query(min_length=1, max_length=256)]) -> ImageInfo:
    svc, t = ctx.svc, ctx.tenant
    require_admin(t)
    data = await read_body_limited(request, svc.settings.max_upload_bytes)
    fd, tmp = tempfile.mkstemp(dir=svc.tmp_dir, suffix=".tar")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return await asyncio.to_thread(_store(svc).import_archive, FsPath(tmp), name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@images.post("/build", response_model=ImageInfo, status_code=201, summary="Build an image (admin)")
async def build_image(req: ImageBuildRequest, ctx: Ctx) -> ImageInfo:
    svc, t = ctx.svc, ctx.tenant
    require_admin(t)
    store = _store(svc)
    return await asyncio.to_thread(_build, store, req, svc.tmp_dir)


def _build(store: Any, req: ImageBuildRequest, tmp: FsPath) -> ImageInfo:
    from dsec.images.build import Builder, make_runner
    from dsec.images.build.spec import parse_spec

    spec = parse_spec(req.spec, f"build of {req.tag}")
    with tempfile.TemporaryDirectory(dir=tmp, prefix="build-") as ctx:
        for rel, text in req.files.items():
            dest = FsPath(ctx) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        return Builder(store, make_runner("unshare", store)).build(spec, req.tag, context=FsPath(ctx)).image


@images.delete("/{ref:path}", status_code=204, summary="Remove an image (admin)")
async def remove_image(ref: ImageRef, ctx: Ctx) -> Response:
    svc, t = ctx.svc, ctx.tenant
    require_admin(t)
    await asyncio.to_thread(_store(svc).remove, ref)
    return Response(status_code=204)


@tenants.post("", response_model=TenantCreated, status_code=201, summary="Create a tenant; returns its token once")
async def add_tenant(req: TenantCreate, ctx: Ctx) -> TenantCreated:
    svc, t = ctx.svc, ctx.tenant
    require_admin(t)
    if await svc.state.get_tenant(req.name) is not None:
        raise Conflict(f"tenant {req.name!r} already exists; remove it first or pick another name", tenant=req.name)
    rec, token = await svc.auth.create_tenant(req.name, admin=req.admin, max_sandboxes=req.max_sandboxes,
                                              max_cpu=req.max_cpu, max_memory=req.max_memory,  # type: ignore[arg-type]
                                              images=req.images)
    return TenantCreated(tenant=TenantInfo.of(rec), token=token)


@tenants.get("", response_model=list[TenantInfo])
async def list_tenants(ctx: Ctx) -> list[TenantInfo]:
    svc, t = ctx.svc, ctx.tenant
    require_admin(t)
    return [TenantInfo.of(r) for r in await svc.state.list_tenants()]


@tenants.delete("/{name}", status_code=204,
                summary="Remove a tenant: kill its sandboxes, delete its checkpoints, episodes and request ids")
async def remove_tenant(name: Annotated[str, Path(pattern=TENANT_NAME_PATTERN)], ctx: Ctx,
                        request: Request) -> Response:
    svc, t = ctx.svc, ctx.tenant
    require_admin(t)
    if name == t.name:
        raise Conflict(f"refusing to remove tenant {name!r}: it is the one making this request")
    victim = await svc.state.get_tenant(name)
    if victim is None:
        raise NotFound(f"tenant {name!r} not found; list tenants with `dsec tenant ls`", tenant=name)
    killed = []
    for info in await svc.sandboxes.list(victim):
        with contextlib.suppress(NotFound):
            await svc.sandboxes.kill(victim, info.id)
            killed.append(info.id)
    await purge_tenant_data(request.app.state, svc, victim, killed)
    await svc.state.delete_tenant(name)
    svc.auth.invalidate()
    return Response(status_code=204)


async def purge_tenant_data(app_state: Any, svc: Any, victim: Any, killed: list[str]) -> None:
    """Delete what a removed tenant leaves behind (issue 18 #7), so a tenant later created
    under the same name finds nothing: its checkpoints and episodes (keyed by its uid),
    its idempotency keys, and the scheduler's request tickets and owner leases (keyed by
    ``<name>/...``: names never contain ``/``). Its sandboxes' audit logs stay orphaned
    (owned by a uid no tenant will ever have) until the retention prune."""
    ckpts, episodes = getattr(app_state, "checkpoints", None), getattr(app_state, "episodes", None)
    if ckpts is not None:
        for sid in killed:
            await ckpts.forget_sandbox(sid)
    if victim.uid:
        from dsec.state.keys import episode_key_prefix
        await svc.state.purge_tenant(victim.uid)
        if ckpts is not None:
            await ckpts.purge(victim.uid)
            # Preemption checkpoints, and checkpoints taken before uids existed, are under
            # the name (``sbckpt.<name>.``: a dot ends it, so no other name matches).
            await ckpts.purge(victim.name)
        if episodes is not None:
            await episodes.purge(episode_key_prefix(victim.uid))
    driver = svc.scheduler
    if driver is not None:
        prefix = f"{victim.name}/"
        sched = driver.sched
        for rid, t in [(r, t) for r, t in list(sched.tickets.items()) if r.startswith(prefix)]:
            if t.state == "queued":  # withdrawn: its waiting create answers 429, nothing is made
                with contextlib.suppress(Exception):
                    driver._withdraw(rid)
            sched.forget(rid)  # its status and sandbox id must not reach a namesake
        for owner in [o for o in list(sched.leases) if o.startswith(prefix)]:
            await driver.release_owner(owner)


@tenants.get("/me", response_model=TenantInfo, summary="The tenant this token belongs to")
async def whoami(ctx: Ctx) -> TenantInfo:
    t = ctx.tenant
    return TenantInfo.of(t)


@system.get("/health", response_model=Health, summary="Liveness (no auth); O(1), safe to probe often")
async def health(svc: Svc) -> Response:
    body = Health(status="ok", version=__version__, node=getattr(svc.node, "node_id", None),
                  uptime_s=round(time.time() - svc.started_at, 3))
    return Response(body.model_dump_json(), media_type="application/json")


@system.get("/metrics", summary="Prometheus metrics (no auth)", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
async def metrics(svc: Svc) -> Response:
    await svc.refresh_metrics()
    return Response(content=svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
