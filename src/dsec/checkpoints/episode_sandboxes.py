"""Bookkeeping of the sandboxes episodes make, so no crash can leak one.

Every sandbox an episode creates is recorded in the blob store
(``episodes/<id>/sandboxes/<sandbox id>``) *before* it exists, with an id the engine
picks (DESIGN: record, then create); whichever server later resumes the episode
destroys what a crashed one left behind (never reuses it: it may be ahead of the log).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from dsec.blobs import BlobStore
from dsec.checkpoints.host import EpisodeHost
from dsec.ids import new_sandbox_id
from dsec.models import SandboxSpec

log = logging.getLogger(__name__)


class SandboxBook:
    def __init__(self, store: BlobStore, host: EpisodeHost) -> None:
        self.store, self.host = store, host
        self._reaping: dict[str, set[asyncio.Task]] = {}  # leftover sandboxes being destroyed

    def _marker(self, episode_id: str, sandbox_id: str) -> str:
        return f"episodes/{episode_id}/sandboxes/{sandbox_id}"

    async def new(self, episode_id: str, spec: SandboxSpec, lowers: list[Path], sandbox_id: str | None = None) -> str:
        sid = sandbox_id or new_sandbox_id()
        await asyncio.to_thread(self.store.put, self._marker(episode_id, sid), b"")
        try:
            await self.host.create(spec, lowers, sid)
        except BaseException:
            await asyncio.to_thread(self.store.delete, self._marker(episode_id, sid))
            raise
        return sid

    async def drop(self, episode_id: str, sandbox_id: str) -> None:
        await self.host.destroy(sandbox_id)
        await asyncio.to_thread(self.store.delete, self._marker(episode_id, sandbox_id))

    async def orphans(self, episode_id: str) -> list[str]:
        """Sandboxes recorded for the episode (call before making its new one)."""
        prefix = f"episodes/{episode_id}/sandboxes/"
        return [key[len(prefix):] for key in await asyncio.to_thread(self.store.list, prefix)]

    def reap_later(self, episode_id: str, sandbox_ids: list[str]) -> None:
        """Destroy ``sandbox_ids`` in the background (off the restore path)."""
        async def reap() -> None:
            for sid in sandbox_ids:
                try:
                    await self.drop(episode_id, sid)
                except Exception as exc:  # noqa: BLE001 - its marker stays: the next restore retries
                    log.warning("episode %s: destroying leftover sandbox %s failed: %s", episode_id, sid, exc)
        if sandbox_ids:
            task = asyncio.get_running_loop().create_task(reap())
            tasks = self._reaping.setdefault(episode_id, set())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def reaped(self, episode_id: str) -> None:
        """Wait until the episode's leftover sandboxes are destroyed (close: leave nothing)."""
        pending = list(self._reaping.get(episode_id, ()))
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
