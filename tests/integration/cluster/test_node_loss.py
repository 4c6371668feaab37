"""Node loss on a real local 2-node Ray cluster with real runc sandboxes, through
`dsec serve --cluster`: kill -9 of one node's raylet (a process this test started) is
detected by the control plane's heartbeats within 10 s; that node's sandboxes answer 410
`node_lost` at once (never a hang); new creates go to the surviving node; when the node
comes back (its `ray start` run again) it destroys the sandbox the control plane gave up
and is ready again, leaving no cgroup of it behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")


def _raylet_pid(node_pid: int, temp_dir: str) -> int:
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


def _node(http: httpx.Client, nid: str) -> dict:  # type: ignore[type-arg]
    r = http.get("/v1/nodes")
    assert r.status_code == 200, r.text
    return next(n for n in r.json() if n["id"] == nid)


def test_raylet_kill_is_lost_within_10s_then_reconciled(tmp_path: Path) -> None:
    """kill -9 n1's raylet: GET /v1/nodes shows n1 lost within 10 s (detection time
    printed); its sandbox answers 410 node_lost within 2 s for get, exec and files; a new
    create lands on n0; n1 restarted rejoins, destroys the given-up sandbox (listed in
    `reconciled`, its cgroup gone) and is ready again. A second n1 sandbox that was
    checkpointed runs again on n0 under its id with its files. Times are printed (FIGURES)."""
    from test_cluster_e2e import SHAPE

    from dsec.api.launch import start_serve
    from dsec.cluster import local

    base = tmp_path / "c"
    c = local.up(base, 2, ["busybox"], log=lambda _m: None)
    tag = c.address.rpartition(":")[2]
    srv = None
    try:
        # The box's own load (other work on a shared 2-core machine) must not refuse the
        # creates this test places: the measured-load guard is not what it checks.
        srv = start_serve(tmp_path / "api", {"DSEC_CLUSTER": c.address, **local.shared_env(c),
                                             "DSEC_OVERCOMMIT_THRESHOLD": "100"}, timeout=240)
        with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {srv.token}"}, timeout=60) as http:
            made: list[dict] = []  # type: ignore[type-arg]
            while len([m for m in made if m.get("node") == "n1"]) < 2:
                assert len(made) < 10, made
                made.append(http.post("/v1/sandboxes", json=SHAPE).json())
            on_n1 = [m for m in made if m.get("node") == "n1"]
            assert all(m.get("node") in ("n0", "n1") for m in made), made
            victim, saved = on_n1[0], on_n1[1]  # saved has a checkpoint: restored on n0 after the loss
            assert http.put(f"/v1/sandboxes/{saved['id']}/files", params={"path": "/work/state"},
                            content=b"step 7").status_code == 204
            assert http.post(f"/v1/sandboxes/{saved['id']}/checkpoints").status_code == 201
            assert http.post(f"/v1/sandboxes/{victim['id']}/exec", json={"cmd": "true"}).status_code == 200
            assert _node(http, "n1")["state"] == "ready"
            assert list(Path("/sys/fs/cgroup").glob(f"*/dsec-{tag}-n1/{victim['id']}"))

            n1 = c.nodes[1]
            t0 = time.monotonic()
            os.kill(_raylet_pid(n1.pid, c.temp_dir), signal.SIGKILL)
            while (row := _node(http, "n1"))["state"] != "lost":
                assert time.monotonic() - t0 < 10, f"n1 not lost within 10 s: {row}"
                time.sleep(0.1)
            detected = time.monotonic() - t0

            for method, path, body in (("GET", f"/v1/sandboxes/{victim['id']}", None),
                                       ("POST", f"/v1/sandboxes/{victim['id']}/exec", {"cmd": "true"}),
                                       ("GET", f"/v1/sandboxes/{victim['id']}/files", None)):
                t1 = time.monotonic()
                r = http.request(method, path, json=body, params={"path": "/tmp"} if "files" in path else None)
                took = time.monotonic() - t1
                assert r.status_code == 410 and r.json()["code"] == "node_lost", (path, r.text)
                assert "node lost" in r.json()["message"] and took < 2, (path, took)
            fresh = http.post("/v1/sandboxes", json=SHAPE)
            assert fresh.status_code == 201 and fresh.json()["node"] == "n0", fresh.text
            # The checkpointed one runs again on n0 under its id, with the checkpoint's files.
            while (got := http.get(f"/v1/sandboxes/{saved['id']}")).status_code != 200:
                assert got.status_code == 410 and time.monotonic() - t0 < 60, got.text
                time.sleep(0.1)
            restored = time.monotonic() - t0
            assert got.json()["node"] == "n0", got.text
            r = http.post(f"/v1/sandboxes/{saved['id']}/exec", json={"cmd": "cat /work/state"})
            assert r.status_code == 200 and r.json()["stdout"] == "step 7", r.text
            assert _node(http, "n1")["restored"] == {saved["id"]: "n0"}
            print("FIGURES", json.dumps({"raylet_kill_to_lost_s": round(detected, 2),
                                         "heartbeat_gap_at_loss_s": row["lost_detect_s"],
                                         "raylet_kill_to_checkpointed_sandbox_running_on_n0_s": round(restored, 2)}))

            # The node comes back: its `ray start` exited with its raylet; run it again.
            end = time.monotonic() + 30
            while local._alive(n1.pid) and time.monotonic() < end:
                time.sleep(0.2)
            p = local._start_node(c, n1, None, [])
            n1.pid = p.pid
            local._write_state(base.resolve(), c)
            end = time.monotonic() + 180
            while (row := _node(http, "n1"))["state"] != "ready":
                assert time.monotonic() < end, f"n1 did not come back: {row}"
                time.sleep(1)
            # Every sandbox n1 held when it was lost was given up, and destroyed on its return.
            assert {m["id"] for m in on_n1} <= set(row["reconciled"]), row
            for m in on_n1:
                assert not list(Path("/sys/fs/cgroup").glob(f"*/dsec-{tag}-n1/{m['id']}")), m
                if m is saved:  # its restored copy on n0 is untouched by n1's reconcile
                    assert http.get(f"/v1/sandboxes/{m['id']}").json()["node"] == "n0"
                    continue
                got = http.get(f"/v1/sandboxes/{m['id']}")  # gone, or the node's record of a destroyed one
                assert got.status_code in (404, 410) or got.json()["state"] in ("stopped", "destroyed"), got.text
            for m in [*made, fresh.json()]:
                if m not in on_n1 or m is saved:
                    assert http.delete(f"/v1/sandboxes/{m['id']}").status_code == 204
    finally:
        if srv is not None:
            srv.proc.terminate()
            srv.proc.wait(60)
        local.down(base, log=lambda _m: None)
