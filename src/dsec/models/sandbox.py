"""Sandbox wire models (create spec, info, exec, files)."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.config import parse_bytes
from dsec.errors import InvalidArgument

Isolation = Literal["container", "gvisor"]


class SandboxState(str, enum.Enum):
    """Lifecycle states; allowed transitions live in ``dsec.node.lifecycle``."""

    creating = "creating"
    ready = "ready"        # created, never handed out (e.g. warm-pool member)
    running = "running"    # handed to a user, a command is running
    idle = "idle"          # handed to a user, nothing running
    stopping = "stopping"
    stopped = "stopped"
    destroyed = "destroyed"
    failed = "failed"


_SIZE_HELP = "bytes as int or a string like '512M', '8G'"


class SandboxSpec(BaseModel):
    """What a user asks for. Every default comes from Settings when left None."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field("busybox", min_length=1, max_length=256, description="Image name[:tag] or id")
    cpu: float | None = Field(None, gt=0, le=1024, description="CPUs")
    memory: int | str | None = Field(None, description=f"Memory limit, {_SIZE_HELP}")
    disk: int | str | None = Field(None, description=f"Writable-layer quota, {_SIZE_HELP}")
    pids: int | None = Field(None, ge=8, le=1_000_000, description="Max processes")
    timeout: float | None = Field(None, gt=0, le=7 * 24 * 3600, description="Wall timeout/TTL (s)")
    network: list[str] | None = Field(None, max_length=256, description="Egress allow-list; None = off")
    isolation: Isolation | None = Field(None, description="container (runc) or gvisor (runsc)")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for every exec")
    workdir: str | None = Field(None, max_length=4096, description="Default cwd for exec")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels (run, task, ...)")
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[!-~]+$",
                                   description="Idempotency key (printable ASCII, no spaces)")
    priority: Literal["high", "medium", "low"] = Field("medium", description="Scheduling priority")
    owner: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[!-~]+$",
                              description="Owner lease (run id / client session): when its heartbeats "
                                          "stop, the server reaps the sandbox (dsec.Lease)")
    gpu: str | None = Field(None, max_length=64, description="GPU slice type, e.g. 'mig-1g.10gb'")

    @field_validator("memory", "disk")
    @classmethod
    def _size(cls, v: int | str | None) -> int | None:
        if v is None:
            return None
        try:
            n = parse_bytes(v)
        except ValueError as e:
            raise ValueError(str(e)) from None
        if n < 4 * 1024 * 1024:
            raise ValueError("must be at least 4M")
        return n

    @field_validator("env", "labels")
    @classmethod
    def _kv(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 256:
            raise ValueError("at most 256 entries")
        for k in v:
            if not k or "=" in k or "\0" in k or len(k) > 256:
                raise ValueError(f"invalid key {k!r}")
        for val in v.values():
            if "\0" in val or len(val) > 65536:
                raise ValueError("values must not contain NUL and be <= 64 KiB")
        return v

    @field_validator("workdir")
    @classmethod
    def _abs(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or "\0" in v):
            raise ValueError("workdir must be an absolute path")
        return v


class SandboxInfo(BaseModel):
    id: str
    state: SandboxState
    image: str
    image_id: str | None = None
    isolation: Isolation = "container"
    cpu: float
    memory: int
    disk: int
    pids: int
    timeout: float
    network: list[str] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    tenant: str | None = None
    node: str | None = None
    created_at: float
    started_at: float | None = Field(None, description="When handed to the user (TTL starts)")
    expires_at: float | None = None
    pid: int | None = Field(None, description="Host PID of the sandbox init (node-local)")
    error: str | None = None


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cmd: str | list[str] = Field(..., description="Shell string (via /bin/sh -c) or argv list")
    timeout: float | None = Field(None, gt=0, le=24 * 3600)
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = None
    stdin: str | None = Field(None, description="Data fed to stdin (utf-8)")
    background: bool = Field(False, description="Start and return at once; see processes API")

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            if not v.strip() or "\0" in v:
                raise ValueError("cmd must be a non-empty string without NUL")
        else:
            if not v or any((not isinstance(a, str)) or "\0" in a for a in v):
                raise ValueError("cmd argv must be a non-empty list of strings without NUL")
        return v

    def argv(self) -> list[str]:
        return ["/bin/sh", "-c", self.cmd] if isinstance(self.cmd, str) else list(self.cmd)


class ExecResult(BaseModel):
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    pid: int | None = Field(None, description="Set for background processes")


class BackgroundProcess(BaseModel):
    pid: int
    argv: list[str]
    started_at: float
    running: bool
    exit_code: int | None = None


class ExecEvent(BaseModel):
    """One item of a streamed exec: output chunks, then exactly one ``exit``."""

    kind: Literal["stdout", "stderr", "exit"]
    data: str = ""
    result: ExecResult | None = None


class FileEntry(BaseModel):
    name: str
    path: str
    size: int
    mode: int
    type: Literal["file", "dir", "symlink", "other"]
    mtime: float


RESERVED_LABEL_PREFIX = "dsec."
"""Label keys under this prefix carry meaning to the control plane (``dsec.pool`` marks a
warm-pool member, ``dsec.owner`` a lease owner that a restart adopts): only the server sets them."""


def reserved_label_keys(labels: dict[str, str]) -> list[str]:
    """The keys of ``labels`` a tenant may not set (sorted, for a stable error message)."""
    return sorted(k for k in labels if k.startswith(RESERVED_LABEL_PREFIX))


def without_reserved_labels(labels: dict[str, str]) -> dict[str, str]:
    """A source sandbox's labels minus the server's bookkeeping (its pool, its lease owner):
    a clone or a restore is a new sandbox that belongs to neither."""
    return {k: v for k, v in labels.items() if not k.startswith(RESERVED_LABEL_PREFIX)}


def parse_labels(items: list[str] | None, what: str = "label", hint: str = "") -> dict[str, str]:
    """``["k=v", ...]`` -> ``{k: v}`` (a value may contain ``=``); an item without ``=`` or
    with an empty key is refused by name (``{what} 'item' must look like key=value{hint}``)."""
    labels: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidArgument(f"{what} {item!r} must look like key=value{hint}", field="label")
        labels[k] = v
    return labels
