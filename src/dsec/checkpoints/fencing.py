"""Episode ownership fencing: only the newest opener of an episode may append to it.

Every ``open`` makes its caller the episode's owner with a new *epoch* (one more than
any epoch seen in the store), recorded durably (``episodes/<id>/owner``) before the
caller gets it. Writes carry the caller's epoch:

* a write with an epoch below the current one comes from a stale owner (a client that
  was thought dead and came back): refused with ``EpisodeFenced``, nothing written;
* a server whose in-memory episode is older than the owner record in the store (another
  server resumed the episode) refuses to commit and drops its copy;
* every unit records its writer's epoch, and readers skip a unit whose epoch is below
  that of an earlier unit, so even a stale write racing the checks cannot become the
  restore point once the new owner has committed.

The decisions here are pure; the engine does the I/O.
"""

from __future__ import annotations

import json
from enum import Enum

from pydantic import BaseModel, Field


class Fence(str, Enum):
    OK = "ok"
    STALE_CLIENT = "stale_client"   # the caller was superseded by a newer open
    STALE_SERVER = "stale_server"   # this server's copy was superseded (another server opened it)


class OwnerRecord(BaseModel):
    epoch: int = Field(..., ge=1)
    opened_at: float = 0.0

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, raw: bytes) -> OwnerRecord | None:
        try:
            return cls.model_validate(json.loads(raw))
        except (ValueError, TypeError):
            return None


def next_epoch(stored: int | None, unit_epochs: list[int]) -> int:
    """The epoch of a new owner: above the owner record and above every unit's writer."""
    return 1 + max([stored or 0, *unit_epochs])


def decide(request_epoch: int | None, live_epoch: int, stored_epoch: int | None = None) -> Fence:
    """May a write by ``request_epoch`` go to an episode held at ``live_epoch``?

    ``request_epoch`` None is a caller that does not take part in fencing (old clients):
    it is checked against the store only. ``stored_epoch`` None: not read / unreadable.
    """
    if stored_epoch is not None and stored_epoch > live_epoch:
        return Fence.STALE_SERVER
    if request_epoch is None or request_epoch == live_epoch:
        return Fence.OK
    return Fence.STALE_CLIENT if request_epoch < live_epoch else Fence.STALE_SERVER


def valid_units(units: list[tuple[int, int]]) -> list[bool]:
    """For units given as (seq, epoch), which may be restored from.

    Ordered by (seq, epoch), a unit is valid unless an earlier one was written by a
    newer owner: then it is a stale owner's write that slipped past the checks.
    Returns one flag per input, in input order.
    """
    order = sorted(range(len(units)), key=lambda i: units[i])
    ok = [False] * len(units)
    newest = 0
    for i in order:
        epoch = units[i][1]
        ok[i] = epoch >= newest
        newest = max(newest, epoch)
    return ok
