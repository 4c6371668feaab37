"""FakeNodeAgent: the ONE in-memory ``NodeAgent`` for tests of the layers above a node.

It replaces the two doubles that had drifted apart (the API tests' ``FakeNode`` and the
driver tests' ``MemAgent``) and is held to the same contract suite as the real agent
(``tests/contract/node/``), so what the API, scheduler driver and cluster code learn
from it is what a real node does.

Commands are interpreted, not run (real execution is the real agent's job):
``echo TEXT``, ``exit N``, ``cat PATH``, ``sleep S`` (times out past the request's
timeout), ``fail`` (raises SandboxFailure); anything else exits 127. Files live in a
dict per sandbox. Checkpoints go to a ``FakeCheckpointStore`` that several fakes may
share, the way real nodes share a blob store, so restore-on-another-node is testable.

Fault knobs: ``fail_creates`` (the next N creates raise TransientError), ``create_delay_s``.
"""

from __future__ import annotations

import asyncio
import io
import os
import secrets
import shlex
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dsec.config import Settings, parse_bytes
from dsec.errors import Conflict, InvalidArgument, NotFound, SandboxFailure, TransientError
from dsec.models import BackgroundProcess, ExecRequest, ExecResult, FileEntry, SandboxInfo, SandboxSpec
from dsec.models.checkpoint import CheckpointInfo
from dsec.models.sandbox import SandboxState
from dsec.net.models import DeniedAttempt
from dsec.node.api import (
    ExecEvent,
    FenceGate,
    ImageLayers,
    LayerIndex,
    NodeCapacity,
    NodeHealth,
    NodeUsage,
    RestoreSource,
)

GIB = 2**30
FAKE_PID = 4242  # the one background process a fake sandbox can have


@dataclass
class _Checkpoint:
    info: CheckpointInfo
    tenant: str
    spec: SandboxSpec
    files: dict[str, bytes]


@dataclass
class FakeCheckpointStore:
    """The shared blob store of a fake cluster: checkpoints by (tenant, id)."""

    units: dict[tuple[str, str], _Checkpoint] = field(default_factory=dict)


def _image_layers(ref: str) -> ImageLayers:
    """A stable fake layer list per image name (digests derived from the name)."""
    import hashlib

    name = ref.split(":")[0]
    digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
    return ImageLayers(image_id="sha256:" + hashlib.sha256(b"cfg" + name.encode()).hexdigest(),
                       names=[f"{name}:latest"], layers=[(digest, 1 << 20)])


class FakeNodeAgent:
    """In-memory NodeAgent (see module docstring)."""

    def __init__(self, settings: Settings | None = None, *, node_id: str = "fake-node",
                 known_images: tuple[str, ...] = ("busybox", "python"), cpu: float = 8, memory: int = 32 * GIB,
                 disk: int = 200 * GIB, max_sandboxes: int = 100,
                 isolation: tuple[str, ...] = ("container", "gvisor"), fail_creates: int = 0,
                 create_delay_s: float = 0.0, checkpoints: FakeCheckpointStore | None = None) -> None:
        self.settings = settings or Settings()
        self.node_id = node_id
        self.known_images = known_images
        self.cpu, self.memory, self.disk, self.max_sandboxes = cpu, memory, disk, max_sandboxes
        self.isolation = list(isolation)
        self.fail_creates = fail_creates
        self.create_delay_s = create_delay_s
        self.store = checkpoints if checkpoints is not None else FakeCheckpointStore()
        self.fence = FenceGate(node_id)  # like the real node: a deposed leader's calls are refused
        self.sandboxes: dict[str, SandboxInfo] = {}  # live ones (tests may delete to simulate a vanish)
        self.files: dict[str, dict[str, bytes]] = {}
        self.destroyed: list[str] = []  # ids in the order they were destroyed
        self.create_calls = 0
        self.started = False
        self._started_at = 0.0
        self._n = 0
        self._killed: dict[str, set[int]] = {}
        self._created_files: dict[str, dict[str, bytes]] = {}  # what reset() returns a sandbox to

    # --- the node itself ------------------------------------------------------------------
    async def start(self) -> None:
        self.started = True
        self._started_at = time.time()

    async def close(self) -> None:
        self.started = False

    def capacity(self) -> NodeCapacity:
        return NodeCapacity(node_id=self.node_id, cpu=self.cpu, memory=self.memory, disk=self.disk,
                            max_sandboxes=self.max_sandboxes, isolation=list(self.isolation))

    async def usage(self) -> NodeUsage:
        return NodeUsage(node_id=self.node_id, cpu_busy=0.0, sandboxes=len(self.sandboxes))

    async def health(self) -> NodeHealth:
        return NodeHealth(node_id=self.node_id, ok=self.started, pid=os.getpid(), hostname="fake",
                          started_at=self._started_at, sandboxes=len(self.sandboxes), isolation=list(self.isolation),
                          problems=[] if self.started else ["node agent not started"])

    async def layer_index(self) -> LayerIndex:
        return LayerIndex(node_id=self.node_id, images=[_image_layers(i) for i in self.known_images])

    async def resolve_image(self, ref: str) -> ImageLayers:
        self._check_image(ref)
        return _image_layers(ref)

    def _check_image(self, ref: str) -> None:
        if ref.split(":")[0] not in self.known_images:
            raise NotFound(f"image {ref!r} not found; import it with `dsec image import`", image=ref)

    # --- lifecycle --------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, restore: RestoreSource | None = None,
                     fence: int | None = None) -> SandboxInfo:
        self.fence.check(fence, f"creating {sandbox_id or 'a sandbox'}")
        self.create_calls += 1
        await asyncio.sleep(self.create_delay_s)
        if self.fail_creates:
            self.fail_creates -= 1
            raise TransientError(f"{self.node_id}: injected create failure")
        files: dict[str, bytes] = {}
        if restore is not None:
            if pooled:
                raise InvalidArgument("a restore is never a pool member", field="restore")
            unit = self.store.units.get((restore.tenant, restore.checkpoint_id))
            if unit is None:
                raise NotFound(f"checkpoint {restore.checkpoint_id} not found", checkpoint_id=restore.checkpoint_id)
            files = dict(unit.files)
        self._check_image(spec.image)
        if spec.isolation is not None and spec.isolation not in self.isolation:
            raise InvalidArgument(f"isolation={spec.isolation!r} is not available on this node", field="isolation")
        if len(self.sandboxes) >= self.max_sandboxes:
            from dsec.errors import CapacityExhausted
            raise CapacityExhausted(f"node holds {len(self.sandboxes)} sandboxes, its limit", retry_after=1.0)
        self._n += 1
        sid = sandbox_id or f"sb-{self.node_id}-{self._n}"
        if sid in self.sandboxes:
            raise Conflict(f"sandbox {sid} already exists", sandbox_id=sid)
        s = self.settings
        now = time.time()
        timeout = spec.timeout or s.default_timeout_s
        info = SandboxInfo(
            id=sid, state=SandboxState.ready if pooled else SandboxState.idle, image=spec.image,
            image_id=_image_layers(spec.image).image_id, isolation=spec.isolation or "container",
            cpu=spec.cpu or s.default_cpu,
            memory=spec.memory if isinstance(spec.memory, int) else parse_bytes(s.default_memory),
            disk=spec.disk if isinstance(spec.disk, int) else parse_bytes(s.default_disk),
            pids=spec.pids or s.default_pids, timeout=timeout, network=spec.network, labels=dict(spec.labels),
            tenant=tenant, node=self.node_id, created_at=now, pid=FAKE_PID,
            started_at=None if pooled else now, expires_at=None if pooled else now + timeout)
        self.sandboxes[sid] = info
        self.files[sid] = files
        self._created_files[sid] = dict(files)
        return info

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None = None, *,
                    fence: int | None = None) -> SandboxInfo:
        self.fence.check(fence, f"handing over {sandbox_id}")
        info = self._get(sandbox_id)
        if info.state is not SandboxState.ready:
            raise Conflict(f"sandbox {sandbox_id} is not a free pool member", sandbox_id=sandbox_id)
        now = time.time()
        timeout = spec.timeout or self.settings.default_timeout_s
        info = info.model_copy(update={"state": SandboxState.idle, "labels": dict(spec.labels), "tenant": tenant,
                                       "network": spec.network, "timeout": timeout, "started_at": now,
                                       "expires_at": now + timeout})
        self.sandboxes[sandbox_id] = info
        return info

    def _get(self, sandbox_id: str) -> SandboxInfo:
        info = self.sandboxes.get(sandbox_id)
        if info is None:
            raise NotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._get(sandbox_id)

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> list[SandboxInfo]:
        return sorted((i for i in self.sandboxes.values()
                       if (tenant is None or i.tenant == tenant)
                       and all(i.labels.get(k) == v for k, v in (labels or {}).items())),
                      key=lambda i: i.created_at)

    async def raise_fence(self, token: int) -> int:
        self.fence.check(token, "a new scheduler leader")
        return self.fence.highest

    async def destroy(self, sandbox_id: str, *, fence: int | None = None) -> None:
        self.fence.check(fence, f"destroying {sandbox_id}")
        if sandbox_id in self.destroyed and sandbox_id not in self.sandboxes:
            return  # like the real node: destroying a destroyed sandbox is a no-op
        self._get(sandbox_id)
        del self.sandboxes[sandbox_id]
        self.files.pop(sandbox_id, None)
        self.destroyed.append(sandbox_id)

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}", field="timeout")
        info = self._get(sandbox_id)
        start = info.started_at or time.time()
        info = info.model_copy(update={"timeout": timeout, "started_at": start, "expires_at": start + timeout})
        self.sandboxes[sandbox_id] = info
        return info

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        info = self._live(sandbox_id)
        self.files[sandbox_id] = dict(self._created_files.get(sandbox_id, {}))
        self._killed.setdefault(sandbox_id, set()).add(FAKE_PID)  # every process killed
        return info

    async def cpu_used(self, sandbox_id: str) -> float | None:
        return 0.0 if sandbox_id in self.sandboxes else None

    # --- exec -------------------------------------------------------------------------------
    def _live(self, sandbox_id: str) -> SandboxInfo:
        info = self._get(sandbox_id)
        if info.state not in (SandboxState.idle, SandboxState.running, SandboxState.ready):
            raise Conflict(f"sandbox {sandbox_id} is {info.state.value}", sandbox_id=sandbox_id)
        return info

    def _run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        self._live(sandbox_id)
        argv = req.argv()
        words = shlex.split(argv[2]) if argv[:2] == ["/bin/sh", "-c"] else argv
        if not words:
            return ExecResult(exit_code=0)
        if words[0] == "echo":
            return ExecResult(exit_code=0, stdout=" ".join(words[1:]) + "\n", duration=0.001)
        if words[0] == "exit":
            return ExecResult(exit_code=int(words[1]), duration=0.001)
        if words[0] == "cat":
            data = self.files[sandbox_id].get(words[1])
            if data is None:
                return ExecResult(exit_code=1, stderr=f"cat: can't open '{words[1]}': No such file or directory\n")
            return ExecResult(exit_code=0, stdout=data.decode(errors="replace"))
        if words[0] == "sleep":
            timeout = req.timeout or self.settings.exec_default_timeout_s
            if float(words[1]) > timeout:
                return ExecResult(exit_code=-9, timed_out=True, duration=timeout)
            return ExecResult(exit_code=0, duration=float(words[1]))
        if words[0] == "fail":
            raise SandboxFailure(f"sandbox {sandbox_id} agent lost", sandbox_id=sandbox_id)
        return ExecResult(exit_code=127, stderr=f"sh: {words[0]}: not found\n")

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        if req.background:
            self._live(sandbox_id)
            self._killed.setdefault(sandbox_id, set()).discard(FAKE_PID)
            return ExecResult(exit_code=0, pid=FAKE_PID)
        return self._run(sandbox_id, req)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        res = self._run(sandbox_id, req)
        for line in res.stdout.splitlines(keepends=True):
            yield ExecEvent(kind="stdout", data=line)
        if res.stderr:
            yield ExecEvent(kind="stderr", data=res.stderr)
        yield ExecEvent(kind="exit", result=res.model_copy(update={"stdout": "", "stderr": ""}))

    async def processes(self, sandbox_id: str) -> list[BackgroundProcess]:
        self._live(sandbox_id)
        running = FAKE_PID not in self._killed.get(sandbox_id, set())
        return [BackgroundProcess(pid=FAKE_PID, argv=["sleep", "100"], started_at=time.time(), running=running,
                                  exit_code=None if running else -9)]

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        self._live(sandbox_id)
        if pid != FAKE_PID:
            raise NotFound(f"process {pid} not found in sandbox {sandbox_id}", pid=pid)
        self._killed.setdefault(sandbox_id, set()).add(pid)

    # --- files ------------------------------------------------------------------------------
    def _fs(self, sandbox_id: str) -> dict[str, bytes]:
        self._live(sandbox_id)
        return self.files.setdefault(sandbox_id, {})

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        fs = self._fs(sandbox_id)
        if path not in fs:
            raise NotFound(f"file {path} not found in sandbox {sandbox_id}", path=path)
        return fs[path]

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        if not path.startswith("/"):
            raise InvalidArgument(f"path must be absolute, got {path!r}", field="path")
        self._fs(sandbox_id)[path] = data

    async def list_files(self, sandbox_id: str, path: str) -> list[FileEntry]:
        fs = self._fs(sandbox_id)
        prefix = path.rstrip("/") + "/"
        names: dict[str, FileEntry] = {}
        for p, d in sorted(fs.items()):
            if not p.startswith(prefix):
                continue
            first, _, rest = p[len(prefix):].partition("/")
            names.setdefault(first, FileEntry(name=first, path=prefix + first, size=0 if rest else len(d),
                                              mode=0o755 if rest else 0o644, type="dir" if rest else "file",
                                              mtime=0.0))
        return list(names.values())

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        fs = self._fs(sandbox_id)
        if fs.pop(path, None) is not None:
            return
        below = [p for p in fs if p.startswith(path.rstrip("/") + "/")]
        if not below:
            raise NotFound(f"file {path} not found in sandbox {sandbox_id}", path=path)
        if not recursive:
            raise Conflict(f"{path} is a non-empty directory; pass recursive=True", path=path)
        for p in below:
            del fs[p]

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None:
        fs = self._fs(sandbox_id)
        try:
            with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tf:
                for m in tf.getmembers():
                    if m.isfile():
                        f = tf.extractfile(m)
                        fs[path.rstrip("/") + "/" + m.name.lstrip("./")] = f.read() if f else b""
        except tarfile.TarError as e:
            raise InvalidArgument(f"not a tar archive: {e}", field="body") from None

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        fs = self._fs(sandbox_id)
        prefix = path.rstrip("/") + "/"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for p, d in sorted(fs.items()):
                if p.startswith(prefix):
                    ti = tarfile.TarInfo(p[len(prefix):])
                    ti.size = len(d)
                    tf.addfile(ti, io.BytesIO(d))
        return buf.getvalue()

    # --- network ----------------------------------------------------------------------------
    async def update_network(self, sandbox_id: str, allow: list[str]) -> SandboxInfo:
        info = self._live(sandbox_id)
        if info.network is None:
            raise InvalidArgument(f"sandbox {sandbox_id} was created with network=None (no interface)",
                                  sandbox_id=sandbox_id)
        info = info.model_copy(update={"network": list(allow)})
        self.sandboxes[sandbox_id] = info
        return info

    async def network_denied_events(self, sandbox_id: str, since_seq: int = 0) -> list[DeniedAttempt]:
        self._get(sandbox_id)
        return []

    # --- checkpoints ------------------------------------------------------------------------
    async def checkpoint(self, sandbox_id: str, tenant: str) -> CheckpointInfo:
        info = self._live(sandbox_id)
        cid = "ck-" + secrets.token_hex(12)
        files = dict(self.files.get(sandbox_id, {}))
        ck = CheckpointInfo(id=cid, sandbox_id=sandbox_id, image=info.image, image_id=info.image_id,
                            created_at=time.time(), fs_digest="sha256:" + secrets.token_hex(32),
                            size=sum(len(d) for d in files.values()))
        spec = SandboxSpec(image=info.image, cpu=info.cpu, memory=info.memory, disk=info.disk,
                           isolation=info.isolation, labels=info.labels, timeout=info.timeout)
        self.store.units[(tenant, cid)] = _Checkpoint(ck, tenant, spec, files)
        return ck
