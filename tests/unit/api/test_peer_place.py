"""The leader's peer placement route (POST /peer/v1/place, issue 13): only a server holding
the deployment's peer secret may hand it a placement; bad input is a 4xx naming what was
wrong; a server that is not the leader answers 503 not_leader (the follower retries)."""

from __future__ import annotations

from pathlib import Path

import httpx
from api_env import make_settings

from dsec.api.app import create_app
from dsec.api.server import attach_election
from dsec.api.services import Services
from dsec.control.driver import SchedulerDriver
from dsec.control.leader import PEER_HEADER, PLACE_PATH, peer_secret
from dsec.control.scheduler import Scheduler
from dsec.state.sqlite import SqliteStateStore
from dsec.testing import FakeNodeAgent


async def test_peer_place_auth_input_and_leadership(tmp_path: Path) -> None:
    """No or a wrong peer secret: 403 and nothing placed; an invalid body: 422; the leader
    places under the given sandbox id (201); once deposed: 503 not_leader, nothing made."""
    settings = make_settings(tmp_path, state_url=f"sqlite://{tmp_path}/state.db", batch_window_s=0.01)
    node = FakeNodeAgent(settings, node_id="n0", isolation=("container",))
    state = SqliteStateStore(tmp_path / "state.db")
    services = Services.build(settings, node, state)
    await state.open()
    services.attach_scheduler(SchedulerDriver(Scheduler(settings, pools=False), {"n0": node}, settings))
    attach_election(services)  # SQLite: solo, the leader from its start
    await services.start()
    app = create_app(services, manage_lifecycle=False)
    body = {"spec": {"image": "busybox", "cpu": 0.5, "memory": "256M"}, "sandbox_id": "sb-peer1", "tenant": "t1"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsec") as c:
            r = await c.post(PLACE_PATH, json=body)
            assert r.status_code == 403 and PEER_HEADER in r.json()["message"]
            r = await c.post(PLACE_PATH, json=body, headers={PEER_HEADER: "guess"})
            assert r.status_code == 403
            secret = await peer_secret(state)
            r = await c.post(PLACE_PATH, json={**body, "sandbox_id": ""}, headers={PEER_HEADER: secret})
            assert r.status_code == 422 and r.json()["code"] == "invalid_argument"
            r = await c.post(PLACE_PATH, json=body, headers={PEER_HEADER: secret})
            assert r.status_code == 201 and r.json()["id"] == "sb-peer1" and "sb-peer1" in node.sandboxes
            services.scheduler.leader.token = None  # deposed
            r = await c.post(PLACE_PATH, json={**body, "sandbox_id": "sb-peer2"}, headers={PEER_HEADER: secret})
            assert r.status_code == 503 and r.json()["code"] == "not_leader" and "retry-after" in r.headers
            assert "sb-peer2" not in node.sandboxes
    finally:
        await services.close()
        await state.close()
