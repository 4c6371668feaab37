"""The NodeAgent protocol: everything the control plane / API server may ask of one machine.

Implementations: ``dsec.node.agent.LocalNodeAgent`` (in-process, the embedded default),
``dsec.cluster.ray.RayNodeProxy`` (the same agent inside a Ray actor on another node) and
``dsec.testing.FakeNodeAgent`` (in-memory, for tests of the layers above). All three run
one contract suite (``tests/contract/node/``).

The rule: a caller uses ONLY these methods and these models. Every argument and result
is a pydantic model or a plain value, so each call can cross a process or machine
boundary (Ray pickles them; an HTTP transport would JSON them). Nothing here hands out
paths, record objects or managers: what the API once read from a node's disk (upper
dirs for checkpoints, /proc for usage, the image store for layer indexes) is a method
that runs ON the node and returns a model.

All methods are async except ``capacity()`` (static for the node's life; a remote proxy
fetches it once in ``start()``). ``exec_stream`` is an async iterator of ``ExecEvent``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, Field

from dsec.errors import LeaderFenced
from dsec.models import (
    BackgroundProcess,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    SandboxInfo,
    SandboxSpec,
)
from dsec.models.checkpoint import CheckpointInfo
from dsec.models.image import PullStatus
from dsec.net.models import DeniedAttempt

__all__ = ["CheckpointInfo", "DeniedAttempt", "ExecEvent", "FenceGate", "ImageLayers", "LayerIndex", "NodeAgent",
           "NodeCapacity", "NodeHealth", "NodeUsage", "RestoreSource"]


class FenceGate:
    """The node's side of scheduler leadership (issue 13): the highest fencing token any
    leader has shown it. Placement and destroy calls carry the caller's token; a lower one
    comes from a deposed leader (a newer one has acted here since) and is refused, so a
    leader that lost its lease can never place or destroy again, even with calls it had in
    flight. ``path`` keeps the highest token across an agent restart (written only when it
    grows: once per new leader)."""

    def __init__(self, node_id: str, path: Path | None = None) -> None:
        self.node_id = node_id
        self.path = path
        self.highest = 0
        if path is not None:
            try:
                self.highest = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                self.highest = 0

    def check(self, token: int | None, what: str) -> None:
        """Admit ``token`` (None: not a scheduler call) or raise ``LeaderFenced``."""
        if token is None:
            return
        if token < self.highest:
            raise LeaderFenced(f"node {self.node_id} refused {what}: scheduler fencing token {token} is below "
                               f"{self.highest}, the newest leader's; this server is no longer the scheduler "
                               "leader", token=token, highest=self.highest, node=self.node_id)
        if token > self.highest:
            self.highest = token
            if self.path is not None:
                from dsec.durable import atomic_write

                atomic_write(self.path, str(token).encode())


class NodeCapacity(BaseModel):
    node_id: str
    cpu: float
    memory: int
    disk: int
    max_sandboxes: int
    isolation: list[str]
    gpus: dict[str, int] = {}
    labels: dict[str, str] = {}


class NodeUsage(BaseModel):
    """What the node's sandboxes use now (input of the scheduler's overcommit guard)."""

    node_id: str
    cpu_busy: float = Field(..., ge=0, le=1, description="Fraction of the node's CPUs the sandboxes kept busy "
                            "since the previous usage() call (node-wide use where cgroup accounting is missing)")
    sandboxes: int = Field(..., description="Live sandboxes (pool members included)")
    active_execs: int = Field(0, description="Commands running right now")


class NodeHealth(BaseModel):
    node_id: str
    ok: bool = Field(..., description="False: the node cannot create sandboxes (reason in `problems`)")
    pid: int = Field(..., description="PID of the agent process on its machine")
    hostname: str = ""
    started_at: float = 0.0
    sandboxes: int = 0
    isolation: list[str] = Field(default_factory=list, description="Runtimes found on this node")
    problems: list[str] = Field(default_factory=list)
    pulls: list[PullStatus] = Field(default_factory=list, description="Image pulls in progress, then the last "
                                    "finished ones (bytes by source: registry, peer:<node>, local)")
    prefetched_bytes: int = Field(0, description="Bytes this node fetched (registry or peers) for prefetches since "
                                  "its agent started: layers of popular images before any create asked for them")


class ImageLayers(BaseModel):
    """One image as a node holds it: the scheduler's image-aware placement input."""

    image_id: str
    names: list[str] = Field(default_factory=list)
    layers: list[tuple[str, int]] = Field(default_factory=list, description="(digest, compressed size) base first")
    access_order: list[str] = Field(default_factory=list, description="Layer digests in the order this node's "
                                    "sandboxes first needed them (the image store's access_order record)")


class LayerIndex(BaseModel):
    node_id: str
    images: list[ImageLayers] = Field(default_factory=list)

    def digests(self) -> set[str]:
        return {d for i in self.images for d, _ in i.layers}


class RestoreSource(BaseModel):
    """Create a sandbox from a checkpoint in the shared blob store (on whichever node)."""

    tenant: str = Field(..., description="Tenant that owns the checkpoint (lookups are scoped to it)")
    checkpoint_id: str


@runtime_checkable
class NodeAgent(Protocol):
    node_id: str

    # --- the node itself ------------------------------------------------------------------
    async def start(self) -> None:
        """Reconcile recorded state against the kernel (adopt or clean) and start loops."""

    async def close(self) -> None:
        """Stop background loops; sandboxes keep running (adopted on next start)."""

    def capacity(self) -> NodeCapacity: ...

    async def usage(self) -> NodeUsage: ...

    async def health(self) -> NodeHealth: ...

    async def layer_index(self) -> LayerIndex:
        """Every image this node holds, with its layers."""

    async def resolve_image(self, ref: str) -> ImageLayers:
        """One image's layers; NotFound naming ``ref`` if the node does not hold it."""

    # --- lifecycle --------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None, tenant: str | None = None,
                     pooled: bool = False, restore: RestoreSource | None = None,
                     fence: int | None = None) -> SandboxInfo:
        """``pooled``: a warm-pool member, state ``ready``, no TTL until ``claim``.
        ``restore``: root = image + the checkpoint's layers (verified) + a fresh upper.
        ``fence``: the scheduler leader's fencing token (``FenceGate``); a token below the
        highest this node has seen is refused with ``LeaderFenced``. None: not a scheduler
        decision (a user's own call), not checked."""

    async def claim(self, sandbox_id: str, spec: SandboxSpec, tenant: str | None = None, *,
                    fence: int | None = None) -> SandboxInfo:
        """Hand a ``ready`` pool member to a user with the request's env/labels/timeout."""

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self, labels: dict[str, str] | None = None, tenant: str | None = None) -> list[SandboxInfo]: ...

    async def destroy(self, sandbox_id: str, *, fence: int | None = None) -> None: ...

    async def raise_fence(self, token: int) -> int:
        """A new scheduler leader's first call: from now on calls with a lower token are
        refused (``LeaderFenced`` if ``token`` itself is already below). Returns the highest."""

    async def set_timeout(self, sandbox_id: str, timeout: float) -> SandboxInfo: ...

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Back to the state it was created in (processes, files, limits, network); same id and TTL."""

    async def cpu_used(self, sandbox_id: str) -> float | None:
        """Mean CPUs the sandbox kept busy since hand-over (right-sizing); None if unknown."""

    # --- exec -------------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]: ...

    async def processes(self, sandbox_id: str) -> list[BackgroundProcess]: ...

    async def kill_process(self, sandbox_id: str, pid: int, signal: int = 9) -> None: ...

    # --- files ------------------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...

    async def list_files(self, sandbox_id: str, path: str) -> list[FileEntry]: ...

    async def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None: ...

    async def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> None: ...

    async def download_tar(self, sandbox_id: str, path: str) -> bytes: ...

    # --- network ----------------------------------------------------------------------------
    async def update_network(self, sandbox_id: str, allow: list[str]) -> SandboxInfo: ...

    async def network_denied_events(self, sandbox_id: str, since_seq: int = 0) -> list[DeniedAttempt]:
        """Refused connection attempts with ``seq > since_seq``; still answered for a while
        after the sandbox is destroyed (its last attempts), NotFound for an unknown id."""

    # --- checkpoints (capture runs where the sandbox is; the unit goes to the shared store) --
    async def checkpoint(self, sandbox_id: str, tenant: str) -> CheckpointInfo: ...


NODE_METHODS: tuple[str, ...] = (
    "usage", "health", "layer_index", "resolve_image", "create", "claim", "get", "list", "destroy", "raise_fence",
    "set_timeout", "reset", "cpu_used", "exec", "processes", "kill_process", "read_file", "write_file", "list_files",
    "remove_file", "upload_tar", "download_tar", "update_network", "network_denied_events", "checkpoint")
"""The async request/response methods of ``NodeAgent`` (``exec_stream``, ``capacity``,
``start``/``close`` aside): what a remote transport forwards, and nothing else."""

EPISODE_METHODS: tuple[str, ...] = ("episode",)
"""Optional: a node that runs episodes for a control plane elsewhere (``LocalNodeAgent``:
``episode(op, key, args)``, dsec.checkpoints.node_episodes) — the episode's steps and their
fs capture run where its sandbox is, units go to the shared store. A remote transport
forwards these too; a node without them (the shared test fake) holds no episodes."""
