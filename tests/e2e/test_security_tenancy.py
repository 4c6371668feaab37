"""Issue 18 #1 and #7 against a real ``dsec serve`` (runc sandboxes): tenant-scoped data is
keyed by the tenant's immutable uid, never by a string built from user-chosen names."""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import pytest
import zstandard
from e2e_server import Server

pytestmark = pytest.mark.integration

SPEC = {"image": "busybox", "cpu": 0.25, "memory": "64M"}


def _client(server: Server, token: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=120)


@pytest.fixture
def admin(server: Server) -> Iterator[httpx.Client]:
    with _client(server, server.token) as c:
        yield c


def _add_tenant(admin: httpx.Client, name: str) -> str:
    r = admin.post("/v1/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def _remove_tenant(admin: httpx.Client, name: str) -> None:
    r = admin.delete(f"/v1/tenants/{name}")
    assert r.status_code in (204, 404), r.text


def _open(c: httpx.Client, episode_id: str) -> dict:
    r = c.post(f"/v1/episodes/{episode_id}/open", json={"spec": SPEC})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _step(c: httpx.Client, episode_id: str, epoch: int, n: int, cmd: str) -> httpx.Response:
    return c.post(f"/v1/episodes/{episode_id}/steps", json={"step": n, "request": {"cmd": cmd}},
                  headers={"x-dsec-episode-epoch": str(epoch)})


def _trajectory(data: bytes) -> str:
    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read().decode()


def test_episode_ids_do_not_cross_tenants(server: Server, admin: httpx.Client) -> None:
    """Tenant ``epi`` opening episode ``x--e1`` must not land on tenant ``epi--x``'s episode
    ``e1`` (the old ``<tenant>--<id>`` key made both ``epi--x--e1``): it gets its own empty
    episode and sandbox; it cannot read the victim's info, context or trajectory, nor run
    steps in the victim's sandbox; and a diverging replay never echoes a logged command."""
    victim_tok, attacker_tok = _add_tenant(admin, "epi--x"), _add_tenant(admin, "epi")
    secret = "echo victim-secret-7f3a > /victim.txt"
    try:
        with _client(server, victim_tok) as victim, _client(server, attacker_tok) as attacker:
            v = _open(victim, "e1")
            r = _step(victim, "e1", v["epoch"], 0, secret)
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            assert victim.put("/v1/episodes/e1/context", json={"plan": "victim-context"}).status_code == 200

            a = _open(attacker, "x--e1")
            assert a["steps"] == 0 and not a["resumed"], a
            assert a["sandbox_id"] != v["sandbox_id"]
            assert attacker.get("/v1/episodes/x--e1").json()["steps"] == 0
            assert attacker.get("/v1/episodes/x--e1/context").json() is None
            # Step 0 with another command: on the shared key this was a ReplayDiverged naming
            # the victim's command; now it runs live in the attacker's own sandbox.
            r = _step(attacker, "x--e1", a["epoch"], 0, "cat /victim.txt; echo attacker-ran")
            assert r.status_code == 200, r.text
            assert "victim-secret" not in r.text and "attacker-ran" in r.json()["stdout"]
            assert r.json()["exit_code"] == 0 and "No such file" in r.json()["stderr"]
            exported = attacker.get("/v1/episodes/x--e1/export")
            assert exported.status_code == 200 and "victim-secret" not in _trajectory(exported.content)

            # The victim's episode is untouched: one step, its file, its context.
            assert victim.get("/v1/episodes/e1").json()["steps"] == 1
            assert victim.get("/v1/episodes/e1/context").json() == {"plan": "victim-context"}
            assert "victim-secret" in _trajectory(victim.get("/v1/episodes/e1/export").content)
            # Even its owner's diverging replay names only a digest, never the logged command.
            r = _step(victim, "e1", v["epoch"], 0, "echo something-else")
            assert r.status_code == 409 and r.json()["code"] == "replay_diverged", r.text
            assert "victim-secret" not in r.text and "something-else" in r.text

            for c, ep in ((attacker, "x--e1"), (victim, "e1")):
                info = c.get(f"/v1/episodes/{ep}").json()
                assert c.delete(f"/v1/episodes/{ep}", headers={"x-dsec-episode-epoch": str(info["epoch"])}
                                ).status_code == 204
    finally:
        _remove_tenant(admin, "epi")
        _remove_tenant(admin, "epi--x")


def test_recreated_tenant_inherits_nothing(server: Server, admin: httpx.Client) -> None:
    """A tenant removed and created again under the same name sees none of its
    predecessor's data: checkpoints (listed, fetched, restored), audit logs (with argv),
    request-id status, idempotent-create replays, episodes; and the old checkpoint and
    episode units are deleted from the store, not only hidden."""
    name = "reborn"
    tok = _add_tenant(admin, name)
    try:
        with _client(server, tok) as old:
            r = old.post("/v1/sandboxes", json={**SPEC, "request_id": "rq-reborn-1"})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            r = old.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo topsecret-argv > /f"})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            ck = old.post(f"/v1/sandboxes/{sid}/checkpoints")
            assert ck.status_code == 201, ck.text
            ck_id = ck.json()["id"]
            assert old.get("/v1/requests/rq-reborn-1").status_code == 200
            ep = _open(old, "ep-reborn")
            assert _step(old, "ep-reborn", ep["epoch"], 0, "echo old-episode-step").status_code == 200
            assert "topsecret-argv" in old.get(f"/v1/sandboxes/{sid}/audit").text
        store = server.home / "checkpoints" / "episodes"
        assert any(store.glob(f"sbckpt.*.{ck_id[3:]}"))

        _remove_tenant(admin, name)
        tok2 = _add_tenant(admin, name)
        with _client(server, tok2) as new:
            assert new.get("/v1/checkpoints").json() == []
            assert new.get(f"/v1/checkpoints/{ck_id}").status_code == 404
            r = new.post(f"/v1/checkpoints/{ck_id}/restore", json={})
            assert r.status_code == 404, r.text
            r = new.get(f"/v1/sandboxes/{sid}/audit")
            assert r.status_code == 404 and "topsecret" not in r.text
            assert new.get("/v1/requests/rq-reborn-1").status_code == 404
            assert new.get(f"/v1/sandboxes/{sid}").status_code == 404
            # The same request id creates a NEW sandbox (not a replay of the old one's answer).
            r = new.post("/v1/sandboxes", json={**SPEC, "request_id": "rq-reborn-1"})
            assert r.status_code == 201, r.text
            assert r.json()["id"] != sid and r.json()["state"] != "destroyed"
            assert new.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204
            info = _open(new, "ep-reborn")
            assert info["steps"] == 0 and not info["resumed"], info
            assert "old-episode-step" not in _trajectory(new.get("/v1/episodes/ep-reborn/export").content)
            assert new.delete("/v1/episodes/ep-reborn",
                              headers={"x-dsec-episode-epoch": str(info["epoch"])}).status_code == 204
        # Deleted, not merely unreachable: no unit of the old checkpoint or episode is left.
        assert not any(store.glob(f"sbckpt.*.{ck_id[3:]}/units/*"))
        # Only the new tenant's episode has units left (the old one's were deleted with it).
        assert len([p for p in store.glob("*--ep-reborn") if any(p.glob("units/*"))]) == 1
    finally:
        _remove_tenant(admin, name)

