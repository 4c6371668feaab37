"""``AsyncEpisode``: the asyncio twin of ``dsec.Episode`` (same requests, awaited).

    async with await dsec.AsyncEpisode.open("ep-42", image="python") as ep:
        r = await ep.exec("python solve.py")
        await ep.save_context({"messages": msgs})
"""

from __future__ import annotations

from typing import Any, Self

from dsec.models import ExecRequest
from dsec.models.episode import CheckpointRef, EpisodeInfo, StepResult
from dsec.sdk import _episode_ops as ops
from dsec.sdk._client import AsyncClient


class AsyncEpisode(ops.EpisodeHandle):
    def __init__(self, info: EpisodeInfo, client: AsyncClient) -> None:
        super().__init__(info)
        self._c = client

    @classmethod
    async def open(cls, episode_id: str, image: str = "busybox", *, client: AsyncClient | None = None,
                   **sandbox_args: Any) -> AsyncEpisode:
        c = client or AsyncClient.default()
        return cls(await c._run(ops.open_(episode_id, image, sandbox_args)), c)

    async def exec(self, cmd: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: str | None = None) -> StepResult:
        req = ExecRequest(cmd=cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        res = await self._c._run(ops.step(self.id, self.epoch, self._next, req, self._c.config.timeout_s))
        self._next += 1
        return res

    async def save_context(self, context: Any) -> CheckpointRef:
        return await self._c._run(ops.save_context(self.id, self.epoch, context))

    async def context(self) -> Any:
        return await self._c._run(ops.context(self.id))

    async def checkpoint(self, weights_ref: str | None = None, meta: dict[str, Any] | None = None) -> CheckpointRef:
        return await self._c._run(ops.checkpoint(self.id, self.epoch, weights_ref, meta))

    async def fork(self, new_id: str | None = None) -> AsyncEpisode:
        """``await ep.fork()``: see ``Episode.fork``."""
        child = AsyncEpisode(await self._c._run(ops.fork(self.id, self.epoch, new_id)), self._c)
        child._next = child.info.steps
        return child

    async def refresh(self) -> EpisodeInfo:
        return await self._c._run(ops.info(self.id))

    async def export(self) -> bytes:
        return await self._c._run(ops.export(self.id))

    async def close(self) -> None:
        await self._c._run(ops.close(self.id, self.epoch))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
