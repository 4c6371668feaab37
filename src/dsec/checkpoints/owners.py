"""Episode ownership records in the blob store (the I/O side of ``fencing``)."""

from __future__ import annotations

import logging
import time

from dsec import errors
from dsec.blobs import BlobStore
from dsec.checkpoints import fencing
from dsec.checkpoints.unit import UnitMeta, complete_units

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
