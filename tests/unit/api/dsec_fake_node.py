"""In-memory NodeAgent test double for unit tests of the API/SDK layer ONLY.

It implements the NodeAgent protocol faithfully enough for the service layer's logic
(tenancy, idempotency, errors, audit, SDK marshalling). Commands are interpreted, not
run: ``echo TEXT``, ``exit N``, ``cat PATH``, ``sleep S`` (times out past the timeout),
``fail`` (raises SandboxFailure). Real execution is covered by tests/e2e.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import AsyncIterator

from dsec.config import Settings, parse_bytes
from dsec.errors import Conflict, NotFound, SandboxFailure
from dsec.models import BackgroundProcess, ExecRequest, ExecResult, FileEntry, SandboxInfo, SandboxSpec
from dsec.models.sandbox import SandboxState
from dsec.node.api import ExecEvent, NodeCapacity


class FakeNode:
    node_id = "fake-node"

    def __init__(self, settings: Settings, known_images: tuple[str, ...] = ("busybox", "python")) -> None:
        self.settings = settings
        self.known_images = known_images
        self.sandboxes: dict[str, SandboxInfo] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.started = False
        self.create_calls = 0

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    def capacity(self) -> NodeCapacity:
        return NodeCapacity(node_id=self.node_id, cpu=8, memory=32 * 2**30, disk=100 * 2**30,
                            max_sandboxes=100, isolation=["container", "gvisor"])

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     tenant: str | None = None) -> SandboxInfo:
        self.create_calls += 1
        await asyncio.sleep(0)
        if spec.image.split(":")[0] not in self.known_images:
            raise NotFound(f"image {spec.image!r} not found; import it with `dsec image import`", image=spec.image)
        sid = sandbox_id or f"sb-fake{len(self.sandboxes)}"
        now = time.time()
        info = SandboxInfo(
            id=sid, state=SandboxState.idle, image=spec.image, cpu=spec.cpu or self.settings.default_cpu,
            memory=spec.memory if isinstance(spec.memory, int) else parse_bytes(self.settings.default_memory),
            disk=spec.disk if isinstance(spec.disk, int) else parse_bytes(self.settings.default_disk),
            pids=spec.pids or self.settings.default_pids, timeout=spec.timeout or self.settings.default_timeout_s,
            network=spec.network, labels=spec.labels, tenant=tenant, node=self.node_id, created_at=now,
            started_at=now, expires_at=now + (spec.timeout or self.settings.default_timeout_s))
        self.sandboxes[sid] = info
        self.files[sid] = {}
        return info

    def _get(self, sandbox_id: str) -> SandboxInfo:
        info = self.sandboxes.get(sandbox_id)
        if info is None:
            raise NotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._get(sandbox_id)

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> list[SandboxInfo]:
        return [i for i in self.sandboxes.values()
                if (tenant is None or i.tenant == tenant)
                and all(i.labels.get(k) == v for k, v in (labels or {}).items())]

    async def destroy(self, sandbox_id: str) -> None:
        self._get(sandbox_id)
        del self.sandboxes[sandbox_id]
        del self.files[sandbox_id]

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo:
        info = self._get(sandbox_id)
        info.timeout = timeout
        info.expires_at = time.time() + timeout
        return info

    def _run(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        self._get(sandbox_id)
        argv = req.argv()
        words = shlex.split(argv[2]) if argv[:2] == ["/bin/sh", "-c"] else argv
        if words[0] == "echo":
            return ExecResult(exit_code=0, stdout=" ".join(words[1:]) + "\n", duration=0.001)
        if words[0] == "exit":
            return ExecResult(exit_code=int(words[1]), duration=0.001)
        if words[0] == "cat":
            data = self.files[sandbox_id].get(words[1])
            if data is None:
                return ExecResult(exit_code=1, stderr=f"cat: {words[1]}: No such file\n")
            return ExecResult(exit_code=0, stdout=data.decode())
        if words[0] == "sleep":
            timeout = req.timeout or self.settings.exec_default_timeout_s
            if float(words[1]) > timeout:
                return ExecResult(exit_code=-9, timed_out=True, duration=timeout)
            return ExecResult(exit_code=0, duration=float(words[1]))
        if words[0] == "fail":
            raise SandboxFailure(f"sandbox {sandbox_id} agent lost")
        return ExecResult(exit_code=127, stderr=f"{words[0]}: not found\n")

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        res = self._run(sandbox_id, req)
        if req.background:
            return ExecResult(exit_code=0, pid=4242)
        return res

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        res = self._run(sandbox_id, req)
        for line in res.stdout.splitlines(keepends=True):
            yield ExecEvent(kind="stdout", data=line)
        if res.stderr:
            yield ExecEvent(kind="stderr", data=res.stderr)
        yield ExecEvent(kind="exit", result=res)

    async def processes(self, sandbox_id: str) -> list[BackgroundProcess]:
        self._get(sandbox_id)
        return [BackgroundProcess(pid=4242, argv=["sleep", "100"], started_at=time.time(), running=True)]

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        self._get(sandbox_id)
        if pid != 4242:
            raise NotFound(f"process {pid} not found in sandbox {sandbox_id}")

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        self._get(sandbox_id)
        if path not in self.files[sandbox_id]:
            raise NotFound(f"file {path} not found in sandbox {sandbox_id}", path=path)
        return self.files[sandbox_id][path]

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        self._get(sandbox_id)
        self.files[sandbox_id][path] = data

    async def list_files(self, sandbox_id: str, path: str) -> list[FileEntry]:
        self._get(sandbox_id)
        prefix = path.rstrip("/") + "/"
        return [FileEntry(name=p[len(prefix):], path=p, size=len(d), mode=0o644, type="file", mtime=0.0)
                for p, d in sorted(self.files[sandbox_id].items()) if p.startswith(prefix)]

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        self._get(sandbox_id)
        if self.files[sandbox_id].pop(path, None) is None:
            raise NotFound(f"file {path} not found in sandbox {sandbox_id}", path=path)

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None:
        self._get(sandbox_id)
        if not tar_bytes:
            raise Conflict("empty tar")
        self.files[sandbox_id][path.rstrip("/") + "/.tar"] = tar_bytes

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        self._get(sandbox_id)
        return self.files[sandbox_id].get(path.rstrip("/") + "/.tar", b"")
