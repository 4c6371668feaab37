"""The node-local sandbox manager: create, adopt, destroy, and reconcile sandboxes.

Order of every create: persist the record (state ``creating``) -> make resources
(dir, tmpfs quota, overlay, network slot, runtime) -> wait for the exec agent ->
persist ``ready``/``idle``. Destroy persists ``stopping`` first. Because every resource
path is derived from the id, ``reconcile()`` after any crash (even SIGKILL mid-create)
can adopt what is healthy and clean the rest, and then sweeps orphans nobody recorded.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.config import Settings, parse_bytes
from dsec.errors import Conflict, DSecError, NotFound, SandboxFailure
from dsec.ids import new_sandbox_id
from dsec.models import SandboxInfo, SandboxSpec
from dsec.models import SandboxState as S
from dsec.models.image import ImageInfo
from dsec.node import cgroups, clones, syscalls
from dsec.node.files import SandboxFS
from dsec.node.lifecycle import check_transition, persisted
from dsec.node.paths import SandboxPaths, sandbox_paths
from dsec.node.proctree import descendants
from dsec.node.records import RecordStore, SandboxRecord
from dsec.node.resolve import ResolvedSpec, resolve_spec
from dsec.runtime import gvisor_relay
from dsec.runtime.agent.local import listen_socket
from dsec.runtime.agent_build import ensure_agent_binary
from dsec.runtime.agent_client import agent_mark_bg_empty, agent_ping, register_opener, unregister_opener
from dsec.runtime.oci import RuntimeSpec, build_config
from dsec.runtime.oci_runtime import OciRuntime, kill_pid, make_runtime, pid_alive, wait_gone

log = logging.getLogger("dsec.node")



def _meminfo_total() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


class SandboxManager:
    def __init__(self, settings: Settings, images: Any | None = None, network: Any | None = None) -> None:
        from dsec.images import ImageStore, Snapshotter

        self.settings = settings
        self.home = settings.home
        # This node's parent cgroup (Settings.cgroup_parent, DSEC_CGROUP_PARENT), per manager:
        # two nodes in one process, or a node built with overrides, each use their own.
        self.cgroup_parent = settings.cgroup_parent
        self.run_dir = settings.runtime_dir
        self.images = images or ImageStore(settings.home / "images", settings)
        self.snapshotter = Snapshotter(self.images)
        self.network = network
        self.records = RecordStore(settings.home / "node" / "sandboxes.db")
        self.live: dict[str, SandboxRecord] = {}
        self.active_execs: dict[str, int] = {}
        self.runtimes: dict[str, OciRuntime] = {}
        self.agent_binary: Path | None = None
        self.counters: dict[str, int] = {"created": 0, "create_failed": 0, "destroyed": 0,
                                         "reaped_ttl": 0, "reaped_dead": 0, "leaks_cleaned": 0, "adopted": 0}
        self.on_state_change: list[Callable[[SandboxInfo], None]] = []
        self._lowers: dict[str, list[str]] = {}  # sandbox -> overlay lower dirs (for reset)
        self._reset_locks: dict[str, asyncio.Lock] = {}
        self._recycling: set[str] = set()  # old ids of recycles in flight (start_recycle)
        self._last_purge = 0.0  # when reap_once last purged retired records
        self._layer_pins: dict[str, int] = {}  # frozen clone layers being made or handed to creates
        # Called with the sandbox id before its resources go (e.g. to copy the network's
        # denied-attempt records into the audit log while they still exist).
        self.before_teardown: list[Callable[[str], None]] = []
        # gVisor sandboxes whose PID 1 is the listening agent (reached through relays)
        self._gvisor_agents: set[str] = set()
        self.cpu = settings.node_cpu or float(os.cpu_count() or 1)
        self.memory = parse_bytes(settings.node_memory) if settings.node_memory else _meminfo_total()
        self.disk = parse_bytes(settings.node_disk) if settings.node_disk else int(shutil.disk_usage(
            settings.home if settings.home.exists() else "/").free * settings.disk_overprovision)
        self.isolations = [i for i, b in (("container", settings.runc_path), ("gvisor", settings.runsc_path))
                           if shutil.which(b)]

    # --- plumbing -----------------------------------------------------------------

    def paths(self, sandbox_id: str) -> SandboxPaths:
        return sandbox_paths(self.home, self.run_dir, sandbox_id)

    def runtime(self, isolation: str) -> OciRuntime:
        rt = self.runtimes.get(isolation)
        if rt is None:
            rt = make_runtime(isolation, self.settings.runc_path, self.settings.runsc_path,
                              self.settings.runsc_platform, self.run_dir, self.settings.runsc_debug_dir,
                              run_nice=self.settings.runtime_nice)
            self.runtimes[isolation] = rt
        return rt

    def _set_state(self, rec: SandboxRecord, state: S, *, persist: bool = True, **changes: Any) -> None:
        """``persist=False``: the caller writes the record itself (several in one commit)."""
        check_transition(rec.info.id, rec.info.state, state)
        rec.info = rec.info.model_copy(update={"state": state, **changes})
        if persist and state in (S.ready, S.idle, S.creating, S.stopping, S.stopped, S.failed, S.destroyed):
            self.records.put(_persistable(rec))
        for cb in self.on_state_change:
            cb(rec.info)

    def get_record(self, sandbox_id: str) -> SandboxRecord:
        rec = self.live.get(sandbox_id)
        if rec is not None:
            return rec
        rec = self.records.get(sandbox_id)
        if rec is None:
            raise NotFound(f"sandbox {sandbox_id} not found; list yours with `dsec ps`", sandbox_id=sandbox_id)
        return rec

    def retired(self, sandbox_id: str) -> bool:
        """The old id of a recycle in flight: its kill was answered, so listings leave it
        out while the kernel sandbox is reset under a new id."""
        return sandbox_id in self._recycling

    def live_record(self, sandbox_id: str) -> SandboxRecord:
        rec = self.get_record(sandbox_id)
        if rec.info.state not in (S.idle, S.running, S.ready):
            raise Conflict(f"sandbox {sandbox_id} is {rec.info.state.value}; create a new one",
                           sandbox_id=sandbox_id, state=rec.info.state.value)
        return rec

    def info(self, rec: SandboxRecord) -> SandboxInfo:
        if rec.info.state is S.idle and self.active_execs.get(rec.info.id):
            return rec.info.model_copy(update={"state": S.running})
        return rec.info

    # --- start / stop -------------------------------------------------------------

    async def start(self) -> None:
        for d in (self.home / "sandboxes", self.run_dir / "s", self.home / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir / "s", 0o700)
        self.agent_binary = await asyncio.to_thread(ensure_agent_binary, self.home / "bin")
        # Verify cached layers in the background so the first create does not pay for it.
        if hasattr(self.images, "start_preverify"):
            self.images.start_preverify()
        await self.reconcile()

    def close(self) -> None:
        self.records.close()

    # --- create -------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, extra_lower_dirs: list[Path] | None = None) -> SandboxInfo:
        image = self.images.resolve(spec.image)
        r = resolve_spec(spec, self.settings, image, self.cpu, self.memory, self.disk, self.isolations)
        if len(self.live) >= self.settings.node_max_sandboxes:
            from dsec.errors import CapacityExhausted
            raise CapacityExhausted(f"node holds {len(self.live)} sandboxes, its limit "
                                    f"(DSEC_NODE_MAX_SANDBOXES={self.settings.node_max_sandboxes})",
                                    retry_after=1.0)
        sid = sandbox_id or new_sandbox_id()
        now = time.time()
        info = SandboxInfo(id=sid, state=S.creating, image=spec.image, image_id=image.id,
                           isolation=r.isolation, cpu=r.cpu, memory=r.memory, disk=r.disk, pids=r.pids,
                           timeout=r.timeout, network=spec.network, labels=spec.labels, tenant=tenant,
                           node=self.settings.node_id or self.settings.host, created_at=now)
        rec = SandboxRecord(info=info, spec=spec, env=r.env, workdir=r.workdir, cgroup_parent=self.cgroup_parent)
        self.records.put(rec)  # recorded before any resource exists
        self.live[sid] = rec
        t0 = time.perf_counter()
        try:
            await self._make(rec, extra_lower_dirs or [])
        except BaseException as e:
            self.counters["create_failed"] += 1
            reason = e.message if isinstance(e, DSecError) else f"{type(e).__name__}: {e}"
            log.warning("create %s failed: %s", sid, reason)
            self._set_state(rec, S.failed, error=reason)
            await self._teardown(rec)
            if isinstance(e, DSecError):
                raise
            raise SandboxFailure(f"sandbox {sid} failed to start: {reason}", sandbox_id=sid) from e
        self.counters["created"] += 1
        log.debug("created %s in %.1f ms", sid, (time.perf_counter() - t0) * 1000)
        # A direct create is handed out at once: only 'idle' is written (one SQLite write
        # less on the cold path). A crash in between leaves 'creating', which reconcile
        # cleans; nobody had the sandbox yet.
        self._set_state(rec, S.ready, persist=pooled, pid=rec.info.pid)
        if not pooled:
            self._hand_out(rec, now=time.time())
        return self.info(rec)

    def _hand_out(self, rec: SandboxRecord, now: float) -> None:
        """TTL starts when the user gets the sandbox, not when it was pre-created."""
        self._set_state(rec, S.idle, pid=rec.info.pid, started_at=now, expires_at=now + rec.info.timeout)

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None) -> SandboxInfo:
        """Hand a warm (ready) sandbox to a user with the request's env/labels/timeout."""
        rec = self.get_record(sandbox_id)
        if rec.info.state is not S.ready:
            raise Conflict(f"sandbox {sandbox_id} is not a free pool member", sandbox_id=sandbox_id)
        image = self.images.resolve_fast(spec.image)
        r = resolve_spec(spec, self.settings, image, self.cpu, self.memory, self.disk, self.isolations)
        rec.spec, rec.env, rec.workdir = spec, r.env, r.workdir
        rec.info = rec.info.model_copy(update={"labels": spec.labels, "tenant": tenant, "timeout": r.timeout,
                                               "network": spec.network})
        if spec.network is not None and self.network is not None:
            await self.network.update(sandbox_id, spec.network)
        self._hand_out(rec, now=time.time())
        return self.info(rec)

    async def _make(self, rec: SandboxRecord, extra_lower_dirs: list[Path]) -> None:
        """Build the sandbox. Blocking filesystem work runs in worker threads, so a burst
        of creates never stalls the event loop that also serves exec and the API."""
        info = rec.info
        p = self.paths(info.id)
        netns = None
        hosts: dict[str, list[str]] = {}
        if info.network is None:  # root and bundle in one worker-thread hop (cold path)
            await asyncio.to_thread(self._prepare_bundle, rec, p, extra_lower_dirs)
        else:
            await asyncio.to_thread(self._prepare_root, rec, p, extra_lower_dirs)
            if self.network is None:
                raise SandboxFailure("network allow-lists need the network manager, which is not running "
                                     "on this node", sandbox_id=info.id)
            att = await self.network.attach(info.id, info.network)
            netns, hosts = att.netns_path, att.hosts
            await asyncio.to_thread(self._write_bundle, rec, p, netns, hosts)
        if info.isolation == "gvisor":
            # network=None: gVisor's netstack with loopback only; else its netstack drives
            # the slot's eth0 (the allow-list stays on the host end of the veth).
            net_flag = "--network=sandbox" if netns else "--network=none"
            pid = await self.runtime(info.isolation).run(info.id, p.bundle, None, p.log, (net_flag,),
                                                         netstack_netns=netns)
        else:
            sock = listen_socket(p.socket)
            agent_mark_bg_empty(p.socket)  # a new init: its background table is empty
            try:
                pid = await self.runtime(info.isolation).run(info.id, p.bundle, sock.fileno(), p.log)
            finally:
                sock.close()  # the sandbox's init holds the listening end now
        rec.info = rec.info.model_copy(update={"pid": pid})
        if info.isolation == "gvisor":
            for gpid in await asyncio.to_thread(_gvisor_pids, info.id, pid):
                cgroups.add_pid(self.cgroup_parent, info.id, gpid)
        if info.isolation == "gvisor":
            if not self._use_gvisor_agent(info.id):  # no ping: that is a runsc exec; relays wait for PID 1
                raise SandboxFailure(f"sandbox {info.id}: its agent token is missing", sandbox_id=info.id)
        elif not await agent_ping(p.socket, self.settings.agent_connect_timeout_s):
            raise SandboxFailure(f"sandbox {info.id}: exec agent did not answer within "
                                 f"{self.settings.agent_connect_timeout_s}s; runtime log: {_tail(p.log)}",
                                 sandbox_id=info.id)

    def _use_gvisor_agent(self, sid: str) -> bool:
        """Route this gVisor sandbox's agent connections through relays (dsec.runtime.gvisor_relay)."""
        base = self.paths(sid).base
        token = gvisor_relay.read_token(base)
        if token is None:
            return False
        rt, log_path = self.runtime("gvisor"), base / "relay.log"
        register_opener(gvisor_relay.relay_key(sid), lambda: gvisor_relay.open_relay(rt, sid, log_path, token))
        self._gvisor_agents.add(sid)
        return True

    def agent_socket(self, sandbox_id: str, isolation: str) -> Path | None:
        """The ``sock_path`` of a sandbox's exec agent (gVisor: the relay key); None for a
        gVisor sandbox whose PID 1 is no agent (made by an older node: ``runsc exec``).
        An adopted gVisor sandbox (node restarted) is recognised by its bundle's argv."""
        if isolation != "gvisor":
            return self.paths(sandbox_id).socket
        if sandbox_id not in self._gvisor_agents:
            try:
                args = json.loads(self.paths(sandbox_id).config.read_text())["process"]["args"]
            except (OSError, ValueError, KeyError):
                return None
            if args != gvisor_relay.serve_args() or not self._use_gvisor_agent(sandbox_id):
                return None
        return gvisor_relay.relay_key(sandbox_id)

    def _prepare_bundle(self, rec: SandboxRecord, p: SandboxPaths, extra_lower_dirs: list[Path]) -> None:
        self._prepare_root(rec, p, extra_lower_dirs)
        self._write_bundle(rec, p, None, {})

    def _prepare_root(self, rec: SandboxRecord, p: SandboxPaths, extra_lower_dirs: list[Path]) -> None:
        info = rec.info
        p.base.mkdir(parents=True)
        p.scratch.mkdir()
        p.rootfs.mkdir()
        # The writable layer lives on a tmpfs sized to the disk quota: a full disk is
        # ENOSPC inside this sandbox only, and its pages count against its memory cgroup.
        syscalls.mount_tmpfs(str(p.scratch), info.disk, mode=0o700)
        mounts = self.snapshotter.prepare(info.id, rec.spec.image, p.scratch, extra_lower_dirs)
        syscalls.mount_overlay(str(p.rootfs), mounts.lower_dirs, mounts.upper_dir, mounts.work_dir)
        self._lowers[info.id] = mounts.lower_dirs
        if rec.workdir != "/":
            SandboxFS(str(p.rootfs)).makedirs(rec.workdir)  # like a Dockerfile WORKDIR: exists

    def _write_bundle(self, rec: SandboxRecord, p: SandboxPaths, netns: str | None,
                      hosts: dict[str, list[str]]) -> None:
        info = rec.info
        if hosts:
            self._write_hosts(p, hosts)
        assert self.agent_binary is not None
        spec = RuntimeSpec(sandbox_id=info.id, rootfs=str(p.rootfs), agent_binary=str(self.agent_binary),
                           cpu=info.cpu, memory=info.memory, pids=info.pids,
                           nofile=min(self.settings.default_nofile, _hard_nofile()), hostname=info.id,
                           env=rec.env, netns_path=netns, cgroup_parent=self.cgroup_parent,
                           init_seccomp=self.settings.init_seccomp)
        config = build_config(spec)
        if info.isolation == "gvisor":
            _gvisor_bind_tmp(config, p.rootfs)
            # PID 1 listens inside (runsc passes no fds) and serves relays only; commands
            # run under dsec-init's seccomp filter (runsc applies no OCI profile inside).
            config["process"]["args"] = gvisor_relay.serve_args()
            config["mounts"].append(gvisor_relay.write_token(p.base)[1])
            cgroups.create_limited(self.cgroup_parent, info.id, info.memory, info.cpu, info.pids)
            config["linux"].pop("seccomp", None)  # gVisor's Sentry is the syscall filter; runsc rejects profiles
            if netns is None:  # --network=none: runsc makes its own empty netns
                config["linux"]["namespaces"] = [n for n in config["linux"]["namespaces"]
                                                 if n["type"] != "network"]
        p.config.write_text(json.dumps(config))

    def _write_hosts(self, p: SandboxPaths, hosts: dict[str, list[str]]) -> None:
        if not hosts:
            return
        fs = SandboxFS(str(p.rootfs))
        lines = ["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ips in hosts.items() for ip in ips]
        fs.write("/etc/hosts", ("\n".join(lines) + "\n").encode())

    # --- destroy ------------------------------------------------------------------

    async def destroy(self, sandbox_id: str, reason: str = "killed") -> None:
        rec = self.get_record(sandbox_id)
        if rec.info.state in (S.stopped, S.destroyed) or sandbox_id in self._recycling:
            return  # gone, or retired by a recycle whose resources now belong to the new id
        if rec.info.state is not S.stopping:
            self._set_state(rec, S.stopping, error=rec.info.error or (None if reason == "killed" else reason))
        await self._teardown(rec)
        self.counters["destroyed"] += 1

    async def _teardown(self, rec: SandboxRecord) -> None:
        """Release everything derived from the id; idempotent, safe on half-made sandboxes."""
        sid = rec.info.id
        p = self.paths(sid)
        if rec.info.state is S.failed:
            self._set_state(rec, S.stopping)
        for hook in self.before_teardown:
            try:
                hook(sid)
            except Exception:
                log.exception("before_teardown hook failed for %s", sid)
        try:
            pid = rec.info.pid or _read_pid(p.bundle / "init.pid")
            rt = self.runtime(rec.info.isolation)
            await asyncio.to_thread(_release_kernel_resources, p, rt, pid, rec.info.isolation, rec.cgroup_parent)
            if self.network is not None:
                await self.network.detach(sid)
            await asyncio.to_thread(self.snapshotter.release, sid)
            if (self.home / "clones").is_dir():  # frozen clone layers nobody mounts any more
                await asyncio.to_thread(clones.gc_layers, self.home, set(self._layer_pins))
        except Exception as e:
            log.exception("cleanup of %s failed", sid)
            self._set_state(rec, S.failed, error=f"cleanup failed: {e}")
            raise SandboxFailure(f"cleanup of sandbox {sid} failed: {e}; the reconciler will retry",
                                 sandbox_id=sid) from e
        if sid in self._gvisor_agents:
            self._gvisor_agents.discard(sid)
            unregister_opener(gvisor_relay.relay_key(sid))
        self.live.pop(sid, None)
        self.active_execs.pop(sid, None)
        self._lowers.pop(sid, None)
        self._reset_locks.pop(sid, None)
        self._set_state(rec, S.stopped, pid=None)

    # --- reset --------------------------------------------------------------------

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Return a live sandbox to its pristine state (as created: image + what create
        added), keeping its id, limits, network slot, TTL and agent. Container tier: in
        place (dsec.node.reset, ~1-2 ms); gVisor, or if the fast path fails: the sandbox
        is re-made under the same id (same spec), about as slow as a create."""
        from dsec.node import reset as rs

        rec = self.live_record(sandbox_id)
        lock = self._reset_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            rec = self.live_record(sandbox_id)
            info = rec.info
            if info.network != rec.spec.network and self.network is not None and rec.spec.network is not None:
                await self.network.update(sandbox_id, rec.spec.network)  # allow-list as created
                rec.info = info = info.model_copy(update={"network": rec.spec.network})
                self.records.put(rec)
            done = False
            if info.isolation == "container" and info.pid and \
                    _is_sandbox_init(info.pid, sandbox_id, "container", self.cgroup_parent):
                p = self.paths(sandbox_id)
                hosts = None
                att = self.network.attachment(sandbox_id) if self.network is not None else None
                if att is not None and att.hosts:
                    hosts = ("\n".join(["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ips in att.hosts.items()
                                                                  for ip in ips]) + "\n").encode()
                try:
                    lowers = self._lowers.get(sandbox_id) or rs.lower_dirs_of(p.rootfs)
                    times = await asyncio.get_running_loop().run_in_executor(rs.executor(self.settings.node_reset_workers), functools.partial(
                        rs.reset_container, sandbox_id=sandbox_id, init_pid=info.pid, rootfs=p.rootfs,
                        scratch=p.scratch, lower_dirs=lowers, disk=info.disk, workdir=rec.workdir, hosts=hosts,
                        cgroup_parent=self.cgroup_parent, limits=(info.memory, info.cpu, info.pids)))
                    log.debug("reset %s in place: %s", sandbox_id, times)
                    done = True
                except (rs.ResetError, OSError) as e:
                    log.warning("in-place reset of %s failed (%s); re-making it", sandbox_id, e)
            if not done:
                await self._remake(rec)
            key = "reset_in_place" if done else "reset_remade"
            self.counters[key] = self.counters.get(key, 0) + 1
            return self.info(rec)

    def _recycle_plan(self, rec: SandboxRecord, spec: SandboxSpec
                      ) -> tuple[str | None, tuple[ImageInfo, ResolvedSpec] | None]:
        """Why this sandbox cannot become a pool member of ``spec`` (None: it can), with the
        image and resolved spec it checked against when it can (the recycle uses them: one
        image lookup per kill, issue 15). Only a container-tier sandbox without a network
        slot whose kernel limits, image and root (no clone or checkpoint layers) are exactly
        what a fresh create of ``spec`` gets."""
        info = rec.info
        if info.isolation != "container" or spec.isolation not in (None, "container"):
            return "not the container tier", None
        if info.network is not None or rec.spec.network is not None or spec.network is not None:
            return "has a network slot", None
        if info.state not in (S.idle, S.running, S.ready) or not info.pid:
            return f"is {info.state.value}", None
        if self.active_execs.get(info.id):
            return "has a command running", None
        try:
            image = self.images.resolve_fast(spec.image)
        except DSecError as e:
            return f"image: {e}", None
        if image.id != info.image_id or not image.layers:
            return "image changed", None
        r = resolve_spec(spec, self.settings, image, self.cpu, self.memory, self.disk, self.isolations)
        if (r.cpu, r.memory, r.disk, r.pids) != (info.cpu, info.memory, info.disk, info.pids):
            return "limits differ from the pool shape", None
        lowers = self._lowers.get(info.id)
        if lowers is None or lowers != [str(self.images.layers.fs(li.diff_id)) for li in reversed(image.layers)]:
            return "its root has layers beyond the image (clone or restore)", None
        return None, (image, r)

    async def recycle(self, sandbox_id: str, spec: SandboxSpec) -> SandboxInfo:
        """``start_recycle`` and wait for it."""
        return await self.start_recycle(sandbox_id, spec)

    def start_recycle(self, sandbox_id: str, spec: SandboxSpec) -> asyncio.Task[SandboxInfo]:
        """Turn a sandbox its user is done with into a fresh warm-pool member of ``spec``
        (state ``ready``) under a NEW id, instead of destroying it: processes killed, root,
        /dev, /tmp, SysV IPC, background table, env and labels back to a fresh create of
        ``spec``, cgroups renamed with zeroed counters, hostname = the new id.

        Synchronous part (before this returns): the checks, and the old id is retired:
        every later call naming it gets a Conflict/NotFound. Raises Conflict (nothing
        changed) when the sandbox does not qualify (``_recycle_plan``). The returned task does
        the rest; on any failure it tears both ids down and raises SandboxFailure."""
        from dsec.node import reset as rs
        from dsec.runtime.agent_client import (
            agent_bg_known_empty,
            agent_clear_background,
            agent_forget,
            agent_prime,
        )

        old = self.live_record(sandbox_id)
        why, plan = self._recycle_plan(old, spec)
        if why is not None or plan is None:
            raise Conflict(f"sandbox {sandbox_id} cannot be recycled: {why}", sandbox_id=sandbox_id)
        if sandbox_id in self._reset_locks and self._reset_locks[sandbox_id].locked():
            raise Conflict(f"sandbox {sandbox_id} is being reset", sandbox_id=sandbox_id)
        info = old.info
        image, r = plan  # what the checks resolved: no second image lookup
        # Only a background request fills the agent's table, and the host sends them all:
        # none since the agent started (or was last cleared) means nothing to clear.
        clear = not agent_bg_known_empty(self.paths(sandbox_id).socket)
        nid = new_sandbox_id()
        self._set_state(old, S.stopping, persist=False, error="recycled")  # retired: no call reaches it from here
        self._recycling.add(sandbox_id)
        now = time.time()
        new = SandboxRecord(info=SandboxInfo(
            id=nid, state=S.creating, image=spec.image, image_id=image.id, isolation="container", cpu=info.cpu,
            memory=info.memory, disk=info.disk, pids=info.pids, timeout=r.timeout, network=None,
            labels=spec.labels, tenant=None, node=info.node, created_at=now, pid=info.pid),
            spec=spec, env=r.env, workdir=r.workdir, cgroup_parent=old.cgroup_parent)
        # Both ids in one commit, before any rename: a crash leaves both for reconcile to clean.
        self.records.put_many([old, new])
        self.live[nid] = new
        po, pn = self.paths(sandbox_id), self.paths(nid)
        rt = self.runtime("container")
        for hook in self.before_teardown:
            try:
                hook(sandbox_id)
            except Exception:
                log.exception("before_teardown hook failed for %s", sandbox_id)
        agent_forget(po.socket)
        lowers = self._lowers.pop(sandbox_id)
        # The new id's lease on the image's objects (what Snapshotter.prepare takes; the
        # layers are already there, so no prepare: its upper/work dirs would be thrown away).
        objects = [image.id] + [li.digest for li in image.layers] + [li.diff_id for li in image.layers]

        def step() -> dict[str, float]:  # one hop to a reset worker for all blocking work
            self.images.touch(image.id, [li.diff_id for li in image.layers], nid, objects)
            try:
                rs.kill_all_but_init(old.cgroup_parent, sandbox_id, info.pid)  # type: ignore[arg-type]
                rs.rename_cgroups(old.cgroup_parent, sandbox_id, nid, info.pid)  # type: ignore[arg-type]
                rs.rename_paths((po.base, po.socket, rt.state_root / sandbox_id),
                                (pn.base, pn.socket, rt.state_root / nid))
                return rs.reset_container(
                    sandbox_id=nid, init_pid=info.pid, rootfs=pn.rootfs,  # type: ignore[arg-type]
                    scratch=pn.scratch, lower_dirs=lowers, disk=info.disk, workdir=r.workdir, hosts=None,
                    cgroup_parent=old.cgroup_parent, limits=(info.memory, info.cpu, info.pids), hostname=nid)
            finally:
                self.snapshotter.release(sandbox_id)

        async def rest() -> SandboxInfo:
            try:
                return await work()
            finally:
                self._recycling.discard(sandbox_id)

        async def work() -> SandboxInfo:
            try:
                times = await asyncio.get_running_loop().run_in_executor(rs.executor(self.settings.node_reset_workers), step)
                agent_mark_bg_empty(pn.socket)  # before the clear: a later background request unmarks it
                if clear:
                    await agent_clear_background(pn.socket)
                await agent_prime(pn.socket)
            except BaseException as e:
                reason = e.message if isinstance(e, DSecError) else f"{type(e).__name__}: {e}"
                log.warning("recycling %s failed (%s): tearing it down", sandbox_id, reason)
                self._set_state(new, S.failed, error=f"recycle of {sandbox_id} failed: {reason}")
                for rec in (old, new):
                    try:
                        await self._teardown(rec)
                    except SandboxFailure:
                        log.exception("cleanup after a failed recycle of %s", sandbox_id)
                raise SandboxFailure(f"sandbox {sandbox_id} could not be recycled: {reason}",
                                     sandbox_id=sandbox_id) from e
            self._lowers[nid] = lowers
            self.live.pop(sandbox_id, None)
            self.active_execs.pop(sandbox_id, None)
            self._reset_locks.pop(sandbox_id, None)
            self._set_state(old, S.stopped, persist=False, pid=None)
            self._set_state(new, S.ready, persist=False, pid=info.pid)
            self.records.put_many([old, new])  # one commit
            self.counters["recycled"] = self.counters.get("recycled", 0) + 1
            log.debug("recycled %s as %s: %s", sandbox_id, nid, times)
            return self.info(new)

        return asyncio.ensure_future(rest())

    async def _remake(self, rec: SandboxRecord) -> None:
        """Slow reset: release the kernel resources and build the sandbox again under the
        same id and spec (network slot and state record are kept)."""
        sid = rec.info.id
        p = self.paths(sid)
        rt = self.runtime(rec.info.isolation)
        await asyncio.to_thread(_release_kernel_resources, p, rt, rec.info.pid, rec.info.isolation,
                                rec.cgroup_parent)
        if self.network is not None:
            await self.network.detach(sid)
        await asyncio.to_thread(self.snapshotter.release, sid)
        try:
            await self._make(rec, [])
        except BaseException as e:
            reason = e.message if isinstance(e, DSecError) else f"{type(e).__name__}: {e}"
            self._set_state(rec, S.failed, error=f"reset failed: {reason}")
            await self._teardown(rec)
            raise SandboxFailure(f"sandbox {sid} could not be reset: {reason}", sandbox_id=sid) from e
        self.records.put(rec)

    # --- live clones --------------------------------------------------------------

    async def freeze_for_clone(self, sandbox_id: str) -> tuple[list[Path], clones.FrozenLayer]:
        """Freeze the sandbox's writable layer (dsec.node.clones) and return the extra lower
        dirs a clone is created with (frozen layer on top of the sandbox's own extra
        layers; the image's come from its spec), pinned until ``unpin_layer``."""
        from dsec.node import reset as rs

        self.live_record(sandbox_id)
        lock = self._reset_locks.setdefault(sandbox_id, asyncio.Lock())  # never during a reset
        async with lock:
            rec = self.live_record(sandbox_id)
            p = self.paths(sandbox_id)
            current = await asyncio.to_thread(rs.lower_dirs_of, p.rootfs)
            image = self.images.resolve_fast(rec.spec.image)
            image_dirs = {str(self.images.layers.fs(li.diff_id)) for li in image.layers}
            extras = [Path(d) for d in current if d not in image_dirs and d != str(p.scratch / "empty")]
            top = Path(current[0]) if current else None
            if rec.info.isolation == "container" and top is not None and top.parent.parent == clones.layers_root(
                    self.home) and not os.listdir(p.upper):
                # Nothing written since the last clone: its frozen layer is this instant too.
                self._layer_pins[top.parent.name] = self._layer_pins.get(top.parent.name, 0) + 1
                self.counters["clone_reused"] = self.counters.get("clone_reused", 0) + 1
                return extras, clones.FrozenLayer(path=top, mode="reused", paused_ms=0.0)
            name = clones.new_layer_name()
            if len(":".join([str(clones.layers_root(self.home) / name / "upper"), *current])) > clones.MAX_LOWERDIR:
                raise Conflict(f"sandbox {sandbox_id} stacks {len(current)} layers (a clone of a clone of ...): "
                               "one more would pass the kernel's mount-option limit; checkpoint and restore "
                               "it to flatten the chain", sandbox_id=sandbox_id, layers=len(current))
            self._layer_pins[name] = 1  # no teardown's GC may take it before the clones mount it
            try:
                frozen = await asyncio.to_thread(
                    clones.freeze_layer, home=self.home, cgroup_parent=self.cgroup_parent, sandbox_id=sandbox_id,
                    isolation=rec.info.isolation, init_pid=rec.info.pid, rootfs=p.rootfs, scratch=p.scratch,
                    lower_dirs=current, disk=rec.info.disk, workdir=rec.workdir, layer_name=name)
            except BaseException:
                self._unpin(name)
                raise
        self.counters["clone_" + frozen.mode] = self.counters.get("clone_" + frozen.mode, 0) + 1
        return [frozen.path, *extras], frozen

    async def reroot(self, sandbox_id: str, extra_lower_dirs: list[Path]) -> None:
        """Stack ``extra_lower_dirs`` over a fresh container-tier sandbox's image layers, in
        place (a clone handed a warm pool member or just created: nothing ran in it, so
        only the root is swapped). Its later resets return to this root."""
        from dsec.node import reset as rs

        rec = self.live_record(sandbox_id)
        if rec.info.isolation != "container":
            raise SandboxFailure(f"sandbox {sandbox_id}: only the container tier can be re-rooted in place",
                                 sandbox_id=sandbox_id)
        p = self.paths(sandbox_id)
        lock = self._reset_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            base = self._lowers.get(sandbox_id) or rs.lower_dirs_of(p.rootfs)
            lowers = [*map(str, extra_lower_dirs), *base]
            hosts = None
            att = self.network.attachment(sandbox_id) if self.network is not None else None
            if att is not None and att.hosts:
                hosts = ("\n".join(["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ips in att.hosts.items()
                                                              for ip in ips]) + "\n").encode()
            if not rec.info.pid or not _is_sandbox_init(rec.info.pid, sandbox_id, "container", rec.cgroup_parent):
                raise SandboxFailure(f"sandbox {sandbox_id}: its init is gone", sandbox_id=sandbox_id)
            await asyncio.to_thread(clones.reroot_fresh, sandbox_id=sandbox_id, init_pid=rec.info.pid,
                                    rootfs=p.rootfs, scratch=p.scratch, lower_dirs=lowers, disk=rec.info.disk,
                                    workdir=rec.workdir, hosts=hosts)
            self._lowers[sandbox_id] = lowers  # its resets return to this root

    def unpin_layer(self, layer: Path) -> None:
        """The creates that needed ``layer`` are done: it lives while a mount uses it."""
        self._unpin(layer.parent.name)

    def _unpin(self, name: str) -> None:
        n = self._layer_pins.get(name, 0) - 1
        if n > 0:
            self._layer_pins[name] = n
        else:
            self._layer_pins.pop(name, None)

    # --- reconcile ----------------------------------------------------------------

    async def reconcile(self) -> dict[str, int]:
        """Adopt healthy recorded sandboxes; clean half-made, dead and orphaned ones."""
        adopted = cleaned = 0
        known: set[str] = set()
        for rec in self.records.all():
            sid = rec.info.id
            known.add(sid)
            st = rec.info.state
            if st in (S.stopped, S.destroyed):
                continue
            if st in (S.ready, S.idle) and await self._healthy(rec):
                self.live[sid] = rec
                adopted += 1
                continue
            self.live[sid] = rec
            if st in (S.ready, S.idle, S.creating):
                self._set_state(rec, S.stopping, error=rec.info.error or "found dead or half-made at restart")
            try:
                await self._teardown(rec)
            except SandboxFailure:
                # One sandbox's cleanup failing must not keep the node down; its record stays
                # 'failed' and the next reconcile (or reaper pass) retries it.
                log.exception("reconcile: cleanup of %s failed; will retry", sid)
                continue
            cleaned += 1
        cleaned += await self._sweep_orphans(known)
        await asyncio.to_thread(clones.gc_layers, self.home, set(self._layer_pins))
        self.counters["adopted"] += adopted
        self.counters["leaks_cleaned"] += cleaned
        return {"adopted": adopted, "cleaned": cleaned}

    async def _healthy(self, rec: SandboxRecord) -> bool:
        pid = rec.info.pid
        if not pid or not _is_sandbox_init(pid, rec.info.id, rec.info.isolation, rec.cgroup_parent):
            return False
        if rec.info.isolation == "gvisor":
            return True
        return await agent_ping(self.paths(rec.info.id).socket, self.settings.agent_connect_timeout_s)

    async def _sweep_orphans(self, known: set[str]) -> int:
        """Resources with a sandbox-id name but no record (crash before the record, or a
        record lost with its database): runtime state, cgroups, mounts, dirs, sockets.

        Only ids that this node's home or run dir (or runtime state root) name are swept:
        the cgroup tree is machine-wide, and a cgroup alone may belong to another DSec
        home on the same host (tests, a second node agent); ours always has a dir first.
        """
        live = set(self.live)
        found: set[str] = set()
        for iso in self.isolations:
            found.update(i for i in self.runtime(iso).list_ids() if i not in live)
        base = self.home / "sandboxes"
        if base.is_dir():
            found.update(d.name for d in base.iterdir() if d.name not in live)
        sock_dir = self.run_dir / "s"
        if sock_dir.is_dir():
            found.update(s.stem for s in sock_dir.glob("*.sock") if s.stem not in live)
        for sid in found:
            p = self.paths(sid)
            pid = _read_pid(p.bundle / "init.pid")
            for iso in self.isolations:
                await asyncio.to_thread(_release_kernel_resources, p, self.runtime(iso), pid, iso,
                                        self.cgroup_parent)
            self.snapshotter.release(sid)
            if self.network is not None:
                await self.network.detach(sid)
        return len(found)

    # --- TTL and liveness ---------------------------------------------------------

    async def reap_once(self, now: float | None = None) -> int:
        """Destroy sandboxes past their TTL or whose init died. Returns how many."""
        now = now or time.time()
        reaped = 0
        for rec in list(self.live.values()):
            st = rec.info.state
            if st is S.failed:  # a cleanup that failed earlier: retry it
                try:
                    await self._teardown(rec)
                    self.counters["leaks_cleaned"] += 1
                except SandboxFailure:
                    log.warning("retrying cleanup of %s failed again", rec.info.id)
                continue
            if st not in (S.idle, S.ready):
                continue
            if rec.info.expires_at and rec.info.expires_at <= now:
                reason, key = "TTL expired", "reaped_ttl"
            elif not pid_alive(rec.info.pid):
                reason, key = "sandbox init died", "reaped_dead"
            else:
                continue
            try:
                await self.destroy(rec.info.id, reason=reason)
                self.counters[key] += 1
                reaped += 1
            except DSecError:
                log.exception("reaping %s failed", rec.info.id)
        if now - self._last_purge >= self.settings.api_prune_interval_s:
            # Not every pass: with 1,000 sandboxes this full-table DELETE (and the records
            # lock, held by create/destroy threads) ran on the event loop every second.
            self._last_purge = now
            await asyncio.to_thread(self.records.purge_retired, now - self.settings.audit_retention_s)
        return reaped

    def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        rec = self.live_record(sandbox_id)
        start = rec.info.started_at or time.time()
        rec.info = rec.info.model_copy(update={"timeout": timeout, "expires_at": start + timeout})
        self.records.put(rec)
        return self.info(rec)

    # --- checkpoint hooks ---------------------------------------------------------

    def upper_dir(self, sandbox_id: str) -> Path:
        self.live_record(sandbox_id)
        return self.paths(sandbox_id).upper

    async def freeze(self, sandbox_id: str) -> None:
        self.live_record(sandbox_id)
        await asyncio.to_thread(cgroups.set_frozen, self.cgroup_parent, sandbox_id, True)

    async def thaw(self, sandbox_id: str) -> None:
        await asyncio.to_thread(cgroups.set_frozen, self.cgroup_parent, sandbox_id, False)


def _persistable(rec: SandboxRecord) -> SandboxRecord:
    """The record as written to disk (``persisted``: running is stored as idle); no copy
    when they are the same (every state but running)."""
    state = persisted(rec.info.state)
    if state is rec.info.state:
        return rec
    return rec.model_copy(update={"info": rec.info.model_copy(update={"state": state})})


def _release_kernel_resources(p: SandboxPaths, rt: OciRuntime, pid: int | None, isolation: str,
                              cgroup_parent: str) -> None:
    """Kill, then remove cgroups, runtime state, mounts, socket and dirs (worker thread).

    One pass with no subprocess: SIGKILL of the init takes its whole pid namespace down;
    the runtime's state is plain files once its processes are gone (no ``runc delete``).
    """
    cgroups.thaw(cgroup_parent, p.sandbox_id)
    if pid and _is_sandbox_init(pid, p.sandbox_id, isolation, cgroup_parent):
        kill_pid(pid)
        wait_gone(pid, 5.0)
    if isolation == "gvisor":
        _kill_gvisor_processes(p.sandbox_id, rt.state_root)
    cgroups.kill_and_remove(cgroup_parent, p.sandbox_id)
    rt.remove_state(p.sandbox_id)
    for mp in (p.rootfs, p.scratch):
        try:
            syscalls.umount(str(mp))
        except OSError:
            pass  # not mounted (half-made sandbox) or already gone
    for mp in syscalls.mounts_under(str(p.base)) if _has_mounts_below(p.base) else ():
        syscalls.umount(mp)
    p.socket.unlink(missing_ok=True)
    if p.base.exists():
        shutil.rmtree(p.base)


def _kill_gvisor_processes(sandbox_id: str, state_root: Path) -> None:
    """SIGKILL every host process of a gVisor sandbox: runsc run/boot/gofer (their argv
    names the sandbox id and our runsc state root) and their descendants (stubs).

    A manager killed mid-create leaves ``runsc run`` working; it finishes after our
    cleanup, and the sandbox it starts was never moved into our cgroups, so neither the
    init pid (not yet recorded) nor the cgroup kill reaches it.
    """
    root = str(state_root).encode()
    for _ in range(20):  # `runsc run` may fork its sandbox while we scan: rescan until quiet
        seeds = [int(d.name) for d in Path("/proc").iterdir()
                 if d.name.isdigit() and _argv_has(int(d.name), sandbox_id.encode(), root)]
        if not seeds:
            return
        victims = set(descendants(seeds))
        for q in victims:
            kill_pid(q)
        for q in victims:
            wait_gone(q, 5.0)


def _argv_has(pid: int, *needles: bytes) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return all(n in argv for n in needles)


def _has_mounts_below(base: Path) -> bool:
    """Cheap check before the full mountinfo scan: are the known mount points still mounts?"""
    return any(os.path.ismount(m) for m in (base / "rootfs", base / "scratch"))


def _hard_nofile() -> int:
    import resource
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_sandbox_init(pid: int, sandbox_id: str, isolation: str, cgroup_parent: str) -> bool:
    """Guard against PID reuse: the process must belong to this sandbox."""
    try:
        if isolation == "gvisor":
            return sandbox_id.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        return f"/{cgroup_parent}/{sandbox_id}" in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def _gvisor_pids(sandbox_id: str, pid: int) -> list[int]:
    """The runsc sandbox and gofer processes of a sandbox (those carry its id in argv) and
    all their descendants. On the ptrace platform guest code runs in stub processes forked
    by the Sentry before we get to move it; left behind they escape the sandbox's cpu,
    memory and pids limits. Later stubs fork from the moved master stub and inherit."""
    pids = {pid}
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != pid:
            try:
                if sandbox_id.encode() in (d / "cmdline").read_bytes():
                    pids.add(int(d.name))
                ppid = int((d / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    todo = list(pids)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in pids:
                pids.add(c)
                todo.append(c)
    return sorted(pids)


def _gvisor_bind_tmp(config: dict[str, Any], rootfs: Path) -> None:
    """runsc mounts an in-memory tmpfs on an empty /tmp unless the spec mounts /tmp; files
    there would skip the disk quota and be invisible to the host file API and to
    checkpoints. Binding the rootfs's own /tmp keeps /tmp on the sandbox's writable layer."""
    tmp = rootfs / "tmp"
    if tmp.is_dir() and not tmp.is_symlink():
        config["mounts"].append({"destination": "/tmp", "type": "bind", "source": str(tmp),
                                 "options": ["rbind", "rw", "nosuid", "nodev"]})


def _tail(path: Path, n: int = 800) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
