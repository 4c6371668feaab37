"""Pull on create (single node): a real `dsec serve` with `image_registry` pointing at a
real docker-registry; a create naming an image the node lacks pulls it (verified, single
flight per reference, progress in the server log), then the sandbox starts and execs.
Refs outside the configured registry are never fetched."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from registry_env import Registry, free_port

from dsec.api.launch import ServeProcess, reap_home, start_serve
from dsec.config import load_settings
from dsec.images import ImageStore
from dsec.images.registry_ops import push

pytestmark = pytest.mark.integration


@pytest.fixture
def env(store: ImageStore, tmp_path: Path) -> Iterator[tuple[Registry, ServeProcess, httpx.Client]]:
    reg = Registry(tmp_path)
    home = tmp_path / "server-home"  # no images at all: everything comes from the registry
    srv = start_serve(home, {"DSEC_IMAGE_REGISTRY": reg.host}, log_level="info")
    client = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {srv.token}"}, timeout=120)
    try:
        yield reg, srv, client
    finally:
        try:
            for sb in client.get("/v1/sandboxes").json():
                client.delete(f"/v1/sandboxes/{sb['id']}")
        finally:
            client.close()
            srv.stop()
            reap_home(home)
            reg.stop()


def _create_exec(client: httpx.Client, image: str) -> tuple[str, float, float]:
    t0 = time.perf_counter()
    r = client.post("/v1/sandboxes", json={"image": image})
    assert r.status_code == 201, r.text
    t1 = time.perf_counter()
    sid = r.json()["id"]
    e = client.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sh", "-c", "echo hi; cat /etc/hostname >/dev/null"]})
    assert e.status_code == 200 and e.json()["stdout"] == "hi\n", e.text
    return sid, t1 - t0, time.perf_counter() - t1


def test_create_pulls_missing_image(store: ImageStore, env: tuple[Registry, ServeProcess, httpx.Client]) -> None:
    """Cold create of `team/bb:v1` (only in the registry) pulls it and the sandbox runs;
    the second create is local. Concurrent creates of another missing tag pull it once.
    The server log shows the pull's progress. Figures are printed (pull time apart)."""
    reg, srv, client = env
    push(store, "busybox", f"{reg.host}/team/bb:v1")
    push(store, "busybox", f"{reg.host}/team/bb:v2")

    _, cold_create, cold_exec = _create_exec(client, "team/bb:v1")
    _, warm_create, warm_exec = _create_exec(client, "team/bb:v1")
    log = srv.log.read_text()
    assert f"pulling {reg.host}/team/bb:v1" in log and "100%" in log and "pulled" in log
    print(f"\ncold create (incl. pull) {cold_create * 1000:.0f} ms, first exec {cold_exec * 1000:.0f} ms; "
          f"warm create {warm_create * 1000:.0f} ms, first exec {warm_exec * 1000:.0f} ms; "
          f"pull ~ {(cold_create - warm_create) * 1000:.0f} ms")

    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: _create_exec(client, f"{reg.host}/team/bb:v2"), range(3)))
    assert len(results) == 3
    assert srv.log.read_text().count(f"pulling {reg.host}/team/bb:v2") == 1  # single flight per reference


def test_create_refuses_what_it_cannot_pull(env: tuple[Registry, ServeProcess, httpx.Client]) -> None:
    """An unknown tag in the configured registry is 404 naming the image; a ref naming
    another registry (here a loopback port nobody should be made to fetch from) is 404
    without any request to it; nothing is left registered."""
    reg, srv, client = env
    r = client.post("/v1/sandboxes", json={"image": "team/none:v9"})
    assert r.status_code == 404 and "team/none:v9" in r.json()["message"]
    other = f"127.0.0.1:{free_port()}/evil:v1"
    r = client.post("/v1/sandboxes", json={"image": other})
    assert r.status_code == 404 and "evil" in r.json()["message"]
    assert "pulling 127.0.0.1" not in srv.log.read_text().replace(f"pulling {reg.host}", "")
    assert ImageStore(srv.home / "images", load_settings(home=srv.home)).list() == []
