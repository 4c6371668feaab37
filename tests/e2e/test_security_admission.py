"""Issue 18, admission findings, against a real `dsec serve` with real runc sandboxes:

#4  tenant quotas hold under truly concurrent creates (cold, warm hand-overs, restores),
    and every refusal is a 429 naming the quota that ran out;
#6  ``pids`` above the node's per-sandbox limit (never above the host's pid_max) is a
    422, and a warm hand-over gives the pids asked for (read from the real cgroup file);
#13 a bad allow-list is refused at submit without costing a warm-pool member, and the
    404 for an unknown image names no image of the node.
"""

from __future__ import annotations

import asyncio
import glob
import time
from collections.abc import Iterator

import httpx
import pytest
from e2e_server import Server, running_server

pytestmark = pytest.mark.integration

SMALL = {"image": "busybox", "cpu": 0.25, "memory": "32M", "disk": "16M", "timeout": 300}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "dsec-admission", {"DSEC_API_CREATE_WAIT_S": "60"}) as s:
        yield s


def _admin(s: Server) -> httpx.Client:
    return httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {s.token}"}, timeout=120)


def _tenant(s: Server, name: str, **quota: object) -> str:
    with _admin(s) as c:
        r = c.post("/v1/tenants", json={"name": name, **quota})
        assert r.status_code in (200, 201), r.text
        return str(r.json()["token"])


def _drop_tenant(s: Server, name: str, token: str) -> None:
    with httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {token}"}, timeout=120) as c:
        for sb in c.get("/v1/sandboxes").json():
            c.delete(f"/v1/sandboxes/{sb['id']}")
    with _admin(s) as c:
        c.delete(f"/v1/tenants/{name}")


def _burst(s: Server, token: str, bodies: list[dict], path: str = "/v1/sandboxes") -> list[httpx.Response]:
    """POST every body at once (one connection each), as a burst of clients would."""

    async def go() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies) + 1)
        async with httpx.AsyncClient(base_url=s.url, headers={"authorization": f"Bearer {token}"},
                                     timeout=180, limits=limits) as c:
            return list(await asyncio.gather(*(c.post(path, json=b) for b in bodies)))

    return asyncio.run(go())


def _live(s: Server, token: str) -> list[dict]:
    with httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {token}"}, timeout=60) as c:
        return [sb for sb in c.get("/v1/sandboxes").json() if sb["state"] not in ("destroyed", "failed", "stopped")]


def _pool(s: Server, spec: dict, size: int, wait_ready: int = 0) -> None:
    """Set the floor of ``spec``'s shape; wait until that shape has ``wait_ready`` members."""
    with _admin(s) as c:
        r = c.put("/v1/pools", json={"spec": spec, "size": size})
        assert r.status_code == 200, r.text
        (mine,) = r.json()["pools"]
        shape = {k: mine[k] for k in ("image", "isolation", "cpu", "memory", "disk", "network")}
        deadline = time.monotonic() + 120
        while wait_ready and time.monotonic() < deadline:
            pools = c.get("/v1/pools").json()["pools"]
            if sum(p["ready"] for p in pools if all(p[k] == v for k, v in shape.items())) >= wait_ready:
                return
            time.sleep(0.2)
        assert not wait_ready, "warm pool never filled"


def _stats(s: Server) -> dict[str, int]:
    with _admin(s) as c:
        return dict(c.get("/v1/scheduler").json()["stats"])


def _assert_refused(r: httpx.Response, quota: str) -> None:
    body = r.json()
    assert r.status_code == 429 and body["code"] == "quota_exceeded", r.text
    assert quota in body["message"] and body["details"]["quota"] == quota, body
    assert int(r.headers["retry-after"]) >= 1


def test_max_sandboxes_holds_under_30_concurrent_creates(srv: Server) -> None:
    """#4: 30 simultaneous creates against max_sandboxes=2 (a warm pool of the shape is
    ready, so hand-overs race cold creates) admit exactly 2; the other 28 are 429 naming
    max_sandboxes, and the tenant holds 2 sandboxes afterwards (nothing created late)."""
    _pool(srv, SMALL, 2, wait_ready=2)
    token = _tenant(srv, "adm-count", max_sandboxes=2)
    try:
        hits = _stats(srv)["warm_hits"]
        answers = _burst(srv, token, [dict(SMALL) for _ in range(30)])
        ok = [r for r in answers if r.status_code == 201]
        assert len(ok) == 2, [(r.status_code, r.text[:200]) for r in answers]
        assert _stats(srv)["warm_hits"] > hits  # hand-overs were part of the race
        for r in answers:
            if r.status_code != 201:
                _assert_refused(r, "max_sandboxes")
        time.sleep(1.0)  # a creation the API gave up on must not land afterwards either
        assert sorted(sb["id"] for sb in _live(srv, token)) == sorted(r.json()["id"] for r in ok)
    finally:
        _drop_tenant(srv, "adm-count", token)
        _pool(srv, SMALL, 0)


def test_max_memory_holds_under_concurrent_creates(srv: Server) -> None:
    """#4: max_memory=128M and three simultaneous 64M creates: two are admitted, the
    third is 429 naming max_memory (and the tenant's sandboxes add up to 128M)."""
    token = _tenant(srv, "adm-mem", max_memory="128M")
    try:
        answers = _burst(srv, token, [{**SMALL, "memory": "64M"} for _ in range(3)])
        codes = sorted(r.status_code for r in answers)
        assert codes == [201, 201, 429], [r.text[:200] for r in answers]
        _assert_refused(next(r for r in answers if r.status_code == 429), "max_memory")
        assert sum(sb["memory"] for sb in _live(srv, token)) <= 128 * 1024 * 1024
    finally:
        _drop_tenant(srv, "adm-mem", token)


def test_concurrent_restores_are_admitted_atomically(srv: Server) -> None:
    """#4: restores are creates: with max_sandboxes=2 and one sandbox live, four
    simultaneous restores of its checkpoint admit exactly one."""
    token = _tenant(srv, "adm-restore", max_sandboxes=2)
    try:
        with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {token}"}, timeout=120) as c:
            sb = c.post("/v1/sandboxes", json=SMALL)
            assert sb.status_code == 201, sb.text
            sid = sb.json()["id"]
            ck = c.post(f"/v1/sandboxes/{sid}/checkpoints", json={})
            assert ck.status_code == 201, ck.text
        answers = _burst(srv, token, [{} for _ in range(4)], f"/v1/checkpoints/{ck.json()['id']}/restore")
        assert sorted(r.status_code for r in answers) == [201, 429, 429, 429], [r.text[:200] for r in answers]
        for r in answers:
            if r.status_code == 429:
                _assert_refused(r, "max_sandboxes")
        assert len(_live(srv, token)) == 2
    finally:
        _drop_tenant(srv, "adm-restore", token)


def _host_pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read())


def test_pids_above_the_node_limit_is_422(srv: Server) -> None:
    """#6: pids=1,000,000 (far above the host's pid_max) is a 422 naming pids and the
    node's limit, which is never above pid_max; nothing is created."""
    token = _tenant(srv, "adm-pids")
    try:
        with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {token}"}, timeout=120) as c:
            r = c.post("/v1/sandboxes", json={**SMALL, "pids": 1_000_000})
            assert r.status_code == 422, r.text
            body = r.json()
            assert "pids" in body["message"] and body["details"]["field"] == "pids"
            assert 8 <= body["details"]["limit"] <= _host_pid_max()
            r = c.post("/v1/sandboxes", json={**SMALL, "pids": body["details"]["limit"] + 1})
            assert r.status_code == 422, r.text
            assert _live(srv, token) == []
    finally:
        _drop_tenant(srv, "adm-pids", token)


@pytest.mark.parametrize("isolation", ["container", pytest.param("gvisor", marks=pytest.mark.gvisor)])
def test_warm_handover_gives_the_pids_asked_for(srv: Server, isolation: str) -> None:
    """#6, both tiers: with a warm member of the shape ready (built with the default 1024
    pids), a create asking pids=300 gets a sandbox whose pids cgroup limit (the real
    pids.max file on the host) and info say 300."""
    spec = {**SMALL, "isolation": isolation}
    _pool(srv, spec, 1, wait_ready=1)
    try:
        with _admin(srv) as c:
            r = c.post("/v1/sandboxes", json={**spec, "pids": 300})
            assert r.status_code == 201, r.text
            info = r.json()
            try:
                assert info["pids"] == 300
                files = glob.glob(f"/sys/fs/cgroup/pids/*/{info['id']}/pids.max")
                assert files, "no pids cgroup for the sandbox"
                with open(files[0]) as fh:
                    assert fh.read().strip() == "300"
            finally:
                c.delete(f"/v1/sandboxes/{info['id']}")
    finally:
        _pool(srv, spec, 0)


def test_bad_allow_list_is_refused_before_it_reaches_the_pool(srv: Server) -> None:
    """#13: with a warm member of a networked shape ready, a create of that shape with an
    invalid allow-list entry is 422 naming the entry before it reaches the scheduler: no
    submission, no warm hit, no member claimed and destroyed (a tenant cannot burn pools
    with bad requests)."""
    spec = {**SMALL, "network": []}
    _pool(srv, spec, 1, wait_ready=1)
    try:
        before = _stats(srv)
        token = _tenant(srv, "adm-net")
        try:
            with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {token}"}, timeout=120) as c:
                # A malformed entry, and a node address (a slot gateway of the default
                # net_cidr) that only the network manager used to refuse, at hand-over.
                for bad in ("10.0.0.1:99999", "10.213.0.1:80", "10.0.0.1:99999"):
                    r = c.post("/v1/sandboxes", json={**spec, "network": [bad]})
                    assert r.status_code == 422 and bad in r.json()["message"], r.text
        finally:
            _drop_tenant(srv, "adm-net", token)
        after = _stats(srv)
        assert (after["submitted"], after["warm_hits"]) == (before["submitted"], before["warm_hits"])
        assert "claiming pool member" not in srv.log.read_text()
    finally:
        _pool(srv, spec, 0)


def test_unknown_image_404_lists_no_images(srv: Server) -> None:
    """#13: a tenant restricted to busybox* asking for an unknown busybox-like image, and a
    tenant with every image asking for an unknown one, get a 404 that says the image is
    unknown and names no image of the node."""
    token = _tenant(srv, "adm-img", images=["busybox*"])
    try:
        for tok, image in ((token, "busybox-internal-tools"), (srv.token, "no-such-image")):
            with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {tok}"}, timeout=60) as c:
                r = c.post("/v1/sandboxes", json={**SMALL, "image": image})
                assert r.status_code == 404, r.text
                body = r.json()
                assert image in body["message"] and "unknown" in body["message"]
                assert "busybox:latest" not in r.text and "available" not in body["details"]
    finally:
        _drop_tenant(srv, "adm-img", token)


def test_episode_open_is_judged_like_a_create(srv: Server) -> None:
    """#6/#13 via episodes: opening an episode makes a sandbox from the tenant's spec, so
    the same checks hold there: pids above the node limit is 422, and an image outside the
    tenant's allow-list is 403; neither episode is created."""
    any_image = _tenant(srv, "adm-epi")
    python_only = _tenant(srv, "adm-epi-py", images=["python*"])
    try:
        for token, name, spec, code in ((any_image, "e-pids", {**SMALL, "pids": 1_000_000}, 422),
                                        (python_only, "e-img", SMALL, 403)):
            with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {token}"}, timeout=120) as c:
                r = c.post(f"/v1/episodes/{name}/open", json={"spec": spec})
                try:
                    assert r.status_code == code, r.text
                    assert ("pids" if code == 422 else "busybox") in r.json()["message"]
                    assert c.get(f"/v1/episodes/{name}").status_code == 404  # never created
                finally:
                    if r.status_code == 200:
                        c.delete(f"/v1/episodes/{name}")
    finally:
        _drop_tenant(srv, "adm-epi", any_image)
        _drop_tenant(srv, "adm-epi-py", python_only)


def test_episode_sandboxes_count_against_the_tenant_quota(srv: Server) -> None:
    """#4 via episodes: an episode's sandbox is admitted like any create. With
    ``max_sandboxes=1``, a tenant holding one episode cannot create a sandbox, and a
    tenant holding a sandbox cannot open an episode (before: episodes were built on the
    node directly, invisible to the quota, so a tenant could hold any number of them)."""
    token = _tenant(srv, "quota-epi", max_sandboxes=1)
    hdr = {"authorization": f"Bearer {token}"}
    try:
        with httpx.Client(base_url=srv.url, headers=hdr, timeout=120) as c:
            r = c.post("/v1/episodes/e1/open", json={"spec": SMALL})
            assert r.status_code == 200, r.text
            live = _live(srv, token)
            assert len(live) == 1, live  # the episode's sandbox is the tenant's, listed and counted
            r = c.post("/v1/sandboxes", json=SMALL)
            assert r.status_code == 429, r.text
            assert r.json()["details"]["quota"] == "max_sandboxes"
            r = c.post("/v1/episodes/e2/open", json={"spec": SMALL})
            assert r.status_code == 429, r.text
            assert c.delete("/v1/episodes/e1").status_code == 204
            assert _live(srv, token) == []  # closing it frees the quota
            r = c.post("/v1/sandboxes", json=SMALL)
            assert r.status_code == 201, r.text
            r = c.post("/v1/episodes/e3/open", json={"spec": SMALL})
            assert r.status_code == 429, r.text
            assert c.get("/v1/episodes/e3").status_code == 404  # refused: nothing was created
    finally:
        _drop_tenant(srv, "quota-epi", token)
