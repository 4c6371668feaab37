"""The control plane's records that must outlive its process (issue 13), in the state store.

The scheduler keeps its working view in memory (``dsec.control.scheduler``); what a new
scheduler leader cannot rebuild from the nodes lives here, written by whichever API
server took the request, read by the leader:

* owner leases (``owner_lease``): the last heartbeat of each owner (run id / client
  session), wall-clock time. Heartbeats reach any server; the leader's reaper judges by
  the newest one. A released lease is a tombstone until the leader reaps its sandboxes.
* pool floors (``pool_floor``): the admin's minimum warm pool size per shape (the spec).
* preemption records (``preempted``): a victim's checkpoint, tenant and spec, until it
  is resumed or its user kills it, so a new leader queues its resumption again.

Documents are small JSON objects (``StateStore.put_doc``); the conversions between them
and the scheduler's types are pure functions below.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from dsec.models import SandboxSpec
from dsec.state.store import StateStore

OWNERS = "owner_lease"
FLOORS = "pool_floor"
PREEMPTED = "preempted"


class OwnerLeaseDoc(BaseModel):
    last_heartbeat: float = Field(..., description="Unix time of the newest heartbeat")
    released: bool = Field(False, description="The owner released it: reap its sandboxes now")


class PoolFloorDoc(BaseModel):
    spec: SandboxSpec
    size: int = Field(..., ge=0)


class PreemptedDoc(BaseModel):
    tenant: str
    checkpoint_id: str
    spec: SandboxSpec | None = None
    priority: str = "medium"


def to_monotonic(wall: float, now_wall: float, now_mono: float) -> float:
    """A wall-clock instant on the scheduler's monotonic clock."""
    return now_mono - (now_wall - wall)


def floor_key(spec: SandboxSpec) -> str:
    """One document per shape: the fields that make a pool shape."""
    d = spec.model_dump(mode="json", include={"image", "cpu", "memory", "disk", "isolation", "network"})
    return "|".join(f"{k}={d[k]}" for k in sorted(d))


class ControlBook:
    def __init__(self, state: StateStore) -> None:
        self.state = state

    async def heartbeat(self, owner: str, wall: float) -> None:
        await self.state.put_doc(OWNERS, owner, OwnerLeaseDoc(last_heartbeat=wall).model_dump())

    async def release_owner(self, owner: str, wall: float) -> None:
        await self.state.put_doc(OWNERS, owner, OwnerLeaseDoc(last_heartbeat=wall, released=True).model_dump())

    async def forget_owner(self, owner: str) -> None:
        await self.state.delete_doc(OWNERS, owner)

    async def owners(self) -> dict[str, OwnerLeaseDoc]:
        return {k: OwnerLeaseDoc.model_validate(v) for k, v in (await self.state.list_docs(OWNERS)).items()}

    async def set_floor(self, spec: SandboxSpec, size: int) -> None:
        if size == 0:
            await self.state.delete_doc(FLOORS, floor_key(spec))
        else:
            await self.state.put_doc(FLOORS, floor_key(spec), PoolFloorDoc(spec=spec, size=size).model_dump(mode="json"))

    async def floors(self) -> list[PoolFloorDoc]:
        return [PoolFloorDoc.model_validate(v) for v in (await self.state.list_docs(FLOORS)).values()]

    async def preempted(self, sandbox_id: str, doc: PreemptedDoc) -> None:
        await self.state.put_doc(PREEMPTED, sandbox_id, doc.model_dump(mode="json"))

    async def resumed(self, sandbox_id: str) -> None:
        await self.state.delete_doc(PREEMPTED, sandbox_id)

    async def all_preempted(self) -> dict[str, PreemptedDoc]:
        return {k: PreemptedDoc.model_validate(v) for k, v in (await self.state.list_docs(PREEMPTED)).items()}
