"""``dsec serve``: one process with the API server, control plane and one node agent.

Embedded state lives under ``DSEC_HOME``: ``state.db`` (SQLite WAL), images, sandboxes.
On first start a local admin token is written to ``DSEC_HOME/token`` (mode 0600) and the
listening URL to ``DSEC_HOME/server.json`` so the CLI/SDK work without configuration.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from typing import Any

from dsec.api.auth import hash_token
from dsec.api.services import Services
from dsec.config import Settings
from dsec.durable import atomic_write
from dsec.errors import Conflict
from dsec.sdk._config import SERVER_FILE, TOKEN_FILE, read_token_file
from dsec.state import state_for

log = logging.getLogger("dsec.serve")

LOCAL_TENANT = "local"


async def ensure_local_token(services: Services) -> str:
    """The embedded default's admin tenant ``local``; its token file is (re)made if missing."""
    home = services.settings.home
    token = read_token_file(home)
    rec = await services.state.get_tenant(LOCAL_TENANT)
    if token is not None and rec is not None and rec.token_hash == hash_token(token):
        return token
    if rec is not None:
        # Token file lost: issue a new token for the same tenant (same uid: its data stays its own).
        await services.state.delete_tenant(LOCAL_TENANT)
    _, token = await services.auth.create_tenant(LOCAL_TENANT, admin=True, uid=rec.uid if rec is not None else None)
    atomic_write(home / TOKEN_FILE, token.encode() + b"\n", 0o600)
    return token


def build_embedded(settings: Settings) -> Services:
    """State store + the real node agent (adopts/cleans sandboxes in its ``start()``)."""
    if settings.cluster:  # sandboxes on a Ray cluster's nodes, behind a router
        from dsec.cluster.serve import build_cluster
        return build_cluster(settings)  # type: ignore[no-any-return]
    from dsec.node.agent import LocalNodeAgent

    settings.home.mkdir(parents=True, exist_ok=True)
    # SQLite under HOME, or the Redis every API server of the deployment shares (--state).
    state = state_for(settings.state_url, settings.home, settings.api_retry_after_s, settings.state_timeout_s)
    node = LocalNodeAgent(settings)
    images = getattr(node, "images", None)
    services = Services.build(settings, node, state, images=images)
    if settings.api_scheduler:
        services.attach_scheduler(_scheduler(settings, node, images))
        attach_election(services)
    return services


def attach_election(services: Services) -> None:
    """One scheduler leader per deployment (dsec.control.leader): on a shared (Redis) state
    the servers elect one and the others hand it their placements; on the embedded SQLite
    default the server is the leader from its start (solo: nothing on the create path)."""
    from dsec.control.leader import LeaderElector, PlacementForwarder

    driver, settings = services.scheduler, services.settings
    if driver is None:
        return
    from dsec.control.book import ControlBook

    elector = LeaderElector(services.state, settings, solo=settings.state_backend == "sqlite")
    driver.attach_leader(elector, None if elector.solo else PlacementForwarder(services.state, settings, elector))
    driver.book = ControlBook(services.state)  # owner leases, pool floors, preemptions outlive us


async def start_election(services: Services, url: str) -> None:
    """Take part in the election under this server's URL (known once it listens)."""
    driver = services.scheduler
    if driver is None or driver.leader is None:
        return
    if driver.leader.solo:  # already the leader since the driver started: just its name
        driver.leader.holder = services.settings.api_advertise_url or url
        return
    await driver.leader.start(services.settings.api_advertise_url or url)


def _scheduler(settings: Settings, node: Any, images: Any) -> Any:
    """The control plane: tenant queues, placement, warm pools, backpressure (dsec.control)."""
    from dsec.control.driver import SchedulerDriver
    from dsec.control.scheduler import Scheduler

    def resolve(ref: str) -> tuple[list[tuple[str, int]], str]:
        info = images.resolve(ref)
        return [(li.digest, li.size) for li in info.layers], info.id

    # CPU use is measured on the node (NodeAgent.usage), the same way as on a cluster.
    return SchedulerDriver(Scheduler(settings), {node.node_id: node}, settings,
                           image_resolver=resolve if images is not None else None)


def enable_preemption(services: Services, checkpoints: Any) -> None:
    """Preemption needs a way to save and bring back each victim: sandbox checkpoints.
    Without them (no local node manager) the scheduler never preempts."""
    driver = services.scheduler
    if driver is None or checkpoints is None:
        return

    async def checkpoint(tenant: str, sandbox_id: str) -> str:
        return (await checkpoints.checkpoint(tenant, sandbox_id)).id

    async def resume(tenant: str, checkpoint_id: str, sandbox_id: str) -> Any:
        spec, create = await checkpoints.prepare_restore(tenant, checkpoint_id)
        return await create(spec, sandbox_id, tenant)

    driver.enable_preemption(checkpoint, resume)


def uvicorn_config(app: Any, settings: Settings, host: str, port: int, log_level: str = "info") -> Any:
    import uvicorn

    from dsec.api.conn_guard import guarded_protocol

    # httptools with a header deadline and a per-client cap on half-sent requests (issue 18 #12).
    return uvicorn.Config(app, host=host, port=port, loop="uvloop", http=guarded_protocol(settings), lifespan="on",
                          log_level=log_level, timeout_graceful_shutdown=int(settings.api_shutdown_grace_s),
                          backlog=4096, access_log=False, server_header=False,
                          # Longer than the SDK's idle expiry: the server must never close a pooled
                          # connection just as the client reuses it (a lost, unretryable exec).
                          timeout_keep_alive=int(settings.api_keepalive_s))


async def serve_async(settings: Settings, host: str, port: int, services: Services | None = None,
                      log_level: str = "info", ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM; close services and remove server.json on the way out."""
    import uvicorn

    from dsec.api.app import create_app

    services = services or build_embedded(settings)
    try:
        # Reachable, same schema version: else refuse to start, naming the store and why.
        await services.state.open()
        local_token = await ensure_local_token(services)
    except BaseException:
        await services.node.close()
        await services.state.close()
        raise
    app = create_app(services)
    enable_preemption(services, getattr(app.state, "checkpoints", None))
    server = uvicorn.Server(uvicorn_config(app, settings, host, port, log_level))

    def _on_signal(sig: int, _frame: object) -> None:
        # uvicorn re-raises the captured signal after its graceful shutdown, with these
        # (restored) handlers in place: that must not kill us before cleanup below runs.
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True
        server.should_exit = True

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _on_signal)
    async def guarded() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn's way of saying "could not start" (it already logged why)
            raise Conflict(f"the API server did not start on {host}:{port}: see the error logged above "
                            "(port in use: pick another with --port or stop the other server)",
                            host=host, port=port) from None

    task = asyncio.create_task(guarded())
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    server_file = settings.home / SERVER_FILE
    if not server.started:
        try:
            await task
        finally:
            await services.state.close()  # uvicorn already ran the lifespan shutdown (services.close)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound[1]}"
        from dsec.api.compat.e2b import e2b_urls
        from dsec.api.compat.fusion import server_json_entry

        atomic_write(server_file, json.dumps({"url": url, **e2b_urls(url),
                                              **server_json_entry(url, hash_token(local_token)), "pid": os.getpid(),
                                              "started_at": time.time()}).encode())
        log.info("DSec API listening on %s (token: %s)", url, settings.home / TOKEN_FILE)
        await start_election(services, url)
        if ready is not None:
            ready.set()
    try:
        await task
    finally:
        try:
            info = json.loads(server_file.read_text())
            if info.get("pid") == os.getpid():
                server_file.unlink()
        except (OSError, ValueError):
            pass
        await services.state.close()


def serve(settings: Settings, host: str, port: int, log_level: str = "info") -> None:
    import uvloop

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve_async(settings, host, port, log_level=log_level))


__all__ = ["atomic_write", "build_embedded", "ensure_local_token", "serve", "serve_async"]
