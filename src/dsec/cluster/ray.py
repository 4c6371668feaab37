"""Node agents on Ray: one named, detached actor per DSec node, and a client-side proxy.

Layout on a Ray cluster:

- A DSec node is a Ray node started with a custom resource ``dsec_node_<ID>`` (see
  ``node_resource``), e.g. ``ray start --address HEAD:PORT --resources '{"dsec_node_n1": 1}'``
  with the node's DSEC_* settings (DSEC_HOME, DSEC_CGROUP_PARENT, DSEC_NET_CIDR, ...) in
  the environment of that ``ray start``: Ray's workers inherit it, so the agent on each
  node reads its own machine's configuration.
- ``ensure_agents`` starts ONE actor per such node, named ``dsec-node-<ID>`` in namespace
  ``dsec``, ``lifetime="detached"`` (it outlives the API server that started it, like a
  daemon) and pinned to its node by requesting a sliver of that node's resource. Never
  one actor per sandbox: Ray creates some hundreds of actors per second, DSec creates
  sandboxes faster than that.
- ``RayNodeProxy`` implements ``dsec.node.api.NodeAgent`` over the actor handle, so the
  scheduler driver and the API service use a remote node exactly like a local one.

Wire: arguments and results are the protocol's pydantic models (Ray pickles them).
Errors travel as a ``NodeCallError`` value, not as a raised exception, because Ray
wraps raised exceptions in ``RayTaskError`` (losing ``DSecError.details`` and the
class the API maps to an HTTP status); the proxy re-raises the same ``dsec.errors``
class. ``exec_stream`` is a pull loop (``stream_open`` / ``stream_next``, each call
returns every event ready, waiting for at least one), which keeps the protocol's
back-pressure: the node only runs ahead of the reader by what one pull carries.

Cost: one proxied call is one actor round trip (~2-3 ms on one box; see
tests/integration/cluster for the measured exec figures).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec
from dsec.node.api import NODE_METHODS, ExecEvent, NodeCapacity

log = logging.getLogger("dsec.cluster")

NAMESPACE = "dsec"
RESOURCE_PREFIX = "dsec_node_"
ACTOR_PREFIX = "dsec-node-"


def node_resource(node_id: str) -> str:
    """The Ray custom resource that marks (and pins agents to) DSec node ``node_id``."""
    return RESOURCE_PREFIX + node_id


def actor_name(node_id: str) -> str:
    return ACTOR_PREFIX + node_id


def parse_address(address: str) -> str:
    """``ray://HOST:PORT`` or ``HOST:PORT`` (the head's GCS port, as ``ray start --head
    --port`` printed) -> ``HOST:PORT`` for ``ray.init``. DSec joins as a driver (not through
    Ray Client), so calls go straight to the actors."""
    addr = address.strip()
    addr = addr.removeprefix("ray://")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.InvalidArgument(f"cluster address {address!r} must be ray://HOST:PORT (the Ray head's "
                                     "GCS address, e.g. ray://127.0.0.1:6379)", field="cluster")
    return addr


class NodeCallError(BaseModel):
    """A DSecError (or any failure) of a remote node call, as a value."""

    cls: str
    message: str
    details: dict[str, Any] = {}

    @classmethod
    def of(cls, e: BaseException) -> NodeCallError:
        if isinstance(e, errors.DSecError):
            return cls(cls=type(e).__name__, message=e.message, details=_plain(e.details))
        return cls(cls="SandboxFailure", message=f"node agent error: {type(e).__name__}: {e}")

    def error(self) -> errors.DSecError:
        kind = getattr(errors, self.cls, None)
        if not (isinstance(kind, type) and issubclass(kind, errors.DSecError)):
            kind = errors.SandboxFailure
        return kind(self.message, **self.details)


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else str(v) for k, v in d.items()}


class NodeAgentServer:
    """What runs inside the actor: a node agent (real or fake) behind a generic dispatcher.

    Kept free of Ray so it is testable in-process; ``_actor_class`` wraps it with
    ``ray.remote``."""

    def __init__(self, kind: str = "local", overrides: dict[str, Any] | None = None) -> None:
        from dsec.config import load_settings

        settings = load_settings(**(overrides or {}))
        if kind == "local":
            from dsec.node.agent import LocalNodeAgent
            self.agent: Any = LocalNodeAgent(settings)
        elif kind == "fake":
            from dsec.testing import FakeNodeAgent
            self.agent = FakeNodeAgent(settings, node_id=settings.node_id or "fake-node")
        else:
            raise errors.InvalidArgument(f"node agent kind {kind!r} must be 'local' or 'fake'", field="kind")
        self._started = False
        self._start_lock = asyncio.Lock()
        self._streams: dict[str, tuple[asyncio.Queue[ExecEvent | NodeCallError | None], asyncio.Task[None]]] = {}

    async def start(self) -> NodeCapacity:
        async with self._start_lock:
            if not self._started:
                await self.agent.start()
                self._started = True
        return self.agent.capacity()  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Stop the agent's loops and destroy nothing (sandboxes are adopted on restart)."""
        for _, task in self._streams.values():
            task.cancel()
        self._streams.clear()
        if self._started:
            await self.agent.close()
            self._started = False

    def pid(self) -> int:
        return os.getpid()

    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in NODE_METHODS:
            return NodeCallError(cls="InvalidArgument", message=f"{method!r} is not a NodeAgent method")
        try:
            if not self._started:  # Ray restarted this actor after a crash: reconcile first
                await self.start()
            return await getattr(self.agent, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a value
            return NodeCallError.of(e)

    async def stream_open(self, sandbox_id: str, req: ExecRequest) -> str:
        if not self._started:
            await self.start()
        sid = secrets.token_hex(8)
        q: asyncio.Queue[ExecEvent | NodeCallError | None] = asyncio.Queue(maxsize=256)

        async def pump() -> None:
            try:
                async for ev in self.agent.exec_stream(sandbox_id, req):
                    await q.put(ev)
            except Exception as e:  # noqa: BLE001 - the reader gets it as its next item
                await q.put(NodeCallError.of(e))
            await q.put(None)

        self._streams[sid] = (q, asyncio.create_task(pump()))
        return sid

    async def stream_next(self, stream_id: str) -> list[ExecEvent | NodeCallError | None]:
        """Every event ready (at least one); ``None`` last means the stream ended."""
        entry = self._streams.get(stream_id)
        if entry is None:
            return [NodeCallError(cls="NotFound", message=f"exec stream {stream_id} is not open"), None]
        q = entry[0]
        out = [await q.get()]
        while out[-1] is not None and not q.empty():
            out.append(q.get_nowait())
        if out[-1] is None:
            self._streams.pop(stream_id, None)
        return out

    async def stream_close(self, stream_id: str) -> None:
        entry = self._streams.pop(stream_id, None)
        if entry is not None:
            entry[1].cancel()


_ACTOR: Any = None


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        import ray

        # Async actor: every method runs on the actor's event loop, so many calls are in
        # flight at once (execs, creates) like on the in-process agent.
        _ACTOR = ray.remote(NodeAgentServer)
    return _ACTOR


def connect(address: str, timeout_s: float = 30.0) -> None:
    """Join the Ray cluster at ``address`` as a driver (idempotent within a process)."""
    addr = parse_address(address)
    import ray

    if ray.is_initialized():
        return
    _reachable(addr, address, min(timeout_s, 5.0))
    host = addr.rpartition(":")[0]
    # A head on a loopback address (`dsec cluster up`: 127.0.0.2, workers .3, .4, ...) is
    # only reachable there: join through its raylet, as a process on that node would.
    local_ip = {"_node_ip_address": host} if host.startswith("127.") else {}
    try:
        ray.init(address=addr, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False, **local_ip)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise errors.InvalidArgument(f"cannot reach the Ray cluster at {address!r}: {e}; start one with "
                                     "`dsec cluster up` or `ray start --head`", field="cluster") from None


def _reachable(addr: str, given: str, timeout_s: float) -> None:
    """Fail fast (ray.init retries for a minute) when nothing listens at the address."""
    import socket

    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise errors.InvalidArgument(f"cannot reach the Ray cluster at {given!r} ({e.strerror or e}); start one "
                                     "with `dsec cluster up` or `ray start --head`, or check the address",
                                     field="cluster") from None


def dsec_nodes() -> dict[str, dict[str, Any]]:
    """DSec node id -> Ray node entry (``NodeManagerAddress``, ``Alive``, ``NodeID``, ...)."""
    import ray

    out: dict[str, dict[str, Any]] = {}
    for n in ray.nodes():
        for res in n.get("Resources", {}) or {}:
            if res.startswith(RESOURCE_PREFIX):
                nid = res[len(RESOURCE_PREFIX):]
                if nid not in out or n.get("Alive"):
                    out[nid] = n
    return out


def get_agent(node_id: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:
        return None


def ensure_agent(node_id: str, kind: str = "local", overrides: dict[str, Any] | None = None) -> Any:
    """The node's agent actor, started (detached, pinned to the node) if it is not running."""
    handle = get_agent(node_id)
    if handle is not None:
        return handle
    over = {"node_id": node_id, **(overrides or {})}
    return _actor_class().options(
        name=actor_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=10000, max_restarts=-1,
        resources={node_resource(node_id): 0.001}).remote(kind, over)


async def ensure_agents(kind: str = "local", overrides: dict[str, Any] | None = None,
                        timeout_s: float = 60.0) -> dict[str, RayNodeProxy]:
    """Start (or find) the agent of every live DSec node; return started proxies by node id."""
    proxies = {nid: RayNodeProxy(nid, ensure_agent(nid, kind, overrides), timeout_s)
               for nid, n in sorted(dsec_nodes().items()) if n.get("Alive")}
    await asyncio.gather(*(p.start() for p in proxies.values()))
    return proxies


class RayNodeProxy:
    """``NodeAgent`` over a node agent actor (see module docstring)."""

    def __init__(self, node_id: str, handle: Any, control_timeout_s: float = 60.0) -> None:
        self.node_id = node_id
        self.handle = handle
        self.control_timeout_s = control_timeout_s
        self._capacity: NodeCapacity | None = None
        # Set by the control plane's heartbeat when the node is judged lost: every call,
        # those in flight included, ends with NodeLost at once instead of waiting on a
        # raylet that will never answer (Ray itself notices a dead node after ~30 s).
        self.lost = False
        self._lost_fut: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Start the remote agent (reconcile there) and cache its capacity."""
        try:
            self._capacity = await asyncio.wait_for(self._await(self.handle.start.remote()), self.control_timeout_s)
        except TimeoutError:
            raise errors.Timeout(f"node {self.node_id}: its agent did not start within "
                                 f"{self.control_timeout_s:g}s", node=self.node_id) from None

    def _lost_error(self) -> errors.NodeLost:
        return errors.NodeLost(f"node {self.node_id} lost (no heartbeat): its sandboxes are unreachable; create "
                               "a new sandbox or restore a checkpoint", node=self.node_id)

    def mark_lost(self) -> None:
        """The node is lost: fail every call in flight and every new one with NodeLost."""
        self.lost = True
        if self._lost_fut is not None and not self._lost_fut.done():
            self._lost_fut.set_result(None)

    def mark_back(self) -> None:
        self.lost = False
        self._lost_fut = None

    async def probe(self, timeout_s: float) -> Any:
        """One heartbeat: the agent's health within ``timeout_s`` (also while lost: that is
        how a node that comes back is seen). TimeoutError or NodeLost when it does not answer."""
        out = await asyncio.wait_for(self._await(self.handle.call.remote("health", (), {}), heartbeat=True),
                                     timeout_s)
        if isinstance(out, NodeCallError):
            raise out.error()
        return out

    async def _await(self, ref: Any, heartbeat: bool = False) -> Any:
        """One actor round trip; Ray's failures become DSec errors: a node (or agent) that
        is gone is NodeLost (410), never a hang or an internal error."""
        import ray.exceptions as rx

        if heartbeat:
            waiter = ref
        else:
            if self.lost:
                raise self._lost_error()
            loop = asyncio.get_running_loop()
            if self._lost_fut is None or self._lost_fut.get_loop() is not loop:
                self._lost_fut = loop.create_future()
            waiter = self._race(ref, self._lost_fut)
        try:
            return await waiter
        except (rx.RayActorError, rx.ActorUnavailableError, rx.NodeDiedError, rx.LocalRayletDiedError,
                rx.ActorUnschedulableError) as e:
            raise errors.NodeLost(f"node {self.node_id} does not answer ({type(e).__name__}): its sandboxes are "
                                  "unreachable now; retry, create a new sandbox or restore a checkpoint",
                                  node=self.node_id) from None
        except rx.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, errors.DSecError):
                raise NodeCallError.of(cause).error() from None
            raise errors.SandboxFailure(f"node {self.node_id}: agent error: {cause or e}", node=self.node_id) from None

    async def _race(self, ref: Any, lost: asyncio.Future[None]) -> Any:
        call = asyncio.ensure_future(ref)
        try:
            await asyncio.wait((call, lost), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if not call.done():
            call.cancel()
            raise self._lost_error()
        return call.result()

    async def close(self) -> None:
        """Nothing to do here: the agent is detached and keeps serving other callers."""

    async def shutdown(self) -> None:
        """Stop the remote agent's loops (``dsec cluster down``); sandboxes are not destroyed."""
        await self._await(self.handle.close.remote())

    async def agent_pid(self) -> int:
        return int(await self._await(self.handle.pid.remote()))

    def capacity(self) -> NodeCapacity:
        if self._capacity is None:
            raise errors.Conflict(f"node {self.node_id}: proxy not started (call start() first)", node=self.node_id)
        return self._capacity

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await self._await(self.handle.call.remote(method, args, kwargs))
        if isinstance(out, NodeCallError):
            raise out.error()
        return out

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        sid = await self._await(self.handle.stream_open.remote(sandbox_id, req))
        done = False
        try:
            while not done:
                for item in await self._await(self.handle.stream_next.remote(sid)):
                    if item is None:
                        done = True
                        break
                    if isinstance(item, NodeCallError):
                        raise item.error()
                    yield item
        finally:
            if not done:
                self.handle.stream_close.remote(sid)

    # The protocol's request/response methods, each one actor round trip.
    async def usage(self) -> Any:
        return await self._call("usage")

    async def health(self) -> Any:
        return await self._call("health")

    async def layer_index(self) -> Any:
        return await self._call("layer_index")

    async def resolve_image(self, ref: str) -> Any:
        return await self._call("resolve_image", ref)

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, restore: Any = None, fence: int | None = None) -> Any:
        return await self._call("create", spec, sandbox_id=sandbox_id, tenant=tenant, pooled=pooled,
                                restore=restore, fence=fence)

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None = None, *,
                    fence: int | None = None) -> Any:
        return await self._call("claim", sandbox_id, spec, tenant, fence=fence)

    async def get(self, sandbox_id: str) -> Any:
        return await self._call("get", sandbox_id)

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> Any:
        return await self._call("list", labels, tenant)

    async def destroy(self, sandbox_id: str, *, fence: int | None = None) -> None:
        await self._call("destroy", sandbox_id, fence=fence)

    async def raise_fence(self, token: int) -> Any:
        return await self._call("raise_fence", token)

    async def set_timeout(self, sandbox_id: str, timeout: float) -> Any:
        return await self._call("set_timeout", sandbox_id, timeout)

    async def reset(self, sandbox_id: str) -> Any:
        return await self._call("reset", sandbox_id)

    async def cpu_used(self, sandbox_id: str) -> Any:
        return await self._call("cpu_used", sandbox_id)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> Any:
        return await self._call("exec", sandbox_id, req)

    async def processes(self, sandbox_id: str) -> Any:
        return await self._call("processes", sandbox_id)

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        await self._call("kill_process", sandbox_id, pid, signal)

    async def read_file(self, sandbox_id: str, path: str) -> Any:
        return await self._call("read_file", sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._call("write_file", sandbox_id, path, data, mode)

    async def list_files(self, sandbox_id: str, path: str) -> Any:
        return await self._call("list_files", sandbox_id, path)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await self._call("remove_file", sandbox_id, path, recursive)

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None:
        await self._call("upload_tar", sandbox_id, path, tar_bytes)

    async def download_tar(self, sandbox_id: str, path: str) -> Any:
        return await self._call("download_tar", sandbox_id, path)

    async def update_network(self, sandbox_id: str, allow: list[str]) -> Any:
        return await self._call("update_network", sandbox_id, allow)

    async def network_denied_events(self, sandbox_id: str, since_seq: int = 0) -> Any:
        return await self._call("network_denied_events", sandbox_id, since_seq)

    async def checkpoint(self, sandbox_id: str, tenant: str) -> Any:
        return await self._call("checkpoint", sandbox_id, tenant)
