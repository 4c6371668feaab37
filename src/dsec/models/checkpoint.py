"""Checkpoint wire models (shared by the API, the SDK and the node agents)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class CheckpointInfo(BaseModel):
    """What ``sb.checkpoint()`` returns; ``Sandbox.restore(info.id)`` brings it back."""

    id: str = Field(..., description="Checkpoint id (ck-...), scoped to the tenant")
    sandbox_id: str = Field(..., description="The sandbox it was taken of")
    image: str
    image_id: str | None = None
    created_at: float
    fs_digest: str = Field(..., description="Digest of the canonical filesystem manifest (same files = same digest)")
    size: int = Field(..., description="Bytes of filesystem layers a restore reads")
    parent: str | None = Field(None, description="Checkpoint the sandbox was itself restored from")
