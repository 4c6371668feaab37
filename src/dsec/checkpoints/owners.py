"""Episode ownership: the I/O side of ``fencing``.

Who owns an episode is decided by compare-and-set in the state store
(``EpisodeOwners`` over ``StateStore.claim_episode``): two servers opening one episode
at once get two different epochs, and the lower one is fenced at its first write. The
blob store's ``episodes/<id>/owner`` record is the older mechanism (a read, then a
write: two openers could both read epoch e and both become owner e+1); it is kept for
engines built without a state store (offline tools, the crash drill: one server) and
read once as a floor, so epochs stay above those of a store written before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from dsec import errors
from dsec.blobs import BlobStore
from dsec.checkpoints import fencing
from dsec.checkpoints.unit import UnitMeta, complete_units

if TYPE_CHECKING:
    from dsec.state.store import StateStore

log = logging.getLogger(__name__)


def owner_key(episode_id: str) -> str:
    return f"episodes/{episode_id}/owner"


def stored_epoch(store: BlobStore, episode_id: str) -> int | None:
    """The owner record's epoch; None if there is none or it does not parse."""
    try:
        rec = fencing.OwnerRecord.decode(store.get(owner_key(episode_id)))
    except errors.NotFound:
        return None
    return rec.epoch if rec is not None else None


def claim(store: BlobStore, episode_id: str, unit_epochs: list[int]) -> int:
    """Become the episode's newest owner: a new epoch, durable before anyone sees it."""
    epoch = fencing.next_epoch(stored_epoch(store, episode_id), unit_epochs)
    store.put(owner_key(episode_id), fencing.OwnerRecord(epoch=epoch, opened_at=time.time()).encode())
    return epoch


def restorable(store: BlobStore, episode_id: str) -> list[UnitMeta]:
    """Complete units a restore may use, newest first (a fenced writer's units skipped)."""
    units = complete_units(store, episode_id)
    ok = fencing.valid_units([(m.seq, m.epoch) for m in units])
    for m, good in zip(units, ok, strict=True):
        if not good:
            log.warning("episode %s: unit %d was written by a fenced owner (epoch %d); ignored",
                        episode_id, m.seq, m.epoch)
    return sorted((m for m, good in zip(units, ok, strict=True) if good),
                  key=lambda m: (m.seq, m.epoch), reverse=True)


def check_fence(episode_id: str, epoch: int | None, live_epoch: int, stored: int | None = None) -> None:
    """Raise ``EpisodeFenced`` unless a write by ``epoch`` may go to the episode."""
    verdict = fencing.decide(epoch, live_epoch, stored)
    if verdict is fencing.Fence.STALE_CLIENT:
        raise errors.EpisodeFenced(
            f"episode {episode_id!r} was opened again by a newer owner (epoch {live_epoch}); this handle "
            f"(epoch {epoch}) is stale and may not append to it: stop using it, or open the episode "
            "again to take it over", episode_id=episode_id, epoch=epoch, current_epoch=live_epoch)
    if verdict is fencing.Fence.STALE_SERVER:
        raise errors.EpisodeFenced(
            f"episode {episode_id!r} was resumed elsewhere (owner epoch {max(stored or 0, epoch or 0)}, this "
            f"server holds epoch {live_epoch}); open it again to continue where its owner is",
            episode_id=episode_id, epoch=epoch, current_epoch=live_epoch)


class EpisodeOwners:
    """Episode epochs: in the state store when there is one (atomic), else in the blob store."""

    def __init__(self, store: BlobStore, state: StateStore | None = None) -> None:
        self.store, self.state = store, state

    async def claim(self, episode_id: str, unit_epochs: list[int]) -> int:
        """Become the episode's newest owner; two concurrent claims never get one epoch."""
        if self.state is None:
            return await asyncio.to_thread(claim, self.store, episode_id, unit_epochs)
        legacy = await asyncio.to_thread(stored_epoch, self.store, episode_id)
        return await self.state.claim_episode(episode_id, fencing.next_epoch(legacy, unit_epochs) - 1)

    async def current(self, episode_id: str) -> int | None:
        if self.state is None:
            return await asyncio.to_thread(stored_epoch, self.store, episode_id)
        return await self.state.episode_epoch(episode_id)

    def current_blocking(self, episode_id: str, loop: asyncio.AbstractEventLoop) -> int | None:
        """``current`` from a worker thread (the unit writer checks it right before committing)."""
        if self.state is None:
            return stored_epoch(self.store, episode_id)
        return asyncio.run_coroutine_threadsafe(self.state.episode_epoch(episode_id), loop).result()
