"""``wait_gone`` (teardown waits for a sandbox init to exit) in a process with many fds."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from dsec.runtime.oci_runtime import wait_gone


def test_wait_gone_works_with_fds_above_1024() -> None:
    """Density (issue 15): a server holding 1,000 sandboxes has more than 1,024 fds open,
    and ``select()`` refused the pidfd ("filedescriptor out of range"), so destroying any
    sandbox failed. The wait must work for any fd number: it times out while the process
    lives and returns once it exits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        while not held or held[-1] < 1100:  # the pidfd opened next is numbered above FD_SETSIZE
            held.append(os.open(os.devnull, os.O_RDONLY))
        assert wait_gone(child.pid, 0.05) is False  # alive: the timeout, not an error
        assert child.stdin is not None
        child.stdin.close()  # the child exits
        assert wait_gone(child.pid, 10.0) is True
    finally:
        for fd in held:
            os.close(fd)
        child.kill()
        child.wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
