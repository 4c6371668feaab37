"""descendants(): the teardown's PID sweep and the cluster bench's CPU split rely on it
finding every process below a root, grandchildren included, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys

from dsec.node.proctree import descendants


def test_finds_children_and_grandchildren_only() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time; "
                              "p=subprocess.Popen(['sleep','30']); print(p.pid, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        mine = descendants([os.getpid()])
        assert {os.getpid(), child.pid, grandchild} <= set(mine)
        assert descendants([child.pid]) == sorted([child.pid, grandchild])
        assert 1 not in mine and os.getppid() not in mine
    finally:
        if grandchild:
            os.kill(grandchild, 9)
        child.kill()
        child.wait()
