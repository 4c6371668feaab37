"""``create_app(services) -> FastAPI``: the HTTP API. No module globals: everything the
routes need hangs off ``app.state.services``."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dsec import __version__
from dsec.api import routes_admin, routes_checkpoints, routes_files, routes_sandboxes, routes_scheduler
from dsec.api.compat.e2b import install_e2b
from dsec.api.errors import install_error_handlers
from dsec.api.file_gate import FileGate
from dsec.api.guard import RequestGuard
from dsec.api.hotpath import HotPath
from dsec.api.metrics import Metrics
from dsec.api.priority import GcPauses, boost_current_thread, boost_server_threads
from dsec.api.services import Services

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class RequestMetrics:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it buffers and breaks streaming).

    Labels by route *template* (``/v1/sandboxes/{sandbox_id}/exec``), never the raw path.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def _send(msg: MutableMapping[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.child(self.metrics.api_seconds, scope["method"], route,
                               f"{status // 100}xx").observe(time.perf_counter() - t0)


class DSecApp(FastAPI):
    """FastAPI whose front door is ``RequestMetrics(HotPath(<the whole FastAPI stack>))``.

    The exec/health fast path sits in front of FastAPI's own middlewares too (error
    middleware, telemetry — which reads the OpenTelemetry env on every request — body
    limits), not just the routing: for an exec those cost about as much as the fast path
    itself. Everything else goes through FastAPI unchanged.
    """

    front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.front is None:
            await super().__call__(scope, receive, send)
        else:
            await self.front(scope, receive, send)

    async def fastapi(self, scope: Scope, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, send)


def create_app(services: Services, *, manage_lifecycle: bool = True, hot_path: bool = True) -> FastAPI:
    """Build the app. With ``manage_lifecycle`` the ASGI lifespan starts and closes the
    services (node agent reconcile, audit flusher, housekeeping). ``hot_path=False`` leaves
    exec and /health to the FastAPI routes (the reference the fast path is tested against)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            nice = services.settings.api_loop_nice
            on_worker = getattr(services.state, "on_worker", None)
            if boost_server_threads(asyncio.get_running_loop(), nice) and on_worker is not None:
                # The SQLite store's own thread too: a create waits on it, and at nice 0 each
                # of its wake-ups queued behind the sandboxes' work (issue 15).
                await on_worker(lambda: boost_current_thread(nice))
            gc_pauses = GcPauses()
            gc_task = asyncio.create_task(_export_gc(gc_pauses, services.metrics), name="dsec-gc-metrics")
            await services.start()
            if app.state.usage is not None:
                await app.state.usage.start()  # after the node adopted its sandboxes
            # Everything built so far (modules, app, schemas, adopted sandboxes) lives for the
            # whole run: keep it out of every later collection. Measured under 200 busy
            # sandboxes: full collections otherwise stopped the loop for >100 ms at a time.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            if manage_lifecycle:
                gc_task.cancel()
                gc_pauses.close()
                gc.unfreeze()  # an app in a longer-lived process (tests) must not pin its objects
                fusion = getattr(app.state, "fusion", None)
                if fusion is not None:
                    await fusion.pools.close()  # run_code pool members die with the server
                if app.state.usage is not None:
                    await app.state.usage.close()  # last samples and totals written
                await services.close()
            app.state.file_gate.close()

    app = DSecApp(title="DSec API", version=__version__, lifespan=lifespan,
                  description="Fast, secure, recoverable sandboxes for AI-agent training. "
                              "Errors are JSON {code, message, details}.")
    app.state.services = services
    app.state.file_gate = FileGate(services.settings)  # file I/O threads, slots per tenant (issue 18 #2)
    install_error_handlers(app, services.settings.api_retry_after_s)
    app.include_router(routes_sandboxes.router)
    app.include_router(routes_files.router)
    app.include_router(routes_admin.images)
    app.include_router(routes_admin.tenants)
    app.include_router(routes_admin.system)
    app.include_router(routes_checkpoints.router)
    app.include_router(routes_scheduler.router)
    # Run-level accounting: GET /v1/usage, per-label quotas, dsec_usage_* metrics (issue 16).
    from dsec.api.routes_usage import install_usage

    app.state.usage = install_usage(app, services)
    from dsec.api.routes_clone import router as clone_router

    app.include_router(clone_router)  # POST /v1/sandboxes/{id}/clone (issue 16)
    from dsec.api.routes_groups import router as groups_router

    app.include_router(groups_router)  # POST /v1/groups: gang admission (issue 16)
    # E2B SDK front ends (/e2b REST, /e2b/envd): the same SandboxService underneath.
    app.state.e2b = install_e2b(app, services)
    # SandboxFusion front end (/fusion/<key>/run_code, /v1/ping): pooled reset-able sandboxes.
    from dsec.api.compat.fusion import install_fusion

    app.state.fusion = install_fusion(app, services)
    app.state.checkpoints = None
    if getattr(services.node, "manager", None) is not None:
        # Episodes (trajectory log, checkpoints, fast-forward resume) and sandbox
        # checkpoints need a real node (overlay upper dirs, cgroup freezer).
        from dsec.api.episodes import install_episodes
        from dsec.blobs import open_checkpoint_store
        from dsec.checkpoints.sandbox_ckpt import SandboxCheckpoints
        app.state.episodes = install_episodes(app, services)
        from dsec.api.routes_fork import router as fork_router

        app.include_router(fork_router)  # POST /v1/episodes/{id}/fork (issue 16)
        app.state.checkpoints = SandboxCheckpoints(services.settings, open_checkpoint_store(services.settings),
                                                   services.node)
        # One set of per-sandbox trackers: NodeAgent.checkpoint / create(restore=) on this
        # node and the routes share them (incremental checkpoints stay incremental).
        share = getattr(services.node, "use_checkpoints", None)  # LocalNodeAgent (in-process node)
        if share is not None:
            share(app.state.checkpoints)
    else:
        from dsec.cluster.router import ClusterRouter

        if isinstance(services.node, ClusterRouter):  # capture on the sandbox's node, restore on any
            from dsec.blobs import open_checkpoint_store
            from dsec.cluster.checkpoints import ClusterCheckpoints
            app.state.checkpoints = ClusterCheckpoints(services.settings, open_checkpoint_store(services.settings),
                                                       services.node)
            # Episodes: placed by the scheduler, run on their node, resumed elsewhere after a loss.
            from dsec.api.episodes import install_cluster_episodes
            app.state.episodes = install_cluster_episodes(app, services)
    # Routing is a linear scan: the per-tool-call paths go first (no two routes share a
    # method and a matching path, so order does not change which route answers).
    app.router.routes.sort(key=lambda r: _HOT.get(getattr(r, "path", ""), len(_HOT)))
    # RequestMetrics labels by the route template: FastAPI's router (or HotPath) sets
    # scope["route"] in the shared scope dict before the response completes.
    inner: ASGIApp = app.fastapi
    # RequestGuard: token checked and body capped before anything reads a body (issue 18 #5).
    app.front = RequestMetrics(RequestGuard(HotPath(inner, services, app.state) if hot_path else inner, services),
                               services.metrics)
    app.openapi = lambda: _openapi_with_bearer(app)  # type: ignore[method-assign]
    return app


async def _export_gc(pauses: GcPauses, metrics: Metrics) -> None:
    while True:
        await asyncio.sleep(1.0)
        for gen, seconds in pauses.drain():
            metrics.gc_pause.labels(generation=str(gen)).observe(seconds)


_HOT = {p: i for i, p in enumerate([
    "/v1/sandboxes/{sandbox_id}/exec", "/v1/sandboxes/{sandbox_id}/files", "/v1/sandboxes/{sandbox_id}",
    "/health", "/v1/sandboxes/{sandbox_id}/exec/stream", "/v1/sandboxes"])}


def _openapi_with_bearer(app: FastAPI) -> dict[str, Any]:
    """Declare the bearer token scheme once (auth is one dependency, not a per-route scheme)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "Tenant API token (`dsec tenant add NAME`; DSEC_HOME/token locally)"}}
        schema["security"] = [{"bearer": []}]
        for path in ("/health", "/metrics"):
            for op in schema["paths"].get(path, {}).values():
                op["security"] = []
        app.openapi_schema = schema
    return app.openapi_schema
