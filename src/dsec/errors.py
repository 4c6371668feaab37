"""The DSec error tree, shared by the library, the API server and the SDK.

Every error carries a stable machine code (``code``) and the HTTP status it maps to.
The API maps errors to HTTP in one place (``dsec.api.errors``) and the SDK maps them
back, so users only ever see these classes, never raw HTTP errors.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DSecError(Exception):
    """Base of every DSec error."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidArgument(DSecError):
    code = "invalid_argument"
    http_status = 422


class Unauthorized(DSecError):
    code = "unauthorized"
    http_status = 401


class Forbidden(DSecError):
    code = "forbidden"
    http_status = 403


class NotFound(DSecError):
    code = "not_found"
    http_status = 404


class Conflict(DSecError):
    """The object exists in a state that does not allow the operation."""

    code = "conflict"
    http_status = 409


class PayloadTooLarge(DSecError):
    code = "payload_too_large"
    http_status = 413


class QuotaExceeded(DSecError):
    code = "quota_exceeded"
    http_status = 429


class CapacityExhausted(DSecError):
    """No capacity now; retry after ``details['retry_after']`` seconds."""

    code = "capacity_exhausted"
    http_status = 429


class Overloaded(DSecError):
    """Backpressure: the queue is above its watermark; retry later."""

    code = "overloaded"
    http_status = 429


class Timeout(DSecError):
    code = "timeout"
    http_status = 504


class SandboxFailure(DSecError):
    """The sandbox or its runtime failed (start failure, agent lost, ...)."""

    code = "sandbox_failure"
    http_status = 502


class ImageError(DSecError):
    """An image archive, layer or build is invalid (corrupt, wrong digest, malicious)."""

    code = "image_error"
    http_status = 422


class DigestMismatch(ImageError):
    code = "digest_mismatch"


class UnsafeLayer(ImageError):
    code = "unsafe_layer"


class BuildFailed(ImageError):
    code = "build_failed"


class CheckpointError(DSecError):
    code = "checkpoint_error"
    http_status = 500


class ReplayDiverged(DSecError):
    """A resumed episode issued a command that differs from its trajectory log."""

    code = "replay_diverged"
    http_status = 409


class EpisodeFenced(Conflict):
    """A newer owner opened the episode: this (stale) owner may no longer append to it."""

    code = "episode_fenced"
    http_status = 409


class StorageFull(DSecError):
    code = "storage_full"
    http_status = 507


class TransientError(DSecError):
    """A failure worth retrying (connection reset, 502/503 from a proxy)."""

    code = "transient"
    http_status = 503


class StateUnavailable(TransientError):
    """The shared state store (Redis) cannot be reached: nothing was changed; retry after
    ``details['retry_after']`` (the server recovers by itself when the store is back)."""

    code = "state_unavailable"


class StateSchemaMismatch(DSecError):
    """The state store was written by a server with another schema version: refused at start."""

    code = "state_schema_mismatch"


class LeaderFenced(Conflict):
    """A node refused a placement or destroy carrying a scheduler fencing token below the
    highest it has seen: the caller is a deposed scheduler leader and may not act."""

    code = "leader_fenced"
    http_status = 409


class NotLeader(TransientError):
    """This API server is not the scheduler leader and could not hand the placement to the
    leader (none elected yet, or it just died): retry after ``details['retry_after']``."""

    code = "not_leader"


class NodeLost(DSecError):
    """The node that holds the sandbox does not answer (machine, raylet or agent gone):
    the sandbox is unreachable; create a new one or restore a checkpoint."""

    code = "node_lost"
    http_status = 410


ALL_ERRORS: tuple[type[DSecError], ...] = (
    DSecError, InvalidArgument, Unauthorized, Forbidden, NotFound, Conflict, PayloadTooLarge,
    QuotaExceeded, CapacityExhausted, Overloaded, Timeout, SandboxFailure, ImageError,
    DigestMismatch, UnsafeLayer, BuildFailed, CheckpointError, ReplayDiverged, StorageFull,
    TransientError, EpisodeFenced, StateUnavailable, StateSchemaMismatch, NodeLost, LeaderFenced, NotLeader,
)

ERRORS_BY_CODE: dict[str, type[DSecError]] = {cls.code: cls for cls in ALL_ERRORS}


def error_from_dict(payload: dict[str, Any], status: int) -> DSecError:
    """Rebuild the right error class from an API error body (used by the SDK)."""
    cls = ERRORS_BY_CODE.get(str(payload.get("code", "")), DSecError)
    err = cls(str(payload.get("message", f"HTTP {status}")), **(payload.get("details") or {}))
    return err
