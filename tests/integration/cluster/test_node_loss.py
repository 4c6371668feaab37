"""Node loss on a real local 2-node Ray cluster with real runc sandboxes, through
`dsec serve --cluster`: kill -9 of one node's raylet (a process this test started) is
detected by the control plane's heartbeats within 10 s; that node's sandboxes answer 410
`node_lost` at once (never a hang); new creates go to the surviving node; when the node
comes back (its `ray start` run again) it destroys the sandbox the control plane gave up
and is ready again, leaving no cgroup of it behind. An episode on the killed node is
resumed on the other node and ends with the trajectory of a fault-free run. Both tests
run on the package's shared cluster (tests/integration/cluster/conftest.py)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from cluster_nodes import node_row as _node

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")


def test_raylet_kill_is_lost_within_10s_then_reconciled(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """kill -9 n1's raylet: GET /v1/nodes shows n1 lost within 10 s (detection time
    printed); its sandbox answers 410 node_lost within 2 s for get, exec and files; a new
    create lands on n0; n1 restarted rejoins, destroys the given-up sandbox (listed in
    `reconciled`, its cgroup gone) and is ready again. A second n1 sandbox that was
    checkpointed runs again on n0 under its id with its files. Times are printed (FIGURES)."""
    from test_cluster_e2e import SHAPE

    with two_nodes.http(timeout=60) as http:
        # Two sandboxes on n1: n0 is drained while they are made (warm members left on n0 by
        # earlier tests of the shared cluster would otherwise take every create).
        assert http.post("/v1/nodes/n0/drain", json={}).status_code == 200
        try:
            made: list[dict] = [http.post("/v1/sandboxes", json=SHAPE).json() for _ in range(2)]  # type: ignore[type-arg]
        finally:
            assert http.post("/v1/nodes/n0/undrain").status_code == 200
        on_n1 = [m for m in made if m.get("node") == "n1"]
        assert len(on_n1) == 2, made
        victim, saved = on_n1[0], on_n1[1]  # saved has a checkpoint: restored on n0 after the loss
        assert http.put(f"/v1/sandboxes/{saved['id']}/files", params={"path": "/work/state"},
                        content=b"step 7").status_code == 204
        assert http.post(f"/v1/sandboxes/{saved['id']}/checkpoints").status_code == 201
        assert http.post(f"/v1/sandboxes/{victim['id']}/exec", json={"cmd": "true"}).status_code == 200
        assert _node(http, "n1")["state"] == "ready"
        assert two_nodes.cgroups("n1", victim["id"])

        t0 = two_nodes.kill_raylet("n1")
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
        row = two_nodes.restart(http, "n1")
        # Every sandbox n1 held when it was lost was given up, and destroyed on its return.
        assert {m["id"] for m in on_n1} <= set(row["reconciled"]), row
        for m in on_n1:
            assert not two_nodes.cgroups("n1", m["id"]), m
            if m is saved:  # its restored copy on n0 is untouched by n1's reconcile
                assert http.get(f"/v1/sandboxes/{m['id']}").json()["node"] == "n0"
                continue
            got = http.get(f"/v1/sandboxes/{m['id']}")  # gone, or the node's record of a destroyed one
            assert got.status_code in (404, 410) or got.json()["state"] in ("stopped", "destroyed"), got.text
        for m in [*made, fresh.json()]:
            if m not in on_n1 or m is saved:
                assert http.delete(f"/v1/sandboxes/{m['id']}").status_code == 204


# Every step appends to a counter file and prints the count: a step executed twice would
# show in its own output and in every later one (and in the fs digests).
_STEPS = [f"echo {i} >> /work/count && wc -l < /work/count && echo s{i} > /work/f{i}" for i in range(3)] + \
    ["sleep 1.5 && echo 3 >> /work/count && wc -l < /work/count"] + \
    [f"echo {i} >> /work/count && wc -l < /work/count && cat /work/f{i - 4}" for i in range(4, 6)]


def _step(http: Any, ep: str, epoch: int, i: int) -> dict[str, Any]:
    r = http.post(f"/v1/episodes/{ep}/steps", json={"step": i, "request": {"cmd": _STEPS[i]}},
                  headers={"x-dsec-episode-epoch": str(epoch)})
    assert r.status_code == 200, (i, r.text)
    return r.json()  # type: ignore[no-any-return]


def _trajectory(http: Any, ep: str) -> list[tuple[Any, ...]]:
    from dsec.checkpoints.trajectory import iter_lines

    r = http.get(f"/v1/episodes/{ep}/export")
    assert r.status_code == 200, r.text
    recs = [json.loads(line) for line in iter_lines(r.content)]  # one zstd frame per record
    return [(x["step"], x["command"], x["exit_code"], x["stdout"], x["fs_digest"]) for x in recs]


def test_episode_on_a_killed_node_resumes_elsewhere_with_the_same_trajectory(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """An episode placed on n1 runs 3 steps; its 4th step is in flight when n1's raylet is
    killed (-9). The client's call still answers 200: the control plane resumes the episode
    on n0 through the scheduler (restore from its last unit) and runs the step there once.
    Two more steps follow. The exported trajectory (command, exit code, stdout, fs digest
    per step) equals a fault-free run of the same steps in this test, and the counter
    file shows no step ran twice. n1 restarted: it destroys the episode's old sandbox
    (`reconciled`, cgroup gone) and is ready. Kill -> running again on n0 is printed."""
    spec = {"image": "busybox", "cpu": 0.5, "memory": "128M", "disk": "256M"}
    with two_nodes.http() as http:
        # Fault-free run of the same steps.
        base = http.post("/v1/episodes/ep-base/open", json={"spec": spec})
        assert base.status_code == 200, base.text
        for i in range(len(_STEPS)):
            _step(http, "ep-base", base.json()["epoch"], i)
        want = _trajectory(http, "ep-base")
        assert [x[3] for x in want][:4] == ["1\n", "2\n", "3\n", "4\n"], want
        assert http.delete("/v1/episodes/ep-base", headers={"x-dsec-episode-epoch": str(base.json()["epoch"])}
                           ).status_code == 204

        # The same episode placed on n1 (n0 drained while it is opened).
        assert http.post("/v1/nodes/n0/drain", json={}).status_code == 200
        try:
            opened = http.post("/v1/episodes/ep-kill/open", json={"spec": spec})
        finally:
            assert http.post("/v1/nodes/n0/undrain").status_code == 200
        assert opened.status_code == 200, opened.text
        epoch, old_sb = opened.json()["epoch"], opened.json()["sandbox_id"]
        assert http.get(f"/v1/sandboxes/{old_sb}").json()["node"] == "n1"
        for i in range(3):
            _step(http, "ep-kill", epoch, i)

        got: dict[str, Any] = {}
        t = threading.Thread(target=lambda: got.update(res=_step(http, "ep-kill", epoch, 3), at=time.monotonic()))
        t.start()
        time.sleep(0.5)  # step 3 runs (sleep 1.5) on n1
        t0 = two_nodes.kill_raylet("n1")
        t.join(90)
        assert "res" in got, "step 3 did not answer within 90 s of the kill"
        answered = got["at"] - t0
        # Its live run on n0 started `duration + checkpoint_s` before it answered.
        running_again = answered - got["res"]["duration"] - got["res"]["checkpoint_s"]
        for i in range(4, len(_STEPS)):
            _step(http, "ep-kill", epoch, i)
        info = http.get("/v1/episodes/ep-kill").json()
        assert info["steps"] == len(_STEPS) and info["sandbox_id"] != old_sb, info
        assert http.get(f"/v1/sandboxes/{info['sandbox_id']}").json()["node"] == "n0"
        assert _trajectory(http, "ep-kill") == want
        assert _node(http, "n1")["state"] == "lost"
        print("FIGURES", json.dumps({"raylet_kill_to_episode_running_on_n0_s": round(running_again, 2),
                                     "raylet_kill_to_inflight_step_answered_s": round(answered, 2)}))
        assert running_again <= 15, running_again

        row = two_nodes.restart(http, "n1")
        assert old_sb in row["reconciled"], row
        assert not two_nodes.cgroups("n1", old_sb)
        assert http.delete("/v1/episodes/ep-kill", headers={"x-dsec-episode-epoch": str(epoch)}).status_code == 204
        assert not two_nodes.cgroups("n0", info["sandbox_id"])
