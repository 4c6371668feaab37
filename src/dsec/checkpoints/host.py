"""What the episode engine needs from the machine that runs sandboxes.

The sandbox manager (``dsec.node.manager``) provides these hooks; an adapter maps them
onto this protocol so the engine stays independent of how sandboxes are made.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from dsec.checkpoints.unit import Compat
from dsec.models import ExecRequest, ExecResult, SandboxSpec


class ImageView(BaseModel):
    """The image a sandbox runs on, as the checkpoint engine sees it."""

    compat: Compat
    lower_dirs: list[Path] = Field(default_factory=list, description="Unpacked image layers (host)")


EPISODE_TENANT: ContextVar[Any] = ContextVar("dsec_episode_tenant", default=None)
"""The tenant an episode call runs for (set by the API's episode routes).

The engine is tenant-agnostic (its keys already carry the tenant's uid); a host that
makes sandboxes for a tenant reads this to put them through the tenant's admission and
the scheduler, on every path that makes one (open, resume, a step replacing a dirty
sandbox), without threading the tenant through the engine's recovery code."""


@runtime_checkable
class EpisodeHost(Protocol):
    async def image_view(self, spec: SandboxSpec) -> ImageView:
        """Resolve the spec's image to its digest, layer digests and unpacked layer dirs."""

    async def create(self, spec: SandboxSpec, extra_lower_dirs: list[Path], sandbox_id: str) -> str:
        """A new sandbox ``sandbox_id`` whose root is image layers + ``extra_lower_dirs``
        (top-most first). The caller picks the id so it can record it before it exists."""

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...

    async def destroy(self, sandbox_id: str) -> None:
        """Destroy; an unknown sandbox is not an error (it may have died with its node)."""

    def upper_dir(self, sandbox_id: str) -> Path: ...

    async def freeze(self, sandbox_id: str) -> None: ...

    async def thaw(self, sandbox_id: str) -> None: ...
