"""A DSec node that joins the Ray cluster after `dsec serve --cluster` started is picked
up by itself: its agent is started, the router and the scheduler know it, and its images
become placeable (an image only the new node holds lands there)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")


def test_node_joining_later_is_picked_up(tmp_path: Path) -> None:
    """Before n1 joins, an image only n1 will hold is unknown (404); after `add_node`,
    within a few membership passes, sandboxes of that image are created on n1."""
    from test_cluster_e2e import SHAPE, _import_only_on

    from dsec.api.launch import start_serve
    from dsec.cluster import local

    base = tmp_path / "c"
    c = local.up(base, 1, ["busybox"], log=lambda _m: None)
    srv = None
    try:
        srv = start_serve(tmp_path / "api", {"DSEC_CLUSTER": c.address, **local.shared_env(c),
                                             "DSEC_CLUSTER_MEMBERSHIP_INTERVAL_S": "1"}, timeout=240)
        (tmp_path / "img").mkdir()
        with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {srv.token}"}, timeout=120) as http:
            assert http.post("/v1/sandboxes", json={**SHAPE, "image": "onlyb"}).status_code == 404
            _import_only_on(base / "n1", tmp_path / "img", "onlyb")  # n1's store, before it starts
            local.add_node(base, ["busybox"], log=lambda _m: None)
            deadline = time.monotonic() + 60
            while True:
                r = http.post("/v1/sandboxes", json={**SHAPE, "image": "onlyb"})
                if r.status_code == 201:
                    break
                assert r.status_code == 404 and time.monotonic() < deadline, r.text
                time.sleep(1)
            assert r.json()["node"] == "n1"
            assert http.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204
    finally:
        if srv is not None:
            srv.proc.terminate()
            srv.proc.wait(60)
        local.down(base, log=lambda _m: None)
