"""The NodeAgent protocol: what the control plane / API server may ask of one machine.

Implementations: ``dsec.node.agent.LocalNodeAgent`` (in-process, the embedded default);
later a Ray actor or HTTP proxy with the same methods. All methods are async; blocking
filesystem work is pushed to threads inside the implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel

from dsec.models import BackgroundProcess, ExecRequest, ExecResult, FileEntry, SandboxInfo, SandboxSpec


class ExecEvent(BaseModel):
    """One item of a streamed exec: output chunks, then exactly one ``exit``."""

    kind: Literal["stdout", "stderr", "exit"]
    data: str = ""
    result: ExecResult | None = None


class NodeCapacity(BaseModel):
    node_id: str
    cpu: float
    memory: int
    disk: int
    max_sandboxes: int
    isolation: list[str]
    gpus: dict[str, int] = {}
    labels: dict[str, str] = {}


@runtime_checkable
class NodeAgent(Protocol):
    node_id: str

    async def start(self) -> None:
        """Reconcile recorded state against the kernel (adopt or clean) and start loops."""

    async def close(self) -> None:
        """Stop background loops; sandboxes keep running (adopted on next start)."""

    def capacity(self) -> NodeCapacity: ...

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     tenant: str | None = None) -> SandboxInfo: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> list[SandboxInfo]: ...

    async def destroy(self, sandbox_id: str) -> None: ...

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo: ...

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]: ...

    async def processes(self, sandbox_id: str) -> list[BackgroundProcess]: ...

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...

    async def list_files(self, sandbox_id: str, path: str) -> list[FileEntry]: ...

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None: ...

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None: ...

    async def download_tar(self, sandbox_id: str, path: str) -> bytes: ...
