"""Request builders of the episodes API, shared by ``Episode`` and ``AsyncEpisode``.

The only place that knows episode URLs, payloads and the fencing header; the two handle
classes differ only in whether they await ``client._run``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from dsec.models import ExecRequest, SandboxSpec
from dsec.models.episode import CheckpointRef, EpisodeInfo, StepResult
from dsec.sdk._core import Call


class EpisodeHandle:
    """State both episode handles share: the open answer and the next step index."""

    def __init__(self, info: EpisodeInfo) -> None:
        self.id = info.id
        self.info = info
        self._next = 0

    @property
    def resumed(self) -> bool:
        return self.info.resumed

    @property
    def epoch(self) -> int:
        """This handle's owner epoch (a newer ``open`` of the same id fences it)."""
        return self.info.epoch

    @property
    def step(self) -> int:
        """Index the next ``exec`` will have."""
        return self._next


_EP = "/v1/episodes"
EPOCH_HEADER = "x-dsec-episode-epoch"  # same as dsec.api.episodes.EPOCH_HEADER


def _p(episode_id: str) -> str:
    return f"{_EP}/{quote(episode_id, safe='')}"


def _owner(epoch: int) -> dict[str, str]:
    return {EPOCH_HEADER: str(epoch)}


def open_(episode_id: str, image: str, sandbox_args: dict[str, Any]) -> Call[EpisodeInfo]:
    spec = SandboxSpec(image=image, **sandbox_args)
    # Safe to resend: a repeated open only makes the caller the owner again (a newer epoch).
    return Call("POST", f"{_p(episode_id)}/open", lambda r: EpisodeInfo.model_validate_json(r.content),
                json={"spec": spec.model_dump(mode="json", exclude_none=True)}, idempotent=True)


def step(episode_id: str, epoch: int, index: int, req: ExecRequest, base_timeout: float) -> Call[StepResult]:
    # Idempotent by construction: a retried step N returns the logged result of step N.
    return Call("POST", f"{_p(episode_id)}/steps", lambda r: StepResult.model_validate_json(r.content),
                json={"step": index, "request": req.model_dump(mode="json", exclude_none=True)},
                headers=_owner(epoch), idempotent=True, timeout=(req.timeout or 0) + base_timeout)


def save_context(episode_id: str, epoch: int, context: Any) -> Call[CheckpointRef]:
    return Call("PUT", f"{_p(episode_id)}/context", lambda r: CheckpointRef.model_validate_json(r.content),
                json=context, headers=_owner(epoch), idempotent=True)


def context(episode_id: str) -> Call[Any]:
    return Call("GET", f"{_p(episode_id)}/context", lambda r: r.json(), idempotent=True)


def checkpoint(episode_id: str, epoch: int, weights_ref: str | None, meta: dict[str, Any] | None) -> Call[CheckpointRef]:
    return Call("POST", f"{_p(episode_id)}/checkpoint", lambda r: CheckpointRef.model_validate_json(r.content),
                json={"weights_ref": weights_ref, "meta": meta or {}}, headers=_owner(epoch), idempotent=True)


def fork(episode_id: str, epoch: int, new_id: str | None) -> Call[EpisodeInfo]:
    # Not resent: a fork that reached the server made the new episode already.
    return Call("POST", f"{_p(episode_id)}/fork", lambda r: EpisodeInfo.model_validate_json(r.content),
                json={"new_id": new_id}, headers=_owner(epoch))


def info(episode_id: str) -> Call[EpisodeInfo]:
    return Call("GET", _p(episode_id), lambda r: EpisodeInfo.model_validate_json(r.content), idempotent=True)


def export(episode_id: str) -> Call[bytes]:
    return Call("GET", f"{_p(episode_id)}/export", lambda r: r.content, idempotent=True)


def close(episode_id: str, epoch: int) -> Call[None]:
    return Call("DELETE", _p(episode_id), lambda r: None, headers=_owner(epoch), idempotent=True)
