"""mini-swe-agent environment backed by a DSec sandbox.

Select it by class path in the agent's YAML, like the package's own environments::

    environment:
      environment_class: dsec.integrations.mini_swe_agent.DSecEnvironment
      image: python          # a DSec image (bash is needed for the default interpreter)
      cwd: /work
      env: {PAGER: cat}
      timeout: 60            # seconds per command

The contract is the one of ``minisweagent.environments.docker.DockerEnvironment``:
``execute({"command": ...})`` returns ``{"output", "returncode", "exception_info"}`` with
stderr merged into stdout in order; a command past its timeout gives returncode -1 and
the exception text; output whose first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
(with returncode 0) raises ``Submitted`` carrying the rest as the submission. The sandbox
is killed by ``cleanup()``, when the environment is garbage-collected, or at interpreter
exit. The server comes from ``url``/``token`` or the usual ``DSEC_URL``/``DSEC_TOKEN`` /
``DSEC_HOME/server.json``.
"""

from __future__ import annotations

import logging
import os
import platform
import weakref
from typing import Any

from pydantic import BaseModel

from dsec.errors import DSecError
from dsec.sdk import Client, Sandbox

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class DSecEnvironmentConfig(BaseModel):
    image: str = "python"
    cwd: str = "/"
    """Working directory in which to execute commands."""
    env: dict[str, str] = {}
    """Environment variables set for every command."""
    forward_env: list[str] = []
    """Host environment variables forwarded when set (``env`` wins on conflict)."""
    timeout: int = 30
    """Timeout of one command, seconds."""
    interpreter: list[str] = ["bash", "-lc"]
    """The command is appended to this argv (as in DockerEnvironment)."""
    # DSec-specific: where and how big
    url: str | None = None
    token: str | None = None
    cpu: float | None = None
    memory: str | None = None
    isolation: str | None = None
    network: list[str] | None = None
    sandbox_timeout: float = 7200
    """TTL of the sandbox itself (DockerEnvironment's container_timeout)."""
    labels: dict[str, str] = {}


def _kill(client: Client, sandbox_id: str, own_client: bool) -> None:
    try:
        client.kill(sandbox_id)
    except Exception as e:  # noqa: BLE001 - already gone, or the server is down at exit
        logging.getLogger("minisweagent.environment").debug("kill of %s: %s", sandbox_id, e)
    if own_client:
        client.close()


class DSecEnvironment:
    def __init__(self, *, config_class: type = DSecEnvironmentConfig, logger: logging.Logger | None = None,
                 client: Client | None = None, **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        c = self.config
        own = client is None
        self._client = client or Client(c.url, c.token)
        spec: dict[str, Any] = {k: v for k, v in (("cpu", c.cpu), ("memory", c.memory), ("isolation", c.isolation),
                                                  ("network", c.network)) if v is not None}
        self.sandbox = Sandbox.create(image=c.image, client=self._client, timeout=c.sandbox_timeout,
                                      labels={"integration": "mini-swe-agent", **c.labels}, **spec)
        self.logger.info("started DSec sandbox %s (image %s)", self.sandbox.id, c.image)
        self._finalizer = weakref.finalize(self, _kill, self._client, self.sandbox.id, own)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; the result dict as DockerEnvironment's."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        limit = timeout or self.config.timeout
        # One pipe for both streams, so their order is kept (docker exec with stderr=STDOUT).
        argv = ["/bin/sh", "-c", 'exec "$0" "$@" 2>&1', *self.config.interpreter, command]
        try:
            res = self.sandbox.exec(argv, timeout=limit, cwd=cwd, env=env or None)
            if res.timed_out:
                output = {"output": res.stdout, "returncode": -1,
                          "exception_info": f"An error occurred while executing the command: Command "
                                            f"'{command}' timed out after {limit} seconds",
                          "extra": {"exception_type": "TimeoutExpired",
                                    "exception": f"timed out after {limit} seconds"}}
            else:
                output = {"output": res.stdout, "returncode": res.exit_code, "exception_info": ""}
        except DSecError as e:
            output = {"output": "", "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {e.message}",
                      "extra": {"exception_type": type(e).__name__, "exception": e.message}}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        from minisweagent.exceptions import Submitted

        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge

        return recursive_merge(self.config.model_dump(exclude={"token"}), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json", exclude={"token"}),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}

    def cleanup(self) -> None:
        """Kill the sandbox (idempotent)."""
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()

    def __del__(self) -> None:
        self.cleanup()
