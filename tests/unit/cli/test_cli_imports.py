"""The CLI answers at once: its import path stays free of heavy modules, and every
sub-command is registered lazily (``dsec.cli.main.COMMANDS``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsec.cli.main import COMMANDS, app, load_command

# Never on the path of a client command: plotting/numerics, the simulator, the demo, the
# server side, and the SDK's own stack (pydantic, httpx: ~0.3 s of imports together).
HEAVY = ("matplotlib", "numpy", "dsec.sim", "dsec.cli.demo", "fastapi", "uvicorn", "starlette", "pyroute2",
         "dsec.api", "dsec.node", "dsec.net", "dsec.control", "dsec.images", "pydantic", "pydantic_settings",
         "httpx", "aiohttp", "urllib3", "dsec.sdk", "boto3", "redis")

PROBE = """
import json, sys
heavy = json.loads(sys.argv[2])
sys.argv = ["dsec", *json.loads(sys.argv[1])]
from dsec.cli.main import app
try:
    app()
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))),
      file=sys.__stderr__)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loaded_heavy(args: list[str], tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    # Nothing listens there: the command takes its error path, which must be light too.
    env.update(DSEC_HOME=str(tmp_path), DSEC_URL=f"http://127.0.0.1:{_free_port()}")
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), json.dumps(HEAVY)], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    return json.loads(r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["ps"], ["ps", "--json"], ["run", "busybox", "--", "true"],
                                  ["exec", "sb-x", "--", "true"], ["kill", "sb-x"], ["logs", "sb-x"],
                                  ["network", "sb-x"], ["run", "--help"]])
def test_client_commands_import_nothing_heavy(args: list[str], tmp_path: Path) -> None:
    """`dsec --help` and the hot client commands (ps/run/exec/kill/logs/network) must not
    import matplotlib, numpy, the simulator, the demo, the server or the SDK stack: each
    of those costs tens to hundreds of ms before the command does anything."""
    assert _loaded_heavy(args, tmp_path) == []


def test_help_lists_every_command_without_importing_it(tmp_path: Path) -> None:
    """`dsec --help` names every registered command with its one-line help, and imports no
    command module to do so."""
    probe = ("import sys; sys.argv=['dsec','--help']\nfrom dsec.cli.main import app\ntry: app()\n"
             "except SystemExit: pass\nprint(sorted(m for m in sys.modules if m.startswith('dsec.cli.') "
             "and m not in ('dsec.cli.main',)), file=sys.__stderr__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    for name, (_, helptext) in COMMANDS.items():
        assert name in r.stdout and helptext.split()[0] in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_registered_command_loads(name: str) -> None:
    """Each COMMANDS entry imports and yields a command of that name (a typo in a lazy
    entry would otherwise only show when a user runs it)."""
    cmd = load_command(name)
    assert cmd.name == name


def test_bad_number_is_a_usage_error_not_a_traceback() -> None:
    """The direct str/int/float conversion (which replaces typer's pydantic path) still
    rejects a bad value with a usage error naming the option."""
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["run", "busybox", "--cpu", "abc", "--", "true"])
    assert r.exit_code == 2 and "--cpu" in r.output and "'abc' is not a valid float" in r.output
