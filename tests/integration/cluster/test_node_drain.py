"""`dsec node drain` / `undrain` on a real local 2-node Ray cluster with real runc
sandboxes, through `dsec serve --cluster` (the package's shared cluster): a drained node
takes no new sandboxes and keeps its running ones; `--migrate` checkpoints them there
and restores them on the other node under the same id with their files; `undrain` makes
it placeable again; an unknown node is a clear error."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")


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
