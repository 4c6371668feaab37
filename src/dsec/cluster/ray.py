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

Two transports, one protocol:

- **Direct data path** (``dsec.cluster.dataplane``), used for every ``NodeAgent`` call and
  ``exec_stream`` when the agent serves it (``cluster_data_direct``, default on): the
  actor also listens on its Ray node's address (ephemeral port) and hands the proxy its
  endpoint and a random per-process token through Ray (``data_endpoint``, fetched in
  ``start()``). The proxy keeps one authenticated connection per node and event loop and
  multiplexes calls over it with request ids: JSON frames of the protocol's pydantic models
  (no pickle), bounded frame sizes, timed-out partial reads, credit-based back-pressure for
  streams. A call larger than a frame goes through Ray; a result larger than a frame is
  kept on the node and fetched once through Ray (``take_result``).
- **Ray actor calls** for control (``start``, ``close``, ``pid``, the heartbeat ``probe``,
  endpoint discovery) and as the fallback (no endpoint). Arguments and results are the
  protocol's models (Ray pickles them). On this path control calls made in one event-loop
  pass (``BATCHED``: the driver's creates of one batch for a node) share one actor round
  trip (``call_many``): one Ray call per placement capped the control plane at ~200-250
  placements/s here (``dsec bench cluster``).

Errors travel as a ``NodeCallError`` value on both paths (not as a raised exception: Ray
wraps those in ``RayTaskError``, losing ``DSecError.details`` and the class the API maps
to an HTTP status); the proxy re-raises the same ``dsec.errors`` class with the same
details. Node loss: ``mark_lost`` fails calls in flight on either path with NodeLost at
once; a dead endpoint (agent killed: connection reset or refused) is NodeLost too, and the
proxy asks Ray for the endpoint again (a restarted agent has a new port and token).
On the Ray path ``exec_stream`` is a pull loop (``stream_open`` / ``stream_next``, each
call returns every event ready, waiting for at least one), which keeps the protocol's
back-pressure: the node only runs ahead of the reader by what one pull carries.

Cost (this 2-core box, fake agent behind a real actor, median of 300 execs): 0.31 ms per
direct call against 1.78 ms per Ray actor call. Exec through a 3-node cluster against one
node: docs/cluster.md ("Measured").
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dsec import errors
from dsec.cluster.dataplane import ERR as _ERR
from dsec.cluster.dataplane import OK as _OK
from dsec.cluster.dataplane import DataClient, DataEndpoint, DataServer, NodeCallError, Refused, codec
from dsec.cluster.dataplane import frame_size as _frame_size
from dsec.models import ExecRequest, SandboxSpec
from dsec.node.api import EPISODE_METHODS, NODE_METHODS, ExecEvent, NodeCapacity

__all__ = ["NodeAgentServer", "NodeCallError", "RayNodeProxy", "connect", "dsec_nodes", "ensure_agent",
           "ensure_agents", "get_agent", "node_resource", "parse_address"]

log = logging.getLogger("dsec.cluster")

NAMESPACE = "dsec"
RESOURCE_PREFIX = "dsec_node_"
ACTOR_PREFIX = "dsec-node-"
DIRECT_RETRY_S = 30.0  # an unreachable data endpoint (agent alive) is retried after this


# Control-plane calls that, when they go through Ray (no direct data endpoint, or it is
# down), the proxy coalesces per event-loop pass into one actor round trip (``call_many``).
# Exec and file calls keep one call each: their callers are few per node and latency-bound.
BATCHED = frozenset({"create", "claim", "destroy", "get", "list", "usage", "cpu_used"})


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


def _plain_asyncio_policy() -> None:
    """Ray installs uvloop's policy in every worker; pyroute2 (sandbox networking) opens
    its own loops with ``asyncio.new_event_loop()`` and hands them netlink sockets, which
    uvloop refuses ("cannot open a UDP handle, invalid family 16": every create with a
    network policy failed on a Ray node). Loops made from now on are plain asyncio; the
    actor's running loop is left as it is."""
    policy = asyncio.get_event_loop_policy()
    if type(policy).__module__.split(".")[0] == "uvloop":
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())


class NodeAgentServer:
    """What runs inside the actor: a node agent (real or fake) behind a generic dispatcher.

    Kept free of Ray so it is testable in-process; ``_actor_class`` wraps it with
    ``ray.remote``."""

    def __init__(self, kind: str = "local", overrides: dict[str, Any] | None = None) -> None:
        from dsec.config import load_settings

        settings = load_settings(**(overrides or {}))
        self.settings = settings
        _plain_asyncio_policy()
        if kind == "local":
            from dsec.node.agent import LocalNodeAgent
            self.agent: Any = LocalNodeAgent(settings)
        elif kind == "fake":
            from dsec.testing import FakeNodeAgent
            self.agent = FakeNodeAgent(settings, node_id=settings.node_id or "fake-node")
        else:
            raise errors.InvalidArgument(f"node agent kind {kind!r} must be 'local' or 'fake'", field="kind")
        self._started = False
        self._kind = kind
        self._peers: Any = None
        self._start_lock = asyncio.Lock()
        self._streams: dict[str, tuple[asyncio.Queue[ExecEvent | NodeCallError | None], asyncio.Task[None]]] = {}
        self._data: DataServer | None = None
        self._endpoint: DataEndpoint | None = None

    async def data_endpoint(self, host: str | None = None) -> DataEndpoint | None:
        """The direct data endpoint of this agent (started on first ask, on this node's
        address; ``None`` when ``cluster_data_direct`` is off or it cannot listen): the
        proxy's fast path. Its token is new with every agent process."""
        if not self.settings.cluster_data_direct:
            return None
        if not self._started:
            await self.start()
        if self._endpoint is None:
            async with self._start_lock:
                if self._endpoint is None:
                    server = DataServer(self.call, self._open_stream, NODE_METHODS,
                                        self.settings.cluster_data_max_frame_bytes,
                                        self.settings.cluster_data_read_timeout_s)
                    try:
                        self._endpoint = await server.start(host or _node_ip())
                    except OSError as e:  # the Ray path still works
                        log.warning("node %s: no direct data endpoint (%s); node calls go through Ray",
                                    self.settings.node_id, e)
                        return None
                    self._data = server
        return self._endpoint

    async def take_result(self, key: str) -> Any:
        """A direct call's result too large for a frame, fetched once through Ray."""
        try:
            if self._data is None:
                raise errors.NotFound(f"no pending result {key!r}: the data endpoint is not running")
            return self._data.take(key)
        except errors.DSecError as e:
            return NodeCallError.of(e)

    async def _open_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        if not self._started:
            await self.start()
        return self.agent.exec_stream(sandbox_id, req)  # type: ignore[no-any-return]

    async def start(self) -> NodeCapacity:
        async with self._start_lock:
            if not self._started:
                await self.agent.start()
                self._started = True
                if self._kind == "local":  # serve blobs to peers, fetch from them (dsec.cluster.p2p)
                    from dsec.cluster.p2p import attach
                    self._peers = await asyncio.to_thread(attach, self.agent)
        return self.agent.capacity()  # type: ignore[no-any-return]

    async def close(self) -> None:
        """Stop the agent's loops and destroy nothing (sandboxes are adopted on restart)."""
        for _, task in self._streams.values():
            task.cancel()
        self._streams.clear()
        if self._data is not None:  # proxies see their connection drop and ask for the new endpoint
            await self._data.close()
            self._data, self._endpoint = None, None
        if self._started:
            if self._peers is not None:
                self._peers.close()
                self._peers = None
            await self.agent.close()
            self._started = False

    def pid(self) -> int:
        return os.getpid()

    async def p2p_admin(self, op: str, args: dict[str, Any]) -> Any:
        """Operator/benchmark operations on this node's images (dsec.cluster.p2p.NodePeers.admin)."""
        if self._peers is None:
            return NodeCallError(cls="Conflict", message="peer-to-peer is off on this node (p2p_enabled)")
        try:
            return await asyncio.to_thread(self._peers.admin, op, args)
        except Exception as e:  # noqa: BLE001 - back to the caller as a value
            return NodeCallError.of(e)

    async def cluster_gc(self, now_offset_s: float = 0.0) -> list[str]:
        """Run this node's share of the cluster layer GC now (dsec.cluster.layer_gc), as if
        ``now_offset_s`` more seconds had passed; the blobs it removed."""
        if self._peers is None or self._peers.gc is None:
            return []
        import time
        return await asyncio.to_thread(self._peers.gc.run_once, time.time() + now_offset_s)  # type: ignore[no-any-return]

    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in NODE_METHODS and method not in EPISODE_METHODS:
            return NodeCallError(cls="InvalidArgument", message=f"{method!r} is not a NodeAgent method")
        try:
            if not self._started:  # Ray restarted this actor after a crash: reconcile first
                await self.start()
            return await getattr(self.agent, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as a value
            return NodeCallError.of(e)

    async def call_many(self, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Several calls in one actor round trip (the proxy coalesces the calls its callers
        made in one event-loop pass): run concurrently, as that many ``call``s would be;
        each result (or NodeCallError) in order."""
        return list(await asyncio.gather(*(self.call(m, a, k) for m, a, k in calls)))

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


def _node_ip() -> str:
    """This Ray node's address (``--node-ip-address``: 127.0.0.x under `dsec cluster up`);
    loopback outside Ray (in-process tests)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "127.0.0.1"
    import ray.util

    return str(ray.util.get_node_ip_address())


class LocalHandle:
    """An actor handle over an in-process ``NodeAgentServer`` (``handle.m.remote(...)`` is
    the awaitable call): the proxy and its direct data path without Ray, for tests."""

    class _Method:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
            """Started at once, like a Ray call (fire-and-forget calls run too)."""
            out = self.fn(*args, **kwargs)
            if asyncio.iscoroutine(out):
                return asyncio.ensure_future(out)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(out)
            return fut

    def __init__(self, server: NodeAgentServer) -> None:
        self.server = server

    def __getattr__(self, name: str) -> Any:
        return LocalHandle._Method(getattr(self.server, name))


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

    def __init__(self, node_id: str, handle: Any, control_timeout_s: float = 60.0, direct: bool = True) -> None:
        self.node_id = node_id
        self.handle = handle
        self.control_timeout_s = control_timeout_s
        self._capacity: NodeCapacity | None = None
        # Set by the control plane's heartbeat when the node is judged lost: every call,
        # those in flight included, ends with NodeLost at once instead of waiting on a
        # raylet that will never answer (Ray itself notices a dead node after ~30 s).
        self.lost = False
        self._lost_fut: asyncio.Future[None] | None = None
        # The direct data path (dsec.cluster.dataplane): off when ``direct`` is False or the
        # agent serves no endpoint; then every call is one Ray round trip.
        self.direct = direct
        self._endpoint: DataEndpoint | None = None
        self._no_endpoint = False
        self._client: DataClient | None = None
        self._connect_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._direct_off_until = 0.0  # monotonic: the endpoint was unreachable, use Ray until then
        self.stats = {"direct": 0, "ray": 0}  # protocol calls per transport
        # Told of every sandbox created or claimed here (ClusterRouter learns where it
        # lives, also for placements the scheduler driver makes on this proxy directly).
        self.on_placed: Callable[[Any], None] | None = None
        # Control calls queued in this event-loop pass (sent together by _flush).
        self._queued: list[tuple[str, tuple[Any, ...], dict[str, Any], asyncio.Future[Any]]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self.batching = {"round_trips": 0, "calls": 0}  # control calls sent, and in how many trips

    async def start(self) -> None:
        """Start the remote agent (reconcile there) and cache its capacity (and the data
        endpoint, fetched alongside: no extra round trip before the first call)."""
        async def endpoint() -> None:
            if self.direct:
                self._set_endpoint(await self._await(self.handle.data_endpoint.remote()))

        try:
            self._capacity, _ = await asyncio.wait_for(
                asyncio.gather(self._await(self.handle.start.remote()), endpoint()), self.control_timeout_s)
        except TimeoutError:
            raise errors.Timeout(f"node {self.node_id}: its agent did not start within "
                                 f"{self.control_timeout_s:g}s", node=self.node_id) from None

    def _set_endpoint(self, ep: DataEndpoint | None) -> None:
        self._endpoint = ep
        self._no_endpoint = ep is None

    def _conn_lost(self, reason: str) -> errors.DSecError:
        if self.lost:
            return self._lost_error()
        return errors.NodeLost(f"node {self.node_id} does not answer ({reason}): its sandboxes are unreachable "
                               "now; retry, create a new sandbox or restore a checkpoint", node=self.node_id)

    async def _data_client(self) -> DataClient | None:
        """The live direct connection of this event loop, (re)connected on demand; None:
        use Ray. A refused or dead endpoint is asked again through Ray (the agent may have
        been restarted with a new endpoint and token; a dead agent makes that NodeLost). If
        the agent answers Ray but its endpoint cannot be reached (a firewall between the
        machines), calls go through Ray for ``DIRECT_RETRY_S`` before the next attempt."""
        c = self._client
        loop = asyncio.get_running_loop()
        if c is not None and c.alive and c.loop is loop:
            return c
        if not self.direct or self._no_endpoint or time.monotonic() < self._direct_off_until:
            return None
        if self._connect_lock is None or self._connect_lock[0] is not loop:
            self._connect_lock = (loop, asyncio.Lock())
        async with self._connect_lock[1]:  # one connect for every caller waiting on it
            c = self._client
            if c is not None and c.alive and c.loop is loop:
                return c
            self._client = None
            last: BaseException | None = None
            for fresh in (False, True):
                if fresh or self._endpoint is None:
                    self._set_endpoint(await self._await(self.handle.data_endpoint.remote()))
                    if self._endpoint is None:
                        return None
                assert self._endpoint is not None
                c = DataClient(self._endpoint, self._conn_lost)
                try:
                    await c.connect(min(self.control_timeout_s, self._endpoint.read_timeout_s))
                except (OSError, TimeoutError, Refused) as e:
                    last = e
                    continue
                if self.lost:
                    c.close()
                    raise self._lost_error()
                self._client = c
                return c
            self._direct_off_until = time.monotonic() + DIRECT_RETRY_S
            ep = self._endpoint
            log.warning("node %s: its agent answers but its data endpoint %s:%s does not (%s: %s); calls go "
                        "through Ray for %gs", self.node_id, ep and ep.host, ep and ep.port, type(last).__name__,
                        last, DIRECT_RETRY_S)
            return None

    def _lost_error(self) -> errors.NodeLost:
        return errors.NodeLost(f"node {self.node_id} lost (no heartbeat): its sandboxes are unreachable; create "
                               "a new sandbox or restore a checkpoint", node=self.node_id)

    def mark_lost(self) -> None:
        """The node is lost: fail every call in flight and every new one with NodeLost."""
        self.lost = True
        if self._lost_fut is not None and not self._lost_fut.done():
            self._lost_fut.set_result(None)
        if self._client is not None:
            self._client.abort("lost")  # direct calls in flight end now too (as _lost_error)
            self._client = None

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
        """Drop the direct connection; the agent is detached and keeps serving other callers."""
        if self._client is not None:
            self._client.close()
            self._client = None

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
        if self.lost:
            raise self._lost_error()
        c = await self._data_client()
        if c is not None:
            cd = codec(method)
            try:
                body = cd.encode_args(args, kwargs)
            except (TypeError, ValueError) as e:
                raise errors.InvalidArgument(f"node call {method}: {e}") from None
            if _frame_size(method, len(body)) <= c.ep.max_frame:  # larger: through Ray
                self.stats["direct"] += 1
                kind, data = await c.call(method, body)
                if kind == _OK:
                    return cd.decode_result(data)
                if kind == _ERR:
                    raise NodeCallError.model_validate_json(data).error()
                out = await self._await(self.handle.take_result.remote(data.decode()))  # VIA_RAY: too large
                if isinstance(out, NodeCallError):
                    raise out.error()
                return out
        self.stats["ray"] += 1
        if method in BATCHED:  # through Ray: the calls of this loop pass share one round trip
            out = await self._batched(method, args, kwargs)
        else:
            out = await self._await(self.handle.call.remote(method, args, kwargs))
        if isinstance(out, NodeCallError):
            raise out.error()
        return out

    def _batched(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        """Queue one control call; every call queued in this event-loop pass goes out as ONE
        actor round trip (``call_many``) on the next pass. No call waits longer than it takes
        the loop to come round, and the scheduler's placements of one batch for this node
        (up to ``node_parallel_creates`` at once) share one hop: Ray's per-call cost, not
        the work, bounded placements/s (see dsec.bench.cluster)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queued.append((method, args, kwargs, fut))
        if len(self._queued) == 1:
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        calls, self._queued = self._queued, []
        if not calls:
            return
        self.batching["round_trips"] += 1
        self.batching["calls"] += len(calls)
        if len(calls) == 1:
            m, a, k, _ = calls[0]
            ref = self.handle.call.remote(m, a, k)
        else:
            ref = self.handle.call_many.remote([(m, a, k) for m, a, k, _ in calls])
        task = asyncio.ensure_future(self._deliver(ref, [c[3] for c in calls]))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _deliver(self, ref: Any, futs: list[asyncio.Future[Any]]) -> None:
        try:
            out = await self._await(ref)
        except BaseException as e:  # NodeLost & co. (and cancellation) reach every caller of the batch
            for f in futs:
                if not f.done():
                    f.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        for f, r in zip(futs, out if len(futs) > 1 else [out]):
            if not f.done():  # a caller that gave up (cancelled) just misses its answer
                f.set_result(r)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        if self.lost:
            raise self._lost_error()
        c = await self._data_client()
        if c is None:
            async for ev in self._ray_exec_stream(sandbox_id, req):
                yield ev
            return
        cd = codec("exec_stream")
        self.stats["direct"] += 1
        events = c.stream("exec_stream", cd.encode_args((sandbox_id, req), {}))
        try:
            async for kind, data in events:
                if kind == _ERR:
                    raise NodeCallError.model_validate_json(data).error()
                yield cd.decode_result(data)
        finally:
            await events.aclose()  # an early exit cancels the stream on the node

    async def _ray_exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        self.stats["ray"] += 1
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

    # The protocol's request/response methods: direct when the endpoint answers, else one actor round trip.
    async def usage(self) -> Any:
        return await self._call("usage")

    async def health(self) -> Any:
        return await self._call("health")

    async def layer_index(self) -> Any:
        return await self._call("layer_index")

    async def resolve_image(self, ref: str) -> Any:
        return await self._call("resolve_image", ref)

    async def p2p_admin(self, op: str, args: dict[str, Any]) -> Any:
        """An image operation on this node (``NodePeers.admin``: pull, forget, prefetch,
        stats), through Ray: the node's error comes back as its DSecError."""
        out = await self._await(self.handle.p2p_admin.remote(op, args))
        if isinstance(out, NodeCallError):
            raise out.error()
        return out

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, restore: Any = None, fence: int | None = None) -> Any:
        return self._placed(await self._call("create", spec, sandbox_id=sandbox_id, tenant=tenant, pooled=pooled,
                                             restore=restore, fence=fence))

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None = None, *,
                    fence: int | None = None) -> Any:
        return self._placed(await self._call("claim", sandbox_id, spec, tenant, fence=fence))

    def _placed(self, info: Any) -> Any:
        if self.on_placed is not None:
            self.on_placed(info)
        return info

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

    async def episode(self, op: str, key: str, args: dict[str, Any]) -> Any:
        """An episode call run on this node (dsec.checkpoints.node_episodes). Through Ray, not
        the direct endpoint: its codecs are derived from the typed ``NodeAgent`` methods, and
        an episode call carries loosely typed ``args`` (models travel as Ray pickles them)."""
        if self.lost:
            raise self._lost_error()
        out = await self._await(self.handle.call.remote("episode", (op, key, args), {}))
        if isinstance(out, NodeCallError):
            raise out.error()
        return out
