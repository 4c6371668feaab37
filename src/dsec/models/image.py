"""Image wire models."""

from __future__ import annotations

from pydantic import BaseModel, Field


class LayerInfo(BaseModel):
    digest: str = Field(..., description="sha256:... of the compressed blob")
    diff_id: str = Field(..., description="sha256:... of the uncompressed tar")
    size: int = Field(..., description="Compressed size in bytes")
    media_type: str


class ImageInfo(BaseModel):
    id: str = Field(..., description="sha256:... of the image config")
    names: list[str] = Field(default_factory=list)
    layers: list[LayerInfo] = Field(default_factory=list)
    size: int = 0
    created_at: float = 0.0
    last_used: float | None = None
    env: list[str] = Field(default_factory=list)
    workdir: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
