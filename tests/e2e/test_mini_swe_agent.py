"""mini-swe-agent end to end on a real server: the package's own ``mini`` CLI, its builtin
mini.yaml, its deterministic test model (no LLM), and ``environment_class:
dsec.integrations.mini_swe_agent.DSecEnvironment`` selected in the YAML by class path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from e2e_server import Server, running_server

from dsec.sdk import Client

pytestmark = pytest.mark.integration
pytest.importorskip("minisweagent")

MINI = str(Path(sys.executable).parent / "mini")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "mswea-home", images=["busybox", "python"]) as srv:
        yield srv


def _step(command: str) -> dict:
    return {"role": "assistant", "content": f"THOUGHT\n```mswea_bash_command\n{command}\n```",
            "extra": {"actions": [{"command": command}], "cost": 0.0}}


STEPS = [
    "echo $GREETING from $(pwd) > note.txt && cat note.txt && echo to-stderr >&2",
    "sleep 30",
    "exit 3",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat note.txt",
]


def test_mini_cli_with_dsec_environment(server: Server, tmp_path: Path) -> None:
    """The agent runs each action in one DSec sandbox with the YAML's image, cwd, env and
    timeout; output/returncode/timeout follow DockerEnvironment's contract; the submit
    sentinel ends the run with the submission; the sandbox is gone after the process exits."""
    cfg = {
        "agent": {"agent_class": "default", "cost_limit": 0, "step_limit": 10},
        "model": {"model_class": "minisweagent.models.test_models.DeterministicModel",
                  "model_name": "deterministic", "outputs": [_step(c) for c in STEPS]},
        "environment": {"environment_class": "dsec.integrations.mini_swe_agent.DSecEnvironment",
                        "image": "python", "cwd": "/work", "env": {"GREETING": "hello"}, "timeout": 2,
                        "url": server.url, "token": server.token},
    }
    cfg_file = tmp_path / "dsec.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    traj = tmp_path / "traj.json"
    env = {**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"), "NO_COLOR": "1"}
    r = subprocess.run([MINI, "-c", "mini.yaml", "-c", str(cfg_file), "-t", "write a note", "-y",
                        "--exit-immediately", "-o", str(traj)], env=env, capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(traj.read_text())
    info = data["info"]
    assert info["exit_status"] == "Submitted", info
    assert info["submission"] == "hello from /work\n"
    assert info["config"]["environment_type"] == "dsec.integrations.mini_swe_agent.DSecEnvironment"
    assert "token" not in info["config"]["environment"]  # the credential is not written to the trajectory
    observations = [m["content"] for m in data["messages"] if m["role"] == "user"][1:]
    observations = [o if isinstance(o, str) else json.dumps(o) for o in observations]
    # mini.yaml's observation template renders returncode and output as JSON
    assert '"returncode": 0' in observations[0]
    assert "hello from /work\\nto-stderr" in observations[0]  # stderr merged after stdout, in order
    assert '"returncode": -1' in observations[1] and "timed out" in observations[1]
    assert '"returncode": 3' in observations[2]
    with Client(server.url, server.token) as c:  # cleanup on exit: nothing left running
        assert [s.id for s in c.list({"integration": "mini-swe-agent"})] == []


def test_environment_class_directly(server: Server) -> None:
    """Used from Python (as the package's runners do): get_environment by class path,
    the Submitted exception on the sentinel, cleanup() kills the sandbox."""
    from minisweagent.environments import get_environment
    from minisweagent.exceptions import Submitted

    env = get_environment({"environment_class": "dsec.integrations.mini_swe_agent.DSecEnvironment",
                           "image": "busybox", "interpreter": ["sh", "-c"], "url": server.url,
                           "token": server.token, "timeout": 5})
    try:
        out = env.execute({"command": "echo a; echo b >&2; false"})
        assert out == {"output": "a\nb\n", "returncode": 1, "exception_info": ""}
        with pytest.raises(Submitted) as exc:
            env.execute({"command": "printf 'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\\ndone\\n'"})
        assert exc.value.messages[0]["extra"]["submission"] == "done\n"
        assert env.get_template_vars()["image"] == "busybox"
    finally:
        sid = env.sandbox.id
        env.cleanup()
    with Client(server.url, server.token) as c:
        assert sid not in [s.id for s in c.list()]
    assert shutil.which("true")  # host untouched: nothing ran here
