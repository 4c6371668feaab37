"""Checkpoint routes on a node that cannot checkpoint, and the SDK's checkpoint requests."""

from __future__ import annotations

from pathlib import Path

from api_env import make_env

from dsec.sdk import _ops


async def test_checkpoint_routes_without_checkpoint_support(tmp_path: Path) -> None:
    """A node without a sandbox manager (no overlay upper dirs) answers 422 saying why, and
    tenancy still comes first (no token: 401)."""
    env = await make_env(tmp_path)
    try:
        sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
        r = await env.alice.post(f"/v1/sandboxes/{sb['id']}/checkpoints")
        assert r.status_code == 422 and "cannot checkpoint" in r.json()["message"]
        r = await env.anon.post(f"/v1/sandboxes/{sb['id']}/checkpoints")
        assert r.status_code == 401
        r = await env.alice.post("/v1/checkpoints/ck-0123456789abcdef01234567/restore", json={"labels": 5})
        assert r.status_code == 422 and r.json()["details"]["fields"][0]["field"] == "labels"
    finally:
        await env.services.close()


def test_restore_is_idempotent_checkpoint_is_not() -> None:
    """A restore always carries a request id (safe to resend); a checkpoint is never resent."""
    a, b = _ops.restore("ck-1"), _ops.restore("ck-1")
    assert a.idempotent and a.json["request_id"] != b.json["request_id"]
    assert _ops.restore("ck-1", request_id="r1", labels={"k": "v"}).json == {"request_id": "r1", "labels": {"k": "v"}}
    assert not _ops.checkpoint("sb-1").idempotent
    assert _ops.checkpoint("sb/1").path == "/v1/sandboxes/sb%2F1/checkpoints"
