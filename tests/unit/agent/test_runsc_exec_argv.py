"""The gVisor exec command lines (pure): timeouts round up and are never 0 (= no timeout
in `dsec-init run`), and a running exec can be signalled by its sandbox-internal PID."""

from __future__ import annotations

import pytest

from dsec.errors import InvalidArgument
from dsec.runtime.oci_runtime import make_runtime
from dsec.runtime.runsc_exec import run_argv


@pytest.mark.parametrize("timeout, ms", [(0.0009, "1"), (0.0001, "1"), (0.0011, "2"), (1.0, "1000"), (2.5, "2500")])
def test_timeouts_round_up_never_to_zero(timeout: float, ms: str) -> None:
    """Issue 18 #9: timeout=0.0009 used to become --timeout-ms 0, which means no timeout."""
    argv = run_argv(timeout, "/work", ["sleep", "5"])
    assert argv[argv.index("--timeout-ms") + 1] == ms
    assert argv[-3:] == ["--", "sleep", "5"]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_timeouts_are_refused(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="timeout"):
        run_argv(bad, "/", ["true"])


def test_exec_and_kill_argv(tmp_path) -> None:
    """runsc exec writes the command's internal pid; runsc kill --pid signals exactly it."""
    rt = make_runtime("gvisor", "runc", "runsc", "ptrace", tmp_path)
    ex = rt.exec_argv("sb-1", ["/.dsec/init"], {"A": "1"}, "/", extra=["--internal-pid-file", "/x/p"])
    assert ex[ex.index("exec"):] == ["exec", "--cwd", "/", "--internal-pid-file", "/x/p", "--env", "A=1", "sb-1",
                                     "/.dsec/init"]
    kill = rt.kill_argv("sb-1", 7, "TERM")
    assert kill[kill.index("kill"):] == ["kill", "--pid", "7", "sb-1", "TERM"]
    assert kill[:3] == ["runsc", "--root", str(tmp_path / "runsc")]
