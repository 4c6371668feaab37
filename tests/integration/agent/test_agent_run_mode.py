"""One-shot mode (`dsec-init run ...`, the runsc / `runc exec` path): exit codes, tree-kill on
timeout (exit 124 + stderr marker) and on cancellation by signal."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TREE = "sleep 1000 & echo $!; setsid sleep 1000 & echo $!; echo ready; wait"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "\nState:\tZ" not in fh.read()
    except FileNotFoundError:
        return False


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(binary), "run", *args], check=False, capture_output=True, timeout=30)


def test_exit_code_and_stdio_pass_through(agent_binary: Path, tmp_path: Path) -> None:
    """stdout/stderr go straight through, the exit code is the command's, cwd is applied."""
    r = _run(agent_binary, "--cwd", str(tmp_path), "--", "sh", "-c", "pwd; echo e >&2; exit 9")
    assert (r.returncode, r.stdout, r.stderr) == (9, f"{tmp_path}\n".encode(), b"e\n")
    r = subprocess.run([str(agent_binary), "run", "--", "cat"], check=False, input=b"abc", capture_output=True,
                       timeout=30)
    assert r.stdout == b"abc"


def test_exec_failures_and_usage_errors(agent_binary: Path) -> None:
    """127 for a missing program, 126 for a bad cwd, 125 for a bad invocation of run itself."""
    r = _run(agent_binary, "--", "no-such-prog-y")
    assert r.returncode == 127 and b"no-such-prog-y: command not found" in r.stderr
    assert _run(agent_binary, "--cwd", "/no/dir", "--", "true").returncode == 126
    assert _run(agent_binary, "--bogus").returncode == 125
    assert _run(agent_binary, "--timeout-ms", "x", "--", "true").returncode == 125


def test_timeout_kills_whole_tree_and_exits_124(agent_binary: Path) -> None:
    """On timeout the tree (including a setsid'd daemon) dies; exit 124 with a stderr marker."""
    r = _run(agent_binary, "--timeout-ms", "500", "--", "sh", "-c", TREE)
    pids = [int(x) for x in r.stdout.split() if x.isdigit()]
    assert r.returncode == 124 and len(pids) == 2
    assert b"dsec-init: timeout: command exceeded 500 ms; process tree killed" in r.stderr
    assert [p for p in pids if _alive(p)] == []


def test_sigterm_cancels_and_kills_tree(agent_binary: Path) -> None:
    """SIGTERM to the run process (the caller cancels) kills the tree and exits 128+15."""
    proc = subprocess.Popen([str(agent_binary), "run", "--", "sh", "-c", TREE], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    pids = [int(x) for x in lines[:2]]
    assert lines[2] == b"ready\n" and all(_alive(p) for p in pids)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(10) == 128 + 15
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p for p in pids if _alive(p)] == []
    proc.stdout.close()


def test_commands_get_default_signal_dispositions(agent_binary: Path) -> None:
    """Signals ignored by whoever launched dsec-init are not ignored in the command."""
    def ignore_some() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    cmd = [str(agent_binary), "run", "--", "grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status"]
    control = subprocess.run(cmd[3:], preexec_fn=ignore_some, capture_output=True, check=True)
    assert b"SigIgn:\t0000000000000003" in control.stdout  # the launcher really ignores HUP+INT
    r = subprocess.run(cmd, preexec_fn=ignore_some, capture_output=True, check=True)
    assert r.stdout == b"SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"
