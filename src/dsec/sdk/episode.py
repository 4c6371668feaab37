"""``Episode``: a resumable agent episode whose steps are logged and checkpointed server-side.

    with dsec.Episode.open("ep-42", image="python", cpu=1) as ep:   # creates, or resumes
        r = ep.exec("python solve.py")        # step 0, 1, ... (fast-forwarded on resume)
        ep.save_context({"messages": msgs})
        ep.checkpoint(weights_ref="s3://bucket/ckpt/step-128", meta={"step": 128})

The agent loop simply runs again from the start after any crash: every ``exec`` whose
step is already logged returns the logged result without running (the command must
match, else ``errors.ReplayDiverged``), and the first new step runs live in a sandbox
restored to exactly the state after the last logged step.

Each ``open`` makes this handle the episode's owner (``info.epoch``); once another
``open`` of the same id happens, this handle's writes raise ``errors.EpisodeFenced``.
``dsec.AsyncEpisode`` is the asyncio twin (same requests: ``dsec.sdk._episode_ops``).
"""

from __future__ import annotations

from typing import Any, Self

from dsec.models import ExecRequest
from dsec.models.episode import CheckpointRef, EpisodeInfo, StepResult
from dsec.sdk import _episode_ops as ops
from dsec.sdk._client import Client


class Episode(ops.EpisodeHandle):
    def __init__(self, info: EpisodeInfo, client: Client) -> None:
        super().__init__(info)
        self._c = client

    @classmethod
    def open(cls, episode_id: str, image: str = "busybox", *, client: Client | None = None,
             **sandbox_args: Any) -> Episode:
        c = client or Client.default()
        return cls(c._run(ops.open_(episode_id, image, sandbox_args)), c)

    def exec(self, cmd: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None) -> StepResult:
        req = ExecRequest(cmd=cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        res = self._c._run(ops.step(self.id, self.epoch, self._next, req, self._c.config.timeout_s))
        self._next += 1
        return res

    def save_context(self, context: Any) -> CheckpointRef:
        return self._c._run(ops.save_context(self.id, self.epoch, context))

    def context(self) -> Any:
        return self._c._run(ops.context(self.id))

    def checkpoint(self, weights_ref: str | None = None, meta: dict[str, Any] | None = None) -> CheckpointRef:
        return self._c._run(ops.checkpoint(self.id, self.epoch, weights_ref, meta))

    def fork(self, new_id: str | None = None) -> Episode:
        """Branch: a new episode (owned by the returned handle) whose log is this one's
        history and whose sandbox holds this one's files as they are now; its next
        ``exec`` is the step after this one's last."""
        child = Episode(self._c._run(ops.fork(self.id, self.epoch, new_id)), self._c)
        child._next = child.info.steps
        return child

    def refresh(self) -> EpisodeInfo:
        """Re-read the episode's server-side state (steps logged, current epoch, sandbox)."""
        return self._c._run(ops.info(self.id))

    def export(self) -> bytes:
        """The trajectory as zstd-compressed JSONL (``zstd -dc | jq`` readable)."""
        return self._c._run(ops.export(self.id))

    def close(self) -> None:
        """Destroy the sandbox; the checkpoints stay, so ``open`` with this id resumes."""
        self._c._run(ops.close(self.id, self.epoch))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
