"""API behaviour over the real app (auth, tenancy, idempotency, errors, audit, metrics)."""

from __future__ import annotations

import json
from pathlib import Path

from api_env import Env, make_env


async def _create(c, **spec):  # type: ignore[no-untyped-def]
    r = await c.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1, **spec})
    assert r.status_code == 201, r.text
    return r.json()


async def test_missing_and_invalid_token_are_401(env: Env) -> None:
    """No token or a wrong token never reaches a sandbox; the body says what to do."""
    r = await env.anon.get("/v1/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert "DSEC_TOKEN" in r.json()["message"]
    r = await env.anon.get("/v1/sandboxes", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401
    r = await env.anon.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


async def test_other_tenants_sandbox_is_404(env: Env) -> None:
    """Tenants see and touch only their own sandboxes: another's looks like it does not exist."""
    sb = await _create(env.alice, labels={"run": "r1"})
    assert sb["tenant"] == "alice"
    for method, path, body in [("GET", f"/v1/sandboxes/{sb['id']}", None),
                               ("DELETE", f"/v1/sandboxes/{sb['id']}", None),
                               ("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": "echo hi"}),
                               ("GET", f"/v1/sandboxes/{sb['id']}/files?path=/a", None),
                               ("GET", f"/v1/sandboxes/{sb['id']}/audit", None)]:
        r = await env.bob.request(method, path, json=body)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["code"] == "not_found"
    assert (await env.bob.get("/v1/sandboxes")).json() == []
    r = await env.bob.post("/v1/sandboxes/kill", json={"labels": {"run": "r1"}})
    assert r.json() == {"killed": []}
    assert sb["id"] in env.node.sandboxes


async def test_idempotent_create_by_request_id(env: Env) -> None:
    """A retried create with the same request id returns the same sandbox, never a second one."""
    a = await _create(env.alice, request_id="req-1")
    b = await _create(env.alice, request_id="req-1")
    assert a["id"] == b["id"] and env.node.create_calls == 1
    c = await _create(env.bob, request_id="req-1")  # keys are per tenant
    assert c["id"] != a["id"]
    await env.alice.delete(f"/v1/sandboxes/{a['id']}")
    d = await _create(env.alice, request_id="req-1")  # replay after death: same answer, no new sandbox
    assert d["id"] == a["id"] and d["state"] == "destroyed" and env.node.create_calls == 2


async def test_schema_invalid_is_422_naming_field(env: Env) -> None:
    """Validation errors are 422 with the offending field named in message and details."""
    r = await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": -1})
    body = r.json()
    assert r.status_code == 422 and body["code"] == "invalid_argument"
    assert body["details"]["fields"][0]["field"] == "cpu" and "cpu" in body["message"]
    r = await env.alice.post("/v1/sandboxes", json={"image": "busybox", "memory": "lots"})
    assert r.status_code == 422 and "memory" in r.json()["message"]
    r = await env.alice.post("/v1/sandboxes", json={"image": "busybox", "bogus": 1})
    assert r.status_code == 422 and "bogus" in r.json()["message"]


async def test_reserved_labels_are_refused(env: Env) -> None:
    """A tenant cannot set ``dsec.`` labels, which the control plane acts on (``dsec.pool``
    marks a warm-pool member a restart handles as the server's, ``dsec.owner`` a lease):
    422 naming the label (every create path, E2B and Fusion included, goes through check_spec)."""
    for labels in ({"dsec.pool": "1"}, {"run": "r1", "dsec.owner": "other"}):
        r = await env.alice.post("/v1/sandboxes", json={"image": "busybox", "cpu": 1, "labels": labels})
        assert r.status_code == 422, r.text
        assert "reserved" in r.json()["message"] and r.json()["details"]["label"].startswith("dsec."), r.text
    assert env.node.create_calls == 0
    assert (await _create(env.alice, labels={"dsecx": "1", "team.dsec.x": "1"}))["labels"]["dsecx"] == "1"


def test_sources_bookkeeping_labels_are_not_inherited() -> None:
    """A clone or a restore is a new sandbox: the source's pool/lease labels stay behind
    (otherwise restoring a leased sandbox's checkpoint would be refused as reserved)."""
    from dsec.models.sandbox import without_reserved_labels

    assert without_reserved_labels({"run": "r1", "dsec.owner": "w1", "dsec.fusion": "pool"}) == {"run": "r1"}


async def test_unknown_image_404_names_it(env: Env) -> None:
    """Asking for an image that does not exist is 404 naming the image."""
    r = await env.alice.post("/v1/sandboxes", json={"image": "nosuch:1"})
    assert r.status_code == 404 and "nosuch:1" in r.json()["message"]


async def test_image_allow_list_is_enforced(env: Env) -> None:
    """A tenant restricted to busybox* cannot start python."""
    r = await env.bob.post("/v1/sandboxes", json={"image": "python"})
    assert r.status_code == 403 and "python" in r.json()["message"]


async def test_limits_name_the_limit(env: Env) -> None:
    """Above node or tenant limits: 422 (never fits) or 429 with Retry-After (fits later), limit named."""
    r = await env.alice.post("/v1/sandboxes", json={"cpu": 1000})
    assert r.status_code == 422 and "node limit" in r.json()["message"]
    r = await env.alice.post("/v1/sandboxes", json={"cpu": 7})
    assert r.status_code == 422 and "max_cpu" in r.json()["message"]
    await _create(env.alice)
    await _create(env.alice)
    r = await env.alice.post("/v1/sandboxes", json={"cpu": 1})
    assert r.status_code == 429 and "max_sandboxes" in r.json()["message"]
    assert int(r.headers["retry-after"]) >= 1


async def test_overload_is_429_with_retry_after(tmp_path: Path) -> None:
    """When too many creates are in flight the server sheds load with 429 + Retry-After."""
    e = await make_env(tmp_path, api_max_inflight_creates=0)
    r = await e.alice.post("/v1/sandboxes", json={})
    assert r.status_code == 429 and r.json()["code"] == "overloaded" and "retry-after" in r.headers
    await e.services.close()


async def test_oversized_upload_is_413(tmp_path: Path) -> None:
    """Uploads above Settings.max_upload_bytes are refused with 413 and nothing is written."""
    e = await make_env(tmp_path, max_upload_bytes=1024)
    sb = await _create(e.alice)
    r = await e.alice.put(f"/v1/sandboxes/{sb['id']}/files", params={"path": "/big"}, content=b"x" * 2048)
    assert r.status_code == 413 and "max_upload_bytes" in r.json()["message"]
    assert "/big" not in e.node.files[sb["id"]]
    await e.services.close()


async def test_exec_files_and_audit_survive_kill(env: Env) -> None:
    """Commands and file writes are audited, and the audit is readable after the sandbox dies."""
    sb = await _create(env.alice)
    sid = sb["id"]
    r = await env.alice.put(f"/v1/sandboxes/{sid}/files", params={"path": "/w/a.txt"}, content=b"hello")
    assert r.status_code == 204
    assert (await env.alice.get(f"/v1/sandboxes/{sid}/files", params={"path": "/w/a.txt"})).content == b"hello"
    r = await env.alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "exit 3"})
    assert r.json()["exit_code"] == 3
    assert (await env.alice.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    r = await env.alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo x"})
    assert r.status_code == 404
    log = (await env.alice.get(f"/v1/sandboxes/{sid}/audit")).json()
    kinds = [e["kind"] for e in log]
    assert kinds == ["create", "file_write", "exec", "kill", "exec_error"]  # failed attempts are audited too
    assert log[2]["data"]["argv"] == ["/bin/sh", "-c", "exit 3"] and log[2]["data"]["exit_code"] == 3
    assert log[1]["data"]["path"] == "/w/a.txt" and log[1]["data"]["size"] == 5
    # past retention the audit is pruned
    env.services.settings.audit_retention_s = 0
    assert await env.services.sandboxes.reconcile() == 1
    assert (await env.alice.get(f"/v1/sandboxes/{sid}/audit")).status_code == 404


async def test_reconcile_marks_vanished_sandboxes_dead(env: Env) -> None:
    """A sandbox that disappears behind the API's back (TTL reaper) is marked dead, audit kept."""
    sb = await _create(env.alice)
    del env.node.sandboxes[sb["id"]]
    await env.services.sandboxes.reconcile()
    assert sb["id"] not in await env.services.state.live_sandbox_ids()
    assert (await env.alice.get(f"/v1/sandboxes/{sb['id']}/audit")).status_code == 200


async def test_exec_stream_ndjson(env: Env) -> None:
    """Streaming exec sends NDJSON events ending with exactly one exit event."""
    sb = await _create(env.alice)
    r = await env.alice.post(f"/v1/sandboxes/{sb['id']}/exec/stream", json={"cmd": "echo streamed"})
    assert r.headers["content-type"].startswith("application/x-ndjson")
    events = [json.loads(x) for x in r.text.splitlines()]
    assert events[0] == {"kind": "stdout", "data": "streamed\n"}
    assert events[-1]["kind"] == "exit" and events[-1]["result"]["exit_code"] == 0
    r = await env.bob.post(f"/v1/sandboxes/{sb['id']}/exec/stream", json={"cmd": "echo x"})
    assert r.status_code == 404


async def test_sandbox_failure_maps_to_502_json(env: Env) -> None:
    """Errors raised below the API become {code, message, details} with their status."""
    sb = await _create(env.alice)
    r = await env.alice.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "fail"})
    assert r.status_code == 502 and r.json()["code"] == "sandbox_failure"
    r = await env.alice.get("/v1/nope")
    assert r.status_code == 404 and set(r.json()) == {"code", "message", "details"}


async def test_label_filter_and_bulk_kill(env: Env) -> None:
    """List filters by labels; bulk kill removes exactly the matching own sandboxes."""
    a = await _create(env.alice, labels={"run": "r1", "task": "t"})
    b = await _create(env.alice, labels={"run": "r2"})
    r = await env.alice.get("/v1/sandboxes", params=[("label", "run=r1")])
    assert [s["id"] for s in r.json()] == [a["id"]]
    assert (await env.alice.get("/v1/sandboxes", params=[("label", "bad")])).status_code == 422
    r = await env.alice.post("/v1/sandboxes/kill", json={"labels": {"run": "r1"}})
    assert r.json() == {"killed": [a["id"]]}
    assert list(env.node.sandboxes) == [b["id"]]
    assert (await env.alice.post("/v1/sandboxes/kill", json={"labels": {}})).status_code == 422


async def test_tenant_admin(env: Env) -> None:
    """Only admins manage tenants; a removed tenant's token stops working and its sandboxes die."""
    assert (await env.alice.post("/v1/tenants", json={"name": "eve"})).status_code == 403
    r = await env.admin.post("/v1/tenants", json={"name": "eve", "max_sandboxes": 1, "max_memory": "1G"})
    assert r.status_code == 201
    tok = r.json()["token"]
    assert r.json()["tenant"]["max_memory"] == 2**30
    assert (await env.admin.post("/v1/tenants", json={"name": "eve"})).status_code == 409
    assert (await env.admin.post("/v1/tenants", json={"name": "Bad Name"})).status_code == 422
    eve = {"authorization": f"Bearer {tok}"}
    assert (await env.anon.get("/v1/tenants/me", headers=eve)).json()["name"] == "eve"
    sb = (await env.anon.post("/v1/sandboxes", json={"memory": "512M"}, headers=eve)).json()
    names = [t["name"] for t in (await env.admin.get("/v1/tenants")).json()]
    assert names == ["admin", "alice", "bob", "eve"] and "token_hash" not in str(names)
    assert (await env.admin.delete("/v1/tenants/eve")).status_code == 204
    assert sb["id"] not in env.node.sandboxes
    assert (await env.anon.get("/v1/sandboxes", headers=eve)).status_code == 401


async def test_metrics_have_bounded_labels(env: Env) -> None:
    """Prometheus output has create/exec/API histograms keyed by route templates, never sandbox ids."""
    sb = await _create(env.alice)
    await env.alice.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "echo hi"})
    text = (await env.anon.get("/metrics")).text
    assert 'dsec_sandbox_create_seconds_count{isolation="container"} 1.0' in text
    assert 'dsec_sandbox_creates_total{result="ok"} 1.0' in text
    assert 'dsec_exec_seconds_count{mode="sync"} 1.0' in text
    assert 'dsec_sandboxes{state="idle"} 1.0' in text
    assert 'route="/v1/sandboxes/{sandbox_id}/exec"' in text
    assert sb["id"] not in text


async def test_component_counters_exported(env: Env) -> None:
    """Cache hit/miss and leak counters from node/image stats() appear as Prometheus counters."""
    env.node.stats = lambda: {"layer_cache_hits": 7, "layer_cache_misses": 2, "leaks_reaped": 3}  # type: ignore
    text = (await env.anon.get("/metrics")).text
    assert 'dsec_image_cache_events_total{kind="layer",result="hit"} 7.0' in text
    assert 'dsec_image_cache_events_total{kind="layer",result="miss"} 2.0' in text
    assert "dsec_leaks_reaped_total 3.0" in text


def test_prefetch_counters_exported_only_when_prefetch_runs() -> None:
    """The leader's prefetch jobs by outcome and the bytes they moved are Prometheus
    counters; a server without a prefetcher exports none of them."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from dsec.api.sched_metrics import prefetch_metrics

    class One:
        def __init__(self, prefetcher: object) -> None:
            self.prefetcher = prefetcher

        def collect(self):  # type: ignore[no-untyped-def]
            return prefetch_metrics(self.prefetcher)

    r = CollectorRegistry()
    r.register(One(SimpleNamespace(stats={"passes": 4, "jobs": 3, "done": 2, "failed": 1, "skipped": 0,
                                          "bytes": 171_000_000})))
    text = generate_latest(r).decode()
    assert 'dsec_image_prefetch_jobs_total{result="started"} 3.0' in text
    assert 'dsec_image_prefetch_jobs_total{result="done"} 2.0' in text
    assert 'dsec_image_prefetch_jobs_total{result="failed"} 1.0' in text
    assert "dsec_image_prefetch_bytes_total 1.71e+08" in text
    r2 = CollectorRegistry()
    r2.register(One(None))
    assert "prefetch" not in generate_latest(r2).decode()


async def test_grafana_dashboard_uses_exported_metrics(env: Env) -> None:
    """Every metric the shipped Grafana dashboard queries is one the server actually exports."""
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[3] / "deploy/grafana/dsec.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(dsec_[a-z_]+)", e)}
    env.node.stats = lambda: {"layer_cache_hits": 1, "leaks_reaped": 0}  # type: ignore
    from types import SimpleNamespace

    from dsec.api.sched_metrics import SchedulerCollector
    from dsec.control.scheduler import Scheduler

    sched = Scheduler(env.services.settings)  # what attach_scheduler registers on `dsec serve`
    sched.upsert_node("n0", 2, 1 << 30, 1 << 30)
    env.services.metrics.registry.register(SchedulerCollector(SimpleNamespace(sched=sched)))
    sb = await _create(env.alice)
    await env.alice.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "echo"})
    text = (await env.anon.get("/metrics")).text
    exported = set(re.findall(r"^(dsec_[a-z_]+)", text, re.M))
    assert used and used <= exported, used - exported


async def test_placement_seam_handles_handover_ids(env: Env) -> None:
    """A creator that hands over another sandbox (warm pool) makes the user own that id;
    idempotent replay returns it, and kills go through the placement's destroyer."""
    node = env.node
    destroyed: list[str] = []

    async def creator(spec, sandbox_id, tenant):  # type: ignore[no-untyped-def]
        return await node.create(spec, sandbox_id="sb-pool-member", tenant=tenant)

    async def destroyer(sandbox_id: str) -> None:
        destroyed.append(sandbox_id)
        await node.destroy(sandbox_id)

    env.services.sandboxes.set_placement(creator, destroyer)
    a = await _create(env.alice, request_id="r-pool")
    assert a["id"] == "sb-pool-member"
    assert (await env.alice.get(f"/v1/sandboxes/{a['id']}")).status_code == 200
    b = await _create(env.alice, request_id="r-pool")
    assert b["id"] == a["id"] and b["state"] != "destroyed"
    assert (await env.alice.delete(f"/v1/sandboxes/{a['id']}")).status_code == 204
    assert destroyed == ["sb-pool-member"]
