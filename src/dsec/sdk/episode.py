"""``Episode``: a resumable agent episode whose steps are logged and checkpointed server-side.

    with dsec.Episode.open("ep-42", image="python", cpu=1) as ep:   # creates, or resumes
        r = ep.exec("python solve.py")        # step 0, 1, ... (fast-forwarded on resume)
        ep.save_context({"messages": msgs})
        ep.checkpoint(weights_ref="s3://bucket/ckpt/step-128", meta={"step": 128})

The agent loop simply runs again from the start after any crash: every ``exec`` whose
step is already logged returns the logged result without running (the command must
match, else ``errors.ReplayDiverged``), and the first new step runs live in a sandbox
restored to exactly the state after the last logged step.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from dsec.checkpoints.models import CheckpointRef, EpisodeInfo, StepResult
from dsec.models import ExecRequest, SandboxSpec
from dsec.sdk._client import Client
from dsec.sdk._core import Call

_EP = "/v1/episodes"


def _p(episode_id: str) -> str:
    return f"{_EP}/{quote(episode_id, safe='')}"


class Episode:
    def __init__(self, info: EpisodeInfo, client: Client) -> None:
        self.id = info.id
        self.info = info
        self._c = client
        self._next = 0

    @classmethod
    def open(cls, episode_id: str, image: str = "busybox", *, client: Client | None = None,
             **sandbox_args: Any) -> Episode:
        c = client or Client.default()
        spec = SandboxSpec(image=image, **sandbox_args)
        info = c._run(Call("POST", f"{_p(episode_id)}/open", lambda r: EpisodeInfo.model_validate_json(r.content),
                           json={"spec": spec.model_dump(mode="json", exclude_none=True)}, idempotent=True))
        return cls(info, c)

    @property
    def resumed(self) -> bool:
        return self.info.resumed

    @property
    def step(self) -> int:
        """Index the next ``exec`` will have."""
        return self._next

    def exec(self, cmd: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None) -> StepResult:
        req = ExecRequest(cmd=cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        # Idempotent by construction: a retried step N returns the logged result of step N.
        call = Call("POST", f"{_p(self.id)}/steps", lambda r: StepResult.model_validate_json(r.content),
                    json={"step": self._next, "request": req.model_dump(mode="json", exclude_none=True)},
                    idempotent=True, timeout=(timeout or 0) + self._c.config.timeout_s)
        res = self._c._run(call)
        self._next += 1
        return res

    def save_context(self, context: Any) -> CheckpointRef:
        return self._c._run(Call("PUT", f"{_p(self.id)}/context",
                                 lambda r: CheckpointRef.model_validate_json(r.content), json=context,
                                 idempotent=True))

    def context(self) -> Any:
        return self._c._run(Call("GET", f"{_p(self.id)}/context", lambda r: r.json(), idempotent=True))

    def checkpoint(self, weights_ref: str | None = None, meta: dict[str, Any] | None = None) -> CheckpointRef:
        return self._c._run(Call("POST", f"{_p(self.id)}/checkpoint",
                                 lambda r: CheckpointRef.model_validate_json(r.content),
                                 json={"weights_ref": weights_ref, "meta": meta or {}}, idempotent=True))

    def export(self) -> bytes:
        """The trajectory as zstd-compressed JSONL (``zstd -dc | jq`` readable)."""
        return self._c._run(Call("GET", f"{_p(self.id)}/export", lambda r: r.content, idempotent=True))

    def close(self) -> None:
        """Destroy the sandbox; the checkpoints stay, so ``open`` with this id resumes."""
        self._c._run(Call("DELETE", _p(self.id), lambda r: None, idempotent=True))

    def __enter__(self) -> Episode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

