"""Wire models of the episodes API (shared by the engine, the router and the SDK)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from dsec.models import ExecResult


class CheckpointRef(BaseModel):
    episode_id: str
    seq: int
    steps: int
    fs_digest: str


class EpisodeInfo(BaseModel):
    id: str
    epoch: int = Field(0, description="Owner epoch of this open: pass it back on writes (fencing)")
    steps: int
    seq: int
    sandbox_id: str | None
    fs_digest: str
    has_context: bool
    weights_ref: str | None = None
    resumed: bool = False
    restore_s: float = 0.0


class StepResult(ExecResult):
    step: int
    replayed: bool = False
    fs_digest: str = ""
    checkpoint_s: float = 0.0

__all__ = ["CheckpointRef", "EpisodeInfo", "StepResult"]
