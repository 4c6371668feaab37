"""The API's request and response models (pydantic only: the SDK, the API and the CLI share
them; nothing here imports FastAPI or a lower layer than config)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.config import parse_bytes

if TYPE_CHECKING:  # the state store's record; the wire models do not import the state layer
    from dsec.state.store import TenantRecord

TENANT_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class TimeoutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timeout: float = Field(..., gt=0, le=7 * 24 * 3600, description="New wall timeout from now (s)")


class NetworkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    allow: list[str] = Field(..., max_length=256,
                             description="New egress allow-list: IP[:port], CIDR[:port], hostname[:port]")


class BulkKillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: dict[str, str] = Field(..., min_length=1, description="Kill every own sandbox with all these labels")


class BulkKillResult(BaseModel):
    killed: list[str]


class SignalRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    signal: int = Field(9, ge=1, le=64)


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=TENANT_NAME_PATTERN, description="Tenant name (lowercase, [a-z0-9_-])")
    admin: bool = False
    max_sandboxes: int | None = Field(None, ge=0, le=1_000_000)
    max_cpu: float | None = Field(None, ge=0, le=1_000_000)
    max_memory: int | str | None = Field(None, description="bytes or e.g. '64G'")
    images: list[str] | None = Field(None, max_length=1024, description="Image name globs allowed (None = all)")

    @field_validator("max_memory")
    @classmethod
    def _mem(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_bytes(v)


class TenantInfo(BaseModel):
    name: str
    uid: str = Field("", description="Immutable internal id: keys its episodes/checkpoints (not a credential)")
    admin: bool
    max_sandboxes: int | None
    max_cpu: float | None
    max_memory: int | None
    images: list[str] | None
    created_at: float

    @classmethod
    def of(cls, rec: TenantRecord) -> TenantInfo:
        return cls(**rec.model_dump(exclude={"token_hash"}))


class TenantCreated(BaseModel):
    tenant: TenantInfo
    token: str = Field(..., description="Shown once; only its hash is stored")


class Health(BaseModel):
    status: str
    version: str
    node: str | None
    uptime_s: float


class AuditEntry(BaseModel):
    ts: float
    kind: str
    data: dict[str, Any]


class ImageBuildRequest(BaseModel):
    """Build an image from a base plus steps (the images builder's YAML spec, as JSON)."""

    model_config = ConfigDict(extra="forbid")
    tag: str = Field(..., min_length=1, max_length=256, pattern=r"^[^\x00\s]+$", description="NAME:TAG of the result")
    spec: dict[str, Any] = Field(..., description="{'from': 'busybox', 'steps': [{'run': '...'}, ...]} (docs/images.md)")
    files: dict[str, str] = Field(default_factory=dict, max_length=1024,
                                  description="Build context: relative path -> text, for copy steps")

    @field_validator("files")
    @classmethod
    def _rel(cls, v: dict[str, str]) -> dict[str, str]:
        for p in v:
            parts = p.split("/")
            if not p or p.startswith("/") or ".." in parts or "\0" in p:
                raise ValueError(f"context path {p!r} must be relative and must not contain '..'")
        return v


class ErrorLine(BaseModel):
    """In-band error of a streamed exec (the HTTP status was already sent)."""

    kind: Literal["error"] = "error"
    error: dict[str, Any]


class RestoreRequest(BaseModel):
    """Restore a checkpoint into a NEW sandbox: same image, resources, env and files."""

    model_config = ConfigDict(extra="forbid")
    labels: dict[str, str] | None = Field(None, max_length=256, description="Replace the checkpoint's labels")
    timeout: float | None = Field(None, gt=0, le=7 * 24 * 3600, description="Wall timeout of the new sandbox (s)")
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[!-~]+$",
                                   description="Idempotency key: a retried restore returns the same sandbox")
