"""The exec/health fast path answers exactly what the FastAPI routes answer."""

from __future__ import annotations

from pathlib import Path

import httpx
from api_env import make_env

from dsec.api.app import create_app
from dsec.api.hotpath import HotPath


async def test_hot_path_matches_fastapi_routes(tmp_path: Path) -> None:
    """Same status, error code and named fields for good and bad exec requests, with and
    without the fast path (so a fuzzer or an SDK cannot tell them apart)."""
    env = await make_env(tmp_path)
    try:
        ref = create_app(env.services, manage_lifecycle=False, hot_path=False)
        sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
        dead = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
        await env.alice.delete(f"/v1/sandboxes/{dead['id']}")
        tok = {"authorization": f"Bearer {env.alice_token}"}
        cases = [
            (tok, sb["id"], {"json": {"cmd": "echo hi"}}),
            (tok, sb["id"], {"json": {"cmd": ["echo", "a b"], "env": {"X": "1"}, "timeout": 5}}),
            ({}, sb["id"], {"json": {"cmd": "echo hi"}}),
            ({"authorization": "Bearer nope"}, sb["id"], {"json": {"cmd": "echo hi"}}),
            ({"authorization": "Basic x"}, sb["id"], {"json": {"cmd": "echo hi"}}),
            (tok, "bad$id", {"json": {"cmd": "echo hi"}}),
            (tok, "sb-unknown", {"json": {"cmd": "echo hi"}}),
            (tok, dead["id"], {"json": {"cmd": "echo hi"}}),
            (tok, sb["id"], {"json": {}}),
            (tok, sb["id"], {"json": {"cmd": 5}}),
            (tok, sb["id"], {"json": {"cmd": "x", "bogus": 1}}),
            (tok, sb["id"], {"json": {"cmd": "x", "timeout": -1}}),
            (tok, sb["id"], {"content": b"not json", "headers": {"content-type": "application/json"}}),
        ]
        fast_t, ref_t = env.alice._transport, httpx.ASGITransport(app=ref)
        statuses = []
        for headers, sid, kw in cases:
            answers = []
            extra = kw.pop("headers", {})
            for transport in (fast_t, ref_t):
                async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
                    r = await c.post(f"/v1/sandboxes/{sid}/exec", headers={**headers, **extra}, **kw)
                body = r.json()
                fields = sorted(f["field"] for f in body.get("details", {}).get("fields", []))
                answers.append((r.status_code, body.get("code"), fields,
                                body.get("stdout"), body.get("exit_code")))
            assert answers[0] == answers[1], (headers, sid, kw, answers)
            statuses.append(answers[0][0])
        assert statuses == [200, 200, 401, 401, 401, 422, 404, 404, 422, 422, 422, 422, 422]
        for transport in (fast_t, ref_t):
            async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
                h = (await c.get("/health")).json()
            assert set(h) == {"status", "version", "node", "uptime_s"} and h["status"] == "ok"
    finally:
        await env.services.close()


async def test_exec_slots_never_block_behind_a_long_command(tmp_path: Path) -> None:
    """With one exec slot, a command that runs long frees its slot after the hold time, so a
    short exec behind it finishes first instead of waiting for it."""
    import asyncio

    env = await make_env(tmp_path, api_exec_slots=1, api_exec_slot_hold_s=0.05)
    try:
        sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
        gate = asyncio.Event()
        real_exec = env.node.exec

        async def exec_(sandbox_id, req):  # type: ignore[no-untyped-def]
            if req.cmd == "long":
                await gate.wait()
            return await real_exec(sandbox_id, req)

        env.node.exec = exec_  # type: ignore[method-assign]
        long = asyncio.create_task(env.alice.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "long"}))
        await asyncio.sleep(0.01)
        short = await asyncio.wait_for(env.alice.post(f"/v1/sandboxes/{sb['id']}/exec",
                                                      json={"cmd": "echo hi"}), 5)
        assert short.status_code == 200 and not long.done()
        gate.set()
        assert (await long).status_code == 200
    finally:
        await env.services.close()


async def test_exec_runs_in_the_requests_own_task(tmp_path: Path) -> None:
    """The exec slot does not run the exec in a task of its own (issue 15: that task and
    its waiter cost a trivial exec extra loop passes); cancelling the request still stops
    the exec, and the slot is free again afterwards."""
    import asyncio

    env = await make_env(tmp_path, api_exec_slots=1)
    try:
        sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
        real_exec = env.node.exec
        tasks: list[object] = []
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def exec_(sandbox_id, req):  # type: ignore[no-untyped-def]
            tasks.append(asyncio.current_task())
            if req.cmd == "hang":
                started.set()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
            return await real_exec(sandbox_id, req)

        env.node.exec = exec_  # type: ignore[method-assign]
        hot = next(m for m in _layers(env.services) if isinstance(m, HotPath))
        res = await hot._slotted(env.node.exec(sb["id"], _req("echo hi")))
        assert res.exit_code == 0 and tasks == [asyncio.current_task()]
        hang = asyncio.create_task(hot._slotted(env.node.exec(sb["id"], _req("hang"))))
        await asyncio.wait_for(started.wait(), 5)
        hang.cancel()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert (await asyncio.wait_for(hot._slotted(env.node.exec(sb["id"], _req("echo hi"))), 5)).exit_code == 0
    finally:
        await env.services.close()


def _req(cmd: str):  # type: ignore[no-untyped-def]
    from dsec.models import ExecRequest
    return ExecRequest(cmd=cmd)


def _layers(services):  # type: ignore[no-untyped-def]
    app = create_app(services, manage_lifecycle=False)
    layer = app.front  # type: ignore[attr-defined]
    while layer is not None:
        yield layer
        layer = getattr(layer, "app", None)


async def test_hot_path_unexpected_error_is_500_json(tmp_path: Path) -> None:
    """A bug below the fast path answers like the app's catch-all: 500 JSON, code internal."""
    env = await make_env(tmp_path)
    try:
        ref = create_app(env.services, manage_lifecycle=False, hot_path=False)
        sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()

        async def broken(sandbox_id, req):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

        env.node.exec = broken  # type: ignore[method-assign]
        tok = {"authorization": f"Bearer {env.alice_token}"}
        answers = []
        for transport in (env.alice._transport, httpx.ASGITransport(app=ref, raise_app_exceptions=False)):
            async with httpx.AsyncClient(transport=transport, base_url="http://dsec", headers=tok) as c:
                r = await c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "x"})
            answers.append((r.status_code, r.json()))
        assert answers[0] == answers[1] and answers[0][0] == 500 and answers[0][1]["code"] == "internal"
    finally:
        await env.services.close()


async def test_hot_path_create_matches_fastapi_route(tmp_path: Path) -> None:
    """``POST /v1/sandboxes`` on the fast path (issue 15: a warm hand-over's budget is a
    few ms) answers exactly what the FastAPI route answers: status, error code, named
    fields, and the created sandbox's fields."""
    env = await make_env(tmp_path)
    try:
        ref = create_app(env.services, manage_lifecycle=False, hot_path=False)
        tok = {"authorization": f"Bearer {env.alice_token}"}
        cases = [
            (tok, {"json": {"image": "busybox", "cpu": 1, "labels": {"run": "r1"}}}),
            ({}, {"json": {"image": "busybox"}}),
            ({"authorization": "Bearer nope"}, {"json": {"image": "busybox"}}),
            (tok, {"json": {"image": "busybox", "cpu": -1}}),
            (tok, {"json": {"image": "busybox", "bogus": 1}}),
            (tok, {"json": {}}),
            (tok, {"json": {"image": "no-such-image"}}),
            (tok, {"content": b"not json", "headers": {"content-type": "application/json"}}),
        ]
        fast_t, ref_t = env.alice._transport, httpx.ASGITransport(app=ref)
        statuses = []
        for headers, kw in cases:
            answers = []
            extra = kw.pop("headers", {})
            for transport in (fast_t, ref_t):
                async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
                    r = await c.post("/v1/sandboxes", headers={**headers, **extra}, **kw)
                body = r.json()
                if r.status_code == 201:  # room for the next case
                    await env.alice.delete(f"/v1/sandboxes/{body['id']}")
                fields = sorted(f["field"] for f in body.get("details", {}).get("fields", []))
                answers.append((r.status_code, body.get("code"), fields, body.get("image"), body.get("labels"),
                                sorted(body) if r.status_code == 201 else None))
            assert answers[0] == answers[1], (headers, kw, answers)
            statuses.append(answers[0][0])
        assert statuses == [201, 401, 401, 422, 422, statuses[5], 404, 422]
    finally:
        await env.services.close()


async def test_hot_path_kill_matches_fastapi_route(tmp_path: Path) -> None:
    """``DELETE /v1/sandboxes/{id}`` on the fast path (issue 15: every short episode ends
    with one) answers exactly what the FastAPI route answers: 204 with no body, 401, 422
    for a malformed id, 404 for an unknown one or another tenant's; and it does kill."""
    env = await make_env(tmp_path)
    try:
        ref = create_app(env.services, manage_lifecycle=False, hot_path=False)
        tok = {"authorization": f"Bearer {env.alice_token}"}
        fast_t, ref_t = env.alice._transport, httpx.ASGITransport(app=ref)
        statuses = []
        for transport in (fast_t, ref_t):
            sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
            bobs = (await env.bob.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
            answers = []
            async with httpx.AsyncClient(transport=transport, base_url="http://dsec") as c:
                for headers, sid in (({}, sb["id"]), ({"authorization": "Bearer nope"}, sb["id"]),
                                     (tok, "bad$id"), (tok, "sb-unknown"), (tok, bobs["id"]), (tok, sb["id"])):
                    r = await c.delete(f"/v1/sandboxes/{sid}", headers=headers)
                    body = r.json() if r.content else None
                    answers.append((r.status_code, body and body.get("code"), r.content == b""))
            assert (await env.alice.get(f"/v1/sandboxes/{sb['id']}")).status_code == 404  # it is gone
            assert (await env.bob.get(f"/v1/sandboxes/{bobs['id']}")).status_code == 200  # bob's is not
            statuses.append(answers)
        assert statuses[0] == statuses[1], statuses
        assert [a[0] for a in statuses[0]] == [401, 401, 422, 404, 404, 204] and statuses[0][-1][2]

        async def not_fastapi(scope: object, receive: object, send: object) -> None:
            raise AssertionError("the kill went through the FastAPI stack")

        sb = (await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1})).json()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=HotPath(not_fastapi, env.services)),
                                     base_url="http://dsec") as c:
            assert (await c.delete(f"/v1/sandboxes/{sb['id']}", headers=tok)).status_code == 204
    finally:
        await env.services.close()
