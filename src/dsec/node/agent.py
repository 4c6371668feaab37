"""LocalNodeAgent: the in-process NodeAgent (embedded default) over SandboxManager.

Exec goes through the sandbox's own init agent over its host-only socket (container
tier, ~1 ms) or through ``runsc exec`` + the agent's one-shot mode (gVisor tier).
Files go through host-side openat2 on the sandbox root (``dsec.node.files``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from dsec.config import Settings
from dsec.errors import InvalidArgument
from dsec.models import BackgroundProcess, ExecRequest, ExecResult, FileEntry, SandboxInfo, SandboxSpec
from dsec.node.api import (
    CheckpointInfo,
    DeniedAttempt,
    ExecEvent,
    FenceGate,
    ImageLayers,
    LayerIndex,
    NodeCapacity,
    NodeHealth,
    NodeUsage,
    RestoreSource,
)
from dsec.node.files import SandboxFS
from dsec.node.manager import SandboxManager
from dsec.runtime import agent_client as ac
from dsec.runtime import gvisor_relay
from dsec.runtime.runsc_exec import RunscExit, runsc_exec_stream

log = logging.getLogger("dsec.node")


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


class LocalNodeAgent:
    def __init__(self, settings: Settings, images: Any | None = None, network: Any | None = None) -> None:
        self.settings = settings
        self.manager = SandboxManager(settings, images=images, network=None)
        self.node_id = settings.node_id or settings.host
        self._started_at = 0.0
        self._usage: Any = None  # node_id -> busy fraction (dsec.node.usage), made on first use
        self._checkpoints: Any = None  # dsec.checkpoints.sandbox_ckpt.SandboxCheckpoints, made on first use
        self._episodes: Any = None  # dsec.checkpoints.node_episodes.NodeEpisodes, made on first use
        self._reaper: asyncio.Task[None] | None = None
        if network is None and settings.net_enabled:
            from dsec.net import NetworkManager
            network = NetworkManager(settings)
        self._network = network
        self._net_lock = asyncio.Lock()
        self._cpu_base: dict[str, tuple[float, float]] = {}  # sandbox -> (CPU s, time) at hand-over
        # Scheduler leader fencing (issue 13): a deposed leader's placements/destroys are refused.
        self.fence = FenceGate(self.node_id, settings.home / "node" / "scheduler_fence")
        # idle kept-alive exec connections of a sandbox die with it: close them at teardown
        self.manager.before_teardown.append(self._forget_agent)

    async def _ensure_network(self) -> Any:
        """Start networking on first need: nodes that never open egress pay nothing."""
        if self.manager.network is not None:
            return self.manager.network
        if self._network is None:
            from dsec.errors import InvalidArgument as _IA
            raise _IA("network allow-lists are disabled on this node (DSEC_NET_ENABLED=false)", field="network")
        async with self._net_lock:
            if self.manager.network is None:
                await self._network.start()
                self.manager.network = self._network
        return self._network

    @property
    def network(self) -> Any:
        return self.manager.network

    @property
    def images(self) -> Any:
        return self.manager.images

    async def start(self) -> None:
        if any(r.info.network is not None and r.info.state.value not in ("stopped", "destroyed")
               for r in self.manager.records.all()):
            await self._ensure_network()  # sandboxes with slots to adopt or clean
        await self.manager.start()
        if self.manager.network is not None:
            await self.manager.network.reconcile(set(self.manager.live))
        self._reaper = asyncio.create_task(self._reap_loop(), name="dsec-reaper")
        self._started_at = time.time()

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self.manager.network is not None:
            await self.manager.network.close()
        self.manager.close()

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            try:
                await self.manager.reap_once()
            except Exception:
                log.exception("reaper pass failed")

    def capacity(self) -> NodeCapacity:
        m = self.manager
        return NodeCapacity(node_id=self.node_id, cpu=m.cpu, memory=m.memory, disk=m.disk,
                            max_sandboxes=self.settings.node_max_sandboxes, isolation=m.isolations)

    # --- lifecycle ----------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, restore: RestoreSource | None = None,
                     extra_lower_dirs: list[Path] | None = None, fence: int | None = None) -> SandboxInfo:
        """``extra_lower_dirs`` is node-local (checkpoint engine on this node); remote callers
        pass ``restore`` and the node unpacks the checkpoint's layers itself."""
        self.fence.check(fence, f"creating {sandbox_id or 'a sandbox'}")
        if sandbox_id is not None and sandbox_id in self.manager.live:
            return await self._same_create(sandbox_id, tenant)
        if restore is not None:
            if pooled or extra_lower_dirs:
                raise InvalidArgument("a restore is never a pool member and brings its own layers", field="restore")
            _, make = await self.checkpoints.prepare_restore(restore.tenant, restore.checkpoint_id)
            from dsec.ids import new_sandbox_id
            return await make(spec, sandbox_id or new_sandbox_id(), tenant or "")
        if spec.network is not None:
            await self._ensure_network()
        await self._ensure_image(spec.image)
        info = await self.manager.create(spec, sandbox_id=sandbox_id, tenant=tenant, pooled=pooled,
                                         extra_lower_dirs=extra_lower_dirs)
        if pooled:
            await self._keep_agent_conn(info.id)
        elif "task" in spec.labels:
            self._mark_cpu_base(info.id)
        return info

    async def _keep_agent_conn(self, sandbox_id: str) -> None:
        """One trivial exec into a new warm-pool member leaves a kept-alive agent connection
        (its handler already forked) for the first exec of whoever claims it: that exec then
        skips the connect and the fork, ~1-1.5 ms of a warm hand-over's budget (issue 15; a
        recycled member gets the same, ``SandboxManager.start_recycle``). Off the user's path:
        the member is not in the pool yet. Best effort, and only over an agent socket (an
        old gVisor sandbox without one would pay a whole ``runsc exec``)."""
        rec = self.manager.live.get(sandbox_id)
        sock = self._agent_sock(sandbox_id, rec) if rec is not None else None
        if sock is None:
            return
        await ac.agent_prime(sock)

    async def _same_create(self, sandbox_id: str, tenant: str | None) -> SandboxInfo:
        """A create for an id this node already holds is the same create sent twice (a
        scheduler leader died with it in flight and its successor placed the request again,
        issue 13): answer that sandbox once it is built, never a second one with its id."""
        rec = self.manager.live[sandbox_id]
        if rec.info.tenant != tenant:
            from dsec.errors import Conflict
            raise Conflict(f"sandbox {sandbox_id} already exists on node {self.node_id}", sandbox_id=sandbox_id)
        deadline = time.monotonic() + self.settings.client_timeout_s
        while rec.info.state.value == "creating" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return await self.get(sandbox_id)

    async def _ensure_image(self, ref: str) -> None:
        """Pull on placement: an image this node lacks is pulled (peers first on a cluster,
        then ``image_registry``; digests verified, single flight per ref and per blob)
        before the create. The scheduler placed it here knowing the node misses layers."""
        from dsec.errors import NotFound

        store = self.manager.images
        if not hasattr(store, "resolve_or_pull"):
            return
        try:
            store.resolve_fast(ref)
        except NotFound:
            await asyncio.to_thread(store.resolve_or_pull, ref)  # NotFound again if no registry has it

    async def update_network(self, sandbox_id: str, allow: list[str]) -> SandboxInfo:
        """Replace a live sandbox's egress allow-list (takes effect at once, host-side)."""
        rec = self.manager.live_record(sandbox_id)
        if rec.info.network is None:
            raise InvalidArgument(f"sandbox {sandbox_id} was created with network=None (no interface); "
                                  "create it with network=[] to change its allow-list later",
                                  sandbox_id=sandbox_id)
        net = await self._ensure_network()
        await net.update(sandbox_id, allow)
        rec.info = rec.info.model_copy(update={"network": allow})
        self.manager.records.put(rec)
        return self.manager.info(rec)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Back to the pristine state as created (processes, files, /dev, IPC, limits,
        network), same id and TTL; see SandboxManager.reset."""
        info = await self.manager.reset(sandbox_id)
        if sandbox_id in self._cpu_base:
            self._mark_cpu_base(sandbox_id)
        return info

    async def network_denied_events(self, sandbox_id: str, since_seq: int = 0) -> list[DeniedAttempt]:
        """Also after the sandbox is gone (its last attempts, kept a while by the network
        manager): the API server reads them at teardown through this protocol only."""
        net = self.manager.network
        if net is None or not net.knows(sandbox_id):
            self.manager.get_record(sandbox_id)  # NotFound for an unknown id
            return []
        return list(net.denied_events(sandbox_id, since_seq))

    # --- node views (usage, health, images) ---------------------------------------------

    async def usage(self) -> NodeUsage:
        if self._usage is None:
            from dsec.node.usage import local_usage_probe
            self._usage = local_usage_probe(self.manager.cgroup_parent, self.manager.cpu)
        busy = float(self._usage(self.node_id))
        return NodeUsage(node_id=self.node_id, cpu_busy=busy, sandboxes=len(self.manager.live),
                         active_execs=sum(self.manager.active_execs.values()))

    async def health(self) -> NodeHealth:
        import os
        import socket

        problems = []
        if not self.manager.isolations:
            problems.append(f"no OCI runtime found ({self.settings.runc_path!r}, {self.settings.runsc_path!r}): "
                            "install runc (scripts/setup.sh) on this node")
        if not self._started_at:
            problems.append("node agent not started")
        from dsec.images.registry_ops import PULLS

        return NodeHealth(node_id=self.node_id, ok=not problems, pid=os.getpid(), hostname=socket.gethostname(),
                          started_at=self._started_at, sandboxes=len(self.manager.live),
                          isolation=list(self.manager.isolations), problems=problems, pulls=PULLS.snapshot(),
                          prefetched_bytes=PULLS.prefetched_bytes)

    async def layer_index(self) -> LayerIndex:
        store = self.manager.images
        imgs = await asyncio.to_thread(store.list)
        orders: dict[str, list[str]] = {}
        if hasattr(store, "db"):  # the real image store records first-demand order (prefetch input)
            from dsec.images.snapshot import access_orders
            orders = await asyncio.to_thread(access_orders, store)
        return LayerIndex(node_id=self.node_id, images=[_layers_of(i, orders.get(i.id, ())) for i in imgs])

    async def resolve_image(self, ref: str) -> ImageLayers:
        return _layers_of(await asyncio.to_thread(self.manager.images.resolve, ref))

    # --- checkpoints ----------------------------------------------------------------------

    @property
    def checkpoints(self) -> Any:
        """This node's sandbox checkpoints (capture here, units in the shared blob store)."""
        if self._checkpoints is None:
            from dsec.blobs import open_checkpoint_store
            from dsec.checkpoints.sandbox_ckpt import SandboxCheckpoints
            self._checkpoints = SandboxCheckpoints(self.settings, open_checkpoint_store(self.settings), self)
        return self._checkpoints

    def use_checkpoints(self, checkpoints: Any) -> None:
        """Share one SandboxCheckpoints (its per-sandbox incremental trackers) with the API."""
        self._checkpoints = checkpoints

    async def checkpoint(self, sandbox_id: str, tenant: str) -> CheckpointInfo:
        return await self.checkpoints.checkpoint(tenant, sandbox_id)  # type: ignore[no-any-return]

    async def episode(self, op: str, key: str, args: dict[str, Any]) -> Any:
        """Episodes placed on this node by a control plane elsewhere (dsec.checkpoints.node_episodes)."""
        if self._episodes is None:
            from dsec.checkpoints.node_episodes import NodeEpisodes
            self._episodes = NodeEpisodes(self)
        return await self._episodes.call(op, key, args)

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None = None, *,
                    fence: int | None = None) -> SandboxInfo:
        self.fence.check(fence, f"handing over {sandbox_id}")
        info = await self.manager.claim(sandbox_id, spec, tenant)
        if "task" in spec.labels:  # right-sizing samples only task-typed sandboxes
            self._mark_cpu_base(sandbox_id)
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self.manager.info(self.manager.get_record(sandbox_id))

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> list[SandboxInfo]:
        out = []
        for rec in list(self.manager.live.values()):
            i = rec.info
            if self.manager.retired(i.id):  # killed: the kill was answered, only its reset runs
                continue
            if tenant is not None and i.tenant != tenant:
                continue
            if labels and any(i.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(self.manager.info(rec))
        return sorted(out, key=lambda i: i.created_at)

    async def raise_fence(self, token: int) -> int:
        self.fence.check(token, "a new scheduler leader")
        return self.fence.highest

    async def destroy(self, sandbox_id: str, *, fence: int | None = None) -> None:
        self.fence.check(fence, f"destroying {sandbox_id}")
        self._cpu_base.pop(sandbox_id, None)
        await self.manager.destroy(sandbox_id)

    async def recycle(self, sandbox_id: str, spec: SandboxSpec) -> SandboxInfo:
        """Destroy for the user, but keep the kernel sandbox as a fresh ``ready`` pool member
        of ``spec`` under a new id (SandboxManager.start_recycle). Conflict when it does not
        qualify (nothing changed: destroy it instead); SandboxFailure when recycling
        failed (it is gone then)."""
        return await (await self.start_recycle(sandbox_id, spec))

    async def start_recycle(self, sandbox_id: str, spec: SandboxSpec, *,
                            fence: int | None = None) -> asyncio.Future[SandboxInfo]:
        """``recycle`` in two parts: returns once the old id is retired (Conflict if it does
        not qualify); the returned future completes with the new member. ``fence``: the
        scheduler leader's token, as for create and destroy."""
        self.fence.check(fence, f"recycling {sandbox_id}")
        self._cpu_base.pop(sandbox_id, None)
        return self.manager.start_recycle(sandbox_id, spec)

    async def cpu_used(self, sandbox_id: str) -> float | None:
        """Average CPUs the sandbox kept busy since it was handed out (right-sizing input);
        None when unknown (not live, or no CPU accounting)."""
        from dsec.node.usage import cgroup_cpu_seconds, mean_cpu_used

        if sandbox_id not in self.manager.live:
            self._cpu_base.pop(sandbox_id, None)
            return None
        secs = cgroup_cpu_seconds(self.manager.cgroup_parent, sandbox_id)
        if secs is None:
            return None
        base_secs, since = self._cpu_base.get(sandbox_id, (0.0, self.manager.live[sandbox_id].info.created_at))
        return mean_cpu_used(secs - base_secs, time.time() - since)

    def _mark_cpu_base(self, sandbox_id: str) -> None:
        """CPU burned before hand-over (runc, init) is not the task's: count from here."""
        from dsec.node.usage import cgroup_cpu_seconds

        secs = cgroup_cpu_seconds(self.manager.cgroup_parent, sandbox_id)
        if secs is not None:
            self._cpu_base[sandbox_id] = (secs, time.time())
        if len(self._cpu_base) > len(self.manager.live) + 1024:  # sandboxes the node reaped itself
            for sid in [k for k in self._cpu_base if k not in self.manager.live]:
                del self._cpu_base[sid]

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}", field="timeout")
        return self.manager.set_timeout(sandbox_id, timeout)

    # --- exec -----------------------------------------------------------------------

    def _exec_params(self, sandbox_id: str, req: ExecRequest) -> tuple[Any, list[str], dict[str, str], str, float]:
        rec = self.manager.live_record(sandbox_id)
        env = {**rec.env, **(req.env or {})}
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        # Commands run as root (OCI process.user); git, pip and shells need HOME. runc-tier
        # execs get exactly this env (the gVisor tier inherits PID 1's HOME=/root).
        env.setdefault("HOME", "/root")
        cwd = req.cwd or rec.workdir or "/"
        timeout = req.timeout or self.settings.exec_default_timeout_s
        return rec, req.argv(), env, cwd, timeout

    @contextlib.contextmanager
    def _active(self, sandbox_id: str):  # type: ignore[no-untyped-def]
        ae = self.manager.active_execs
        ae[sandbox_id] = ae.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            if sandbox_id in ae:
                ae[sandbox_id] -= 1

    def _forget_agent(self, sandbox_id: str) -> None:
        """Close the sandbox's idle kept-alive agent connections (it is going away)."""
        ac.agent_forget(self.manager.paths(sandbox_id).socket)
        ac.agent_forget(gvisor_relay.relay_key(sandbox_id))

    def _agent_sock(self, sandbox_id: str, rec: Any) -> Path | None:
        """The sandbox's exec agent (both tiers); None: an old gVisor sandbox without one."""
        return self.manager.agent_socket(sandbox_id, rec.info.isolation)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        rec, argv, env, cwd, timeout = self._exec_params(sandbox_id, req)
        stdin = req.stdin.encode() if req.stdin is not None else None
        sock = self._agent_sock(sandbox_id, rec)
        if req.background:
            pid = await self._background(sandbox_id, sock, argv, env, cwd)
            return ExecResult(exit_code=0, pid=pid)
        with self._active(sandbox_id):
            if sock is None:
                return await self._exec_gvisor(sandbox_id, argv, env, cwd, timeout, stdin)
            out = await ac.agent_exec(sock, argv, env=env, cwd=cwd,
                                      timeout=timeout, stdin=stdin,
                                      max_output=self.settings.max_exec_output_bytes)
        return ExecResult(exit_code=out.exit_code, stdout=_decode(out.stdout), stderr=_decode(out.stderr),
                          duration=out.duration, timed_out=out.timed_out, truncated=out.truncated)

    def _gvisor_stream(self, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float,
                       stdin: bytes | None) -> AsyncIterator[tuple[str, bytes] | RunscExit]:
        """``runsc exec`` of ``dsec-init run``; leaving it early kills the command's tree."""
        return runsc_exec_stream(self.manager.runtime("gvisor"), sandbox_id, argv, env, cwd, timeout, stdin or b"",
                                 self.settings.agent_grace_s, self.settings.gvisor_exec_drain_s,
                                 self.manager.paths(sandbox_id).base)

    async def _exec_gvisor(self, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str,
                           timeout: float, stdin: bytes | None) -> ExecResult:
        t0 = time.perf_counter()
        limit = self.settings.max_exec_output_bytes
        bufs = {"stdout": bytearray(), "stderr": bytearray()}
        end = RunscExit(code=255, timed_out=False, lost=False)
        stream = self._gvisor_stream(sandbox_id, argv, env, cwd, timeout, stdin)
        async with contextlib.aclosing(stream):
            async for item in stream:
                if isinstance(item, RunscExit):
                    end = item
                else:
                    b = bufs[item[0]]
                    b += item[1][:max(0, limit + 1 - len(b))]  # keep draining past the limit
        out, err = bufs["stdout"], bufs["stderr"]
        return ExecResult(exit_code=end.code, stdout=_decode(out[:limit]), stderr=_decode(err[:limit]),
                          duration=time.perf_counter() - t0, timed_out=end.timed_out,
                          truncated=len(out) > limit or len(err) > limit)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        rec, argv, env, cwd, timeout = self._exec_params(sandbox_id, req)
        stdin = req.stdin.encode() if req.stdin is not None else None
        sock = self._agent_sock(sandbox_id, rec)
        if sock is None:
            t0 = time.perf_counter()
            with self._active(sandbox_id):
                gstream = self._gvisor_stream(sandbox_id, argv, env, cwd, timeout, stdin)
                async with contextlib.aclosing(gstream):
                    async for g in gstream:
                        if isinstance(g, RunscExit):
                            yield ExecEvent(kind="exit", result=ExecResult(
                                exit_code=g.code, duration=time.perf_counter() - t0, timed_out=g.timed_out))
                        else:
                            yield ExecEvent(kind=g[0], data=_decode(g[1]))  # type: ignore[arg-type]
            return
        with self._active(sandbox_id):
            stream = ac.agent_exec_stream(sock, argv, env=env, cwd=cwd,
                                          timeout=timeout, stdin=stdin)
            async with contextlib.aclosing(stream):
                async for item in stream:
                    if isinstance(item, ac.ExecOutcome):
                        yield ExecEvent(kind="exit", result=ExecResult(
                            exit_code=item.exit_code, duration=item.duration, timed_out=item.timed_out))
                    else:
                        kind, chunk = item
                        yield ExecEvent(kind=kind, data=_decode(chunk))  # type: ignore[arg-type]

    async def _background(self, sandbox_id: str, sock: Path | None, argv: list[str], env: dict[str, str],
                          cwd: str) -> int:
        if sock is None:
            raise InvalidArgument(f"sandbox {sandbox_id} is a gVisor sandbox made before its exec agent was "
                                  "reachable: background processes need a new sandbox; or run `nohup cmd &` "
                                  "in a shell")
        return await ac.agent_background(sock, argv, env=env, cwd=cwd)

    async def processes(self, sandbox_id: str) -> list[BackgroundProcess]:
        rec = self.manager.live_record(sandbox_id)
        sock = self._agent_sock(sandbox_id, rec)
        if sock is None:
            return []
        return await ac.agent_ps(sock)

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        rec = self.manager.live_record(sandbox_id)
        sock = self._agent_sock(sandbox_id, rec)
        if sock is None:
            raise InvalidArgument(f"sandbox {sandbox_id} has no background processes (gVisor sandbox made "
                                  "before its exec agent was reachable)")
        await ac.agent_kill(sock, pid, signal)

    # --- files ----------------------------------------------------------------------

    def _fs(self, sandbox_id: str) -> SandboxFS:
        self.manager.live_record(sandbox_id)
        return SandboxFS(str(self.manager.paths(sandbox_id).rootfs))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await asyncio.to_thread(self._fs(sandbox_id).read, path, self.settings.max_upload_bytes)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await asyncio.to_thread(self._fs(sandbox_id).write, path, data, mode)

    async def list_files(self, sandbox_id: str, path: str) -> list[FileEntry]:
        return await asyncio.to_thread(self._fs(sandbox_id).list, path)

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        await asyncio.to_thread(self._fs(sandbox_id).remove, path, recursive)

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None:
        await asyncio.to_thread(self._fs(sandbox_id).upload_tar, path, tar_bytes)

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await asyncio.to_thread(self._fs(sandbox_id).download_tar, path, self.settings.max_upload_bytes)


def _layers_of(info: Any, order: Sequence[str] = ()) -> ImageLayers:
    """``order``: diff_ids in first-demand order, reported as layer digests."""
    digest_of = {li.diff_id: li.digest for li in info.layers}
    return ImageLayers(image_id=info.id, names=list(info.names), layers=[(li.digest, li.size) for li in info.layers],
                       access_order=[digest_of[d] for d in order if d in digest_of])
