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


class PullStatus(BaseModel):
    """One image pull on a node, in progress or recently finished (``dsec node ls``)."""

    ref: str = Field(..., description="Registry reference being pulled")
    state: str = Field("pulling", description="pulling, done or failed")
    done_bytes: int = 0
    total_bytes: int = 0
    blobs: int = Field(0, description="Blobs (config + layers) the image has")
    blobs_done: int = 0
    sources: dict[str, int] = Field(default_factory=dict, description="Bytes by source: registry, peer:<node>, local")
    started_at: float = 0.0
    seconds: float = Field(0.0, description="Time spent so far (or in all, once finished: blobs and unpack)")
    fetch_seconds: float | None = Field(None, description="Time until every blob was in the store (verified), "
                                        "before unpacking")
    error: str = ""
    prefetch: bool = Field(False, description="Fetched ahead of any create (the leader's prefetch of a popular "
                           "image), not for a create waiting on it")
