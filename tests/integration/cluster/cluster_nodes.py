"""Helpers of the package's shared 2-node cluster (the ``two_nodes`` fixture in conftest.py):
kill a node's raylet, restart the node, read its control-plane row."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


def raylet_pid(node_pid: int, temp_dir: str) -> int:
    """The raylet among the processes of one node's `ray start --block` session."""
    from dsec.cluster.local import _group

    for pid in _group(node_pid, temp_dir):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if argv0.endswith(b"/raylet"):
            return pid
    raise AssertionError(f"no raylet under node session {node_pid}")


def node_row(http: httpx.Client, nid: str) -> dict[str, Any]:
    r = http.get("/v1/nodes")
    assert r.status_code == 200, r.text
    return next(n for n in r.json() if n["id"] == nid)  # type: ignore[no-any-return]


@dataclass
class TwoNodes:
    c: Any  # dsec.cluster.local.LocalCluster
    base: Path
    srv: Any  # dsec.api.launch.ServeProcess
    tag: str  # the cluster's cgroup parents are dsec-<tag>-<node>

    def http(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.srv.url, headers={"authorization": f"Bearer {self.srv.token}"},
                            timeout=timeout)

    def env(self) -> dict[str, str]:
        return {**os.environ, "DSEC_URL": self.srv.url, "DSEC_TOKEN": self.srv.token}

    def cgroups(self, node: str, sandbox_id: str) -> list[Path]:
        return list(Path("/sys/fs/cgroup").glob(f"*/dsec-{self.tag}-{node}/{sandbox_id}"))

    def kill_raylet(self, node: str) -> float:
        """SIGKILL the raylet of ``node`` (a process this fixture started); returns the time."""
        n = next(x for x in self.c.nodes if x.node_id == node)
        pid = raylet_pid(n.pid, self.c.temp_dir)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return t0

    def restart(self, http: httpx.Client, node: str, timeout: float = 180) -> dict[str, Any]:
        """Run the node's `ray start` again (it exited with its raylet); wait until the
        control plane has it ready again; returns its /v1/nodes row."""
        from dsec.cluster import local

        n = next(x for x in self.c.nodes if x.node_id == node)
        end = time.monotonic() + 30
        while local._alive(n.pid) and time.monotonic() < end:
            time.sleep(0.2)
        p = local._start_node(self.c, n, None, [])
        n.pid = p.pid
        local._write_state(self.base.resolve(), self.c)
        end = time.monotonic() + timeout
        while (row := node_row(http, node))["state"] != "ready":
            assert time.monotonic() < end, f"{node} did not come back: {row}; its ray start: {local._log_tail(p)}"
            if p.poll() is not None:  # `ray start` gave up ("timed out during startup" on a loaded box): again
                for pid in local._group(p.pid, self.c.temp_dir):  # what that attempt left (ours)
                    os.kill(pid, signal.SIGKILL)
                p = local._start_node(self.c, n, None, [])
                n.pid = p.pid
                local._write_state(self.base.resolve(), self.c)
            time.sleep(1)
        return row
