"""EpisodeHost over the real node (``dsec.node.agent.LocalNodeAgent`` + its SandboxManager).

Uses the manager's checkpoint hooks: ``upper_dir`` (the sandbox's overlay upper, on its
quota tmpfs), ``freeze``/``thaw`` (cgroup freezer, so a background process cannot
change files mid-capture) and ``create(..., extra_lower_dirs=...)`` (restore: image
layers + checkpoint layers as read-only lowers, fresh upper).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.checkpoints.host import EPISODE_TENANT, ImageView
from dsec.checkpoints.unit import Compat
from dsec.models import ExecRequest, ExecResult, SandboxSpec


class NodeEpisodeHost:
    """``sandboxes`` (the API's SandboxService): when an episode call runs for a tenant
    (``EPISODE_TENANT``), its sandboxes are made and destroyed through it, so they count
    against the tenant's quotas and the node's bound like any other (issue 18 #4)."""

    def __init__(self, node: Any, sandboxes: Any = None) -> None:
        self.node = node
        self.sandboxes = sandboxes
        self.manager = node.manager
        self._skipped: set[str] = set()

    async def image_view(self, spec: SandboxSpec) -> ImageView:
        images = self.manager.images
        info = await asyncio.to_thread(images.resolve, spec.image)
        dirs = await asyncio.to_thread(images.layer_dirs, info.id)
        isolation = spec.isolation or self.node.settings.default_isolation
        return ImageView(compat=Compat(image=spec.image, image_id=info.id,
                                       image_layers=[li.diff_id for li in info.layers], isolation=isolation),
                         lower_dirs=list(dirs))

    async def create(self, spec: SandboxSpec, extra_lower_dirs: list[Path], sandbox_id: str) -> str:
        tenant = EPISODE_TENANT.get()
        if tenant is None or self.sandboxes is None:  # drills, benches, a cluster node: accounted elsewhere
            info = await self.node.create(spec, sandbox_id=sandbox_id, tenant=getattr(tenant, "name", None),
                                          extra_lower_dirs=extra_lower_dirs)
            return info.id

        async def build(s: SandboxSpec, sid: str, tenant_name: str) -> Any:
            return await self.node.create(s, sandbox_id=sid, tenant=tenant_name, extra_lower_dirs=extra_lower_dirs)
        info = await self.sandboxes.create_as(tenant, spec, sandbox_id, build)
        return info.id

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self.node.exec(sandbox_id, req)

    async def destroy(self, sandbox_id: str) -> None:
        # A server killed between freeze and thaw leaves the sandbox frozen, and frozen
        # tasks cannot die: the node's cleanup would then fail (EBUSY) on every retry.
        await asyncio.to_thread(self._thaw_cgroup, sandbox_id)
        tenant = EPISODE_TENANT.get()
        try:
            if tenant is not None and self.sandboxes is not None:
                await self.sandboxes.kill(tenant, sandbox_id)  # frees its scheduler capacity too
            else:
                await self.node.destroy(sandbox_id)
        except errors.NotFound:
            pass
        except errors.Conflict:
            pass  # already stopping/destroyed

    def upper_dir(self, sandbox_id: str) -> Path:
        return self.manager.upper_dir(sandbox_id)

    def _freezer_dir(self, sandbox_id: str) -> Path:
        from dsec.node import cgroups
        return cgroups.CGROUP_ROOT / "freezer" / self.manager.cgroup_parent / sandbox_id

    def _thaw_cgroup(self, sandbox_id: str) -> None:
        state = self._freezer_dir(sandbox_id) / "freezer.state"
        try:
            if state.read_text().strip() != "THAWED":
                state.write_text("THAWED")
        except OSError:
            pass  # no such cgroup (already gone) or no freezer: nothing to thaw

    def _only_init(self, sandbox_id: str) -> bool:
        """True if the sandbox runs nothing but its idle init agent (nothing can write files).

        Between steps that is the common case, and it saves the freezer round trip
        (two cgroup state changes polled to completion, several ms) on every step.
        """
        from dsec.node import cgroups
        rec = self.manager.live_record(sandbox_id)
        if rec.info.isolation != "container":
            return False
        try:
            procs = (cgroups.CGROUP_ROOT / "freezer" / self.manager.cgroup_parent / sandbox_id
                     / "cgroup.procs").read_text()
        except OSError:
            return False
        return len(procs.split()) <= 1

    async def freeze(self, sandbox_id: str) -> None:
        if self._only_init(sandbox_id):
            self._skipped.add(sandbox_id)
            return
        await self.manager.freeze(sandbox_id)

    async def thaw(self, sandbox_id: str) -> None:
        if sandbox_id in self._skipped:
            self._skipped.discard(sandbox_id)
            return
        await self.manager.thaw(sandbox_id)
