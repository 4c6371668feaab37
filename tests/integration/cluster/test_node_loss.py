"""Node states on a real local 2-node Ray cluster with real runc sandboxes, through
`dsec serve --cluster`, one cluster and server for the module (tests/integration/cluster/
conftest.py; a cluster start costs ~30 s). Drain: a drained node takes no new sandboxes
and keeps its running ones; `--migrate` checkpoints them there and restores them on the
other node under the same id with their files; `undrain` makes it placeable again; an
unknown node is a clear error. Loss:
kill -9 of one node's raylet (a process this test started) is detected by the control
plane's heartbeats within 10 s; that node's sandboxes answer 410 `node_lost` at once
(never a hang); new creates go to the surviving node; a checkpointed sandbox and an
episode of the lost node run again on the other node (the episode's trajectory equals a
fault-free run: nothing executed twice); when the node comes back (its `ray start` run
again) it destroys what the control plane gave up and is ready again, leaving no cgroup
of it behind. One kill for all of it: a node restart costs tens of seconds. The drain
test runs first and leaves both nodes ready."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import pytest
from cluster_nodes import node_row as _node

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")

# Every step appends to a counter file and prints the count: a step executed twice would
# show in its own output and in every later one (and in the fs digests). Step 3 is the
# one in flight when the node dies.
_STEPS = [f"echo {i} >> /work/count && wc -l < /work/count && echo s{i} > /work/f{i}" for i in range(3)] + \
    ["sleep 1.5 && echo 3 >> /work/count && wc -l < /work/count"] + \
    [f"echo {i} >> /work/count && wc -l < /work/count && cat /work/f{i - 4}" for i in range(4, 6)]
_EP_SPEC = {"image": "busybox", "cpu": 0.5, "memory": "128M", "disk": "256M"}
_POOL_SPEC = {"image": "busybox", "cpu": 0.25, "memory": "64M", "disk": "64M"}  # a shape of its own


def _pool_ready(http: Any, shape: dict[str, Any]) -> int:
    pools = http.get("/v1/pools").json()["pools"]
    return sum(p["ready"] for p in pools if all(p[k] == v for k, v in shape.items()))


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


def _close(http: Any, ep: str, epoch: int) -> None:
    assert http.delete(f"/v1/episodes/{ep}", headers={"x-dsec-episode-epoch": str(epoch)}).status_code == 204


def test_drain_then_migrate_then_undrain(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """drain n1 (HTTP): state draining, its sandbox still answers, 3 new creates all on
    n0. `dsec node drain n1 --migrate --json`: the sandbox is moved to n0 under the same
    id and its file reads back; nothing of it is left on n1. `dsec node drain n9`: non-zero
    exit naming n9. `dsec node undrain n1 --json`: draining -> ready, and a create lands on
    n1 again while n0 is drained (then undrained too)."""
    from test_cluster_e2e import DSEC, SHAPE

    env = two_nodes.env()
    with two_nodes.http() as http:
        made = [http.post("/v1/sandboxes", json=SHAPE).json() for _ in range(4)]
        on_n1 = [m for m in made if m.get("node") == "n1"]
        assert on_n1, made
        sb = on_n1[0]
        assert http.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/work/state"},
                        content=b"step 7").status_code == 204

        r = http.post("/v1/nodes/n1/drain", json={})
        assert r.status_code == 200 and (r.json()["previous"], r.json()["state"]) == ("ready", "draining"), r.text
        assert [n["state"] for n in http.get("/v1/nodes").json()] == ["ready", "draining"]
        assert http.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "cat /work/state"}).json()["stdout"] \
            == "step 7"
        fresh = [http.post("/v1/sandboxes", json=SHAPE).json() for _ in range(3)]
        assert [f.get("node") for f in fresh] == ["n0"] * 3, fresh

        p = subprocess.run([DSEC, "node", "drain", "n1", "--migrate", "--json"], capture_output=True,
                           text=True, env=env, timeout=600, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        res = json.loads(p.stdout)
        assert {m["sandbox_id"] for m in res["migrated"]} == {m["id"] for m in on_n1}, res
        assert all(m["to_node"] == "n0" for m in res["migrated"]) and res["failed"] == {}, res
        got = http.get(f"/v1/sandboxes/{sb['id']}")
        assert got.status_code == 200 and got.json()["node"] == "n0", got.text
        assert http.get(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/work/state"}).content == b"step 7"
        assert not two_nodes.cgroups("n1", sb["id"])

        bad = subprocess.run([DSEC, "node", "drain", "n9"], capture_output=True, text=True, env=env,
                             timeout=120, check=False)
        assert bad.returncode != 0 and "n9" in bad.stdout + bad.stderr, bad.stdout + bad.stderr

        p = subprocess.run([DSEC, "node", "undrain", "n1", "--json"], capture_output=True, text=True, env=env,
                           timeout=120, check=False)
        assert p.returncode == 0, p.stdout + p.stderr
        assert (json.loads(p.stdout)["previous"], json.loads(p.stdout)["state"]) == ("draining", "ready"), p.stdout
        assert http.post("/v1/nodes/n0/drain", json={}).status_code == 200  # only n1 can take the next one
        back = http.post("/v1/sandboxes", json=SHAPE)
        assert back.status_code == 201 and back.json()["node"] == "n1", back.text
        assert http.post("/v1/nodes/n0/undrain").json()["state"] == "ready"
        assert [n["state"] for n in http.get("/v1/nodes").json()] == ["ready", "ready"]
        for m in [*made, *fresh, back.json()]:
            assert http.delete(f"/v1/sandboxes/{m['id']}").status_code == 204


def test_raylet_kill_is_lost_within_10s_resumed_elsewhere_then_reconciled(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """On n1: a plain sandbox, a checkpointed one, and an episode that ran 3 steps. kill -9
    n1's raylet while the episode's 4th step runs there: GET /v1/nodes shows n1 lost within
    10 s; the plain sandbox answers 410 node_lost within 2 s for get, exec and files; a new
    create lands on n0; the checkpointed sandbox runs again on n0 under its id with its
    files; the episode's in-flight call still answers 200 (resumed on n0 through the
    scheduler, the step run there once), two more steps follow, and its exported
    trajectory (command, exit code, stdout, fs digest per step) equals a fault-free run of
    the same steps; a warm pool (floor 2) whose members were all on n1 is full again on n0
    within 30 s (its full plan runs every 30 s: the loss itself triggers the rebuild). n1 restarted rejoins, destroys everything it held (listed in
    `reconciled`, cgroups gone) and is ready again. Times are printed (FIGURES)."""
    from test_cluster_e2e import SHAPE

    with two_nodes.http(timeout=120) as http:
        # The fault-free run of the episode's steps.
        base = http.post("/v1/episodes/ep-base/open", json={"spec": _EP_SPEC})
        assert base.status_code == 200, base.text
        for i in range(len(_STEPS)):
            _step(http, "ep-base", base.json()["epoch"], i)
        want = _trajectory(http, "ep-base")
        assert [x[3] for x in want] == ["1\n", "2\n", "3\n", "4\n", "5\ns0\n", "6\ns1\n"], want
        _close(http, "ep-base", base.json()["epoch"])

        # Two sandboxes and the episode on n1: n0 is drained while they are made (warm
        # members left on n0 by earlier tests of the shared cluster would take the creates).
        # A warm pool floor of 2 of its own shape is built there too.
        assert http.post("/v1/nodes/n0/drain", json={}).status_code == 200
        try:
            made: list[dict] = [http.post("/v1/sandboxes", json=SHAPE).json() for _ in range(2)]  # type: ignore[type-arg]
            opened = http.post("/v1/episodes/ep-kill/open", json={"spec": _EP_SPEC})
            r = http.put("/v1/pools", json={"spec": _POOL_SPEC, "size": 2})
            assert r.status_code == 200, r.text
            (mine,) = r.json()["pools"]
            shape = {k: mine[k] for k in ("image", "isolation", "cpu", "memory", "disk", "network")}
            end = time.monotonic() + 90
            while _pool_ready(http, shape) < 2:
                assert time.monotonic() < end, http.get("/v1/pools").text
                time.sleep(0.2)
        finally:
            assert http.post("/v1/nodes/n0/undrain").status_code == 200
        assert [m.get("node") for m in made] == ["n1", "n1"], made
        assert opened.status_code == 200, opened.text
        epoch, ep_sb = opened.json()["epoch"], opened.json()["sandbox_id"]
        assert http.get(f"/v1/sandboxes/{ep_sb}").json()["node"] == "n1"
        victim, saved = made  # saved has a checkpoint: restored on n0 after the loss
        assert http.put(f"/v1/sandboxes/{saved['id']}/files", params={"path": "/work/state"},
                        content=b"step 7").status_code == 204
        assert http.post(f"/v1/sandboxes/{saved['id']}/checkpoints").status_code == 201
        assert http.post(f"/v1/sandboxes/{victim['id']}/exec", json={"cmd": "true"}).status_code == 200
        for i in range(3):
            _step(http, "ep-kill", epoch, i)
        assert _node(http, "n1")["state"] == "ready"
        assert two_nodes.cgroups("n1", victim["id"]) and two_nodes.cgroups("n1", ep_sb)

        got_step: dict[str, Any] = {}

        def in_flight() -> None:
            with two_nodes.http(timeout=120) as h:
                got_step.update(res=_step(h, "ep-kill", epoch, 3), at=time.monotonic())

        stepper = threading.Thread(target=in_flight)
        stepper.start()
        time.sleep(0.5)  # step 3 runs (sleep 1.5) on n1
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
        # Until it runs: any cluster-wide listing (a create's quota check does one) may show
        # it on n0 while the restore is still "creating" there (exec then answers 409).
        while (got := http.get(f"/v1/sandboxes/{saved['id']}")).status_code != 200 \
                or got.json()["state"] == "creating":
            assert got.status_code in (200, 410) and time.monotonic() - t0 < 60, got.text
            time.sleep(0.1)
        restored = time.monotonic() - t0
        assert got.json()["node"] == "n0", got.text
        r = http.post(f"/v1/sandboxes/{saved['id']}/exec", json={"cmd": "cat /work/state"})
        assert r.status_code == 200 and r.json()["stdout"] == "step 7", r.text
        assert _node(http, "n1")["restored"] == {saved["id"]: "n0"}
        # The pool's members died with n1: rebuilt on n0 (the only node left) at once.
        while _pool_ready(http, shape) < 2:
            assert time.monotonic() - t0 < 30, http.get("/v1/pools").text
            time.sleep(0.2)
        pool_back = time.monotonic() - t0

        # The episode: its in-flight step answered from n0, the rest follows there.
        stepper.join(90)
        assert "res" in got_step, "the in-flight step did not answer within 90 s of the kill"
        answered = got_step["at"] - t0
        # Its live run on n0 started `duration + checkpoint_s` before it answered.
        running_again = answered - got_step["res"]["duration"] - got_step["res"]["checkpoint_s"]
        for i in range(4, len(_STEPS)):
            _step(http, "ep-kill", epoch, i)
        info = http.get("/v1/episodes/ep-kill").json()
        assert info["steps"] == len(_STEPS) and info["sandbox_id"] != ep_sb, info
        assert http.get(f"/v1/sandboxes/{info['sandbox_id']}").json()["node"] == "n0"
        assert _trajectory(http, "ep-kill") == want
        print("FIGURES", json.dumps({"raylet_kill_to_lost_s": round(detected, 2),
                                     "heartbeat_gap_at_loss_s": row["lost_detect_s"],
                                     "raylet_kill_to_checkpointed_sandbox_running_on_n0_s": round(restored, 2),
                                     "raylet_kill_to_episode_running_on_n0_s": round(running_again, 2),
                                     "raylet_kill_to_inflight_step_answered_s": round(answered, 2),
                                     "raylet_kill_to_warm_pool_full_again_s": round(pool_back, 2)}))
        assert running_again <= 15, running_again

        # The node comes back: its `ray start` exited with its raylet; run it again.
        row = two_nodes.restart(http, "n1")
        # Every sandbox n1 held when it was lost was given up, and destroyed on its return.
        assert {victim["id"], saved["id"], ep_sb} <= set(row["reconciled"]), row
        for sid in (victim["id"], saved["id"], ep_sb):
            assert not two_nodes.cgroups("n1", sid), sid
        assert http.get(f"/v1/sandboxes/{saved['id']}").json()["node"] == "n0"  # untouched by n1's reconcile
        got = http.get(f"/v1/sandboxes/{victim['id']}")  # gone, or the node's record of a destroyed one
        assert got.status_code in (404, 410) or got.json()["state"] in ("stopped", "destroyed"), got.text
        _close(http, "ep-kill", epoch)
        assert not two_nodes.cgroups("n0", info["sandbox_id"])
        for m in (saved, fresh.json()):
            assert http.delete(f"/v1/sandboxes/{m['id']}").status_code == 204
        assert http.put("/v1/pools", json={"spec": _POOL_SPEC, "size": 0}).status_code == 200
