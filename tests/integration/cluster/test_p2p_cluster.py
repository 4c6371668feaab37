"""Images across machines on a real local 3-node Ray cluster, real docker-registry, real runc.

One cluster (nodes start with NO images; DSEC_IMAGE_REGISTRY names the loopback registry)
and one `dsec serve --cluster` are shared by every check here:

- pull on placement: a create through the API names an image no node holds; the scheduler
  finds it in the registry, places it, and the node pulls it (progress and sources in its
  health / `dsec node ls --json`), then the sandbox runs;
- peer fetch: another node then gets every blob of it from the first node, none from the
  registry (the directory is Ray's GCS key-value store);
- fan-out: three nodes create a new image at once: each blob leaves the registry once;
- corrupt peer: a "peer" the directory says holds a layer serves other bytes: skipped,
  the registry used, the sandbox runs on verified bytes;
- cluster GC on a node: nothing a running sandbox uses goes; once idle "for 2 days", the
  non-base layer goes and the base layer (fewer than 3 copies) stays;
- prefetch: an image created twice through the API becomes popular and the leader's
  prefetcher puts it on the nodes that lacked it before any create asks there; a create
  there then fetches nothing; a warm pool of an image only one node holds is built on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.integration]
pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images"))

from registry_env import Registry

SHAPE = {"cpu": 0.25, "memory": "128M", "disk": "64M"}
DSEC = str(Path(sys.executable).parent / "dsec")


def _image(tmp: Path, name: str, extra: int, top: bool = False) -> Any:
    """A runnable image (static busybox) plus ``extra`` random bytes (its own layer digest);
    ``top``: and a second layer (a non-base layer) with another random file."""
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.craft import CraftedImage, Entry, layer_tar, tar_dir, write_oci_layout

    layer = layer_tar([Entry("bin", type=tarfile.DIRTYPE, mode=0o755),
                       Entry("bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755),
                       Entry("bin/sh", type=tarfile.SYMTYPE, linkname="busybox", mode=0o777),
                       Entry("bin/cat", type=tarfile.SYMTYPE, linkname="busybox", mode=0o777),
                       Entry("tmp", type=tarfile.DIRTYPE, mode=0o1777),
                       Entry("work", type=tarfile.DIRTYPE, mode=0o755),
                       Entry("marker", f"{name}\n".encode()), Entry("blob", os.urandom(extra))])
    file = name.replace("/", "_")
    d = tmp / f"layout-{file}"
    layers = [layer] + ([layer_tar([Entry("top", os.urandom(64 << 10))])] if top else [])
    write_oci_layout(d, CraftedImage(layers, compression="gzip"))
    tar_dir(d, tmp / f"{file}.tar")
    st = ImageStore(tmp / "src-images", Settings(home=tmp / "src"))
    return st, st.import_archive(tmp / f"{file}.tar", name=name)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from dsec.api.launch import start_serve
    from dsec.cluster import local
    from dsec.images.registry_ops import push

    tmp = tmp_path_factory.mktemp("p2p")
    reg = Registry(tmp)
    base = tmp / "c"
    srv = None
    saved = os.environ.get("DSEC_IMAGE_REGISTRY")
    os.environ["DSEC_IMAGE_REGISTRY"] = reg.host  # every node inherits it (`ray start` env)
    try:
        imgs = {}
        for name, extra in (("team/one", 256 << 10), ("team/fan", 2 << 20), ("team/bad", 256 << 10),
                            ("team/gc", 64 << 10), ("team/pop", 512 << 10), ("team/warm", 64 << 10)):
            st, info = _image(tmp, name, extra, top=name == "team/gc")
            push(st, name, f"{reg.host}/{name}:1")
            imgs[name] = info
        c = local.up(base, 3, [], timeout_s=300, log=lambda _m: None)
        # No demand-driven warm members: they would pull the image on other nodes too and
        # blur which node pulled what (each check below names its nodes). Prefetch passes
        # every second, onto every node (3) that lacks a popular image. The box's own load
        # (other work on a shared machine) must not make every node look full: neither
        # the creates, the pool nor the prefetcher's "nodes with room" are about that.
        srv = start_serve(tmp / "api", {"DSEC_CLUSTER": c.address, **local.shared_env(c),
                                        "DSEC_WARM_POOL_FACTOR": "0", "DSEC_IMAGE_PREFETCH_INTERVAL_S": "1",
                                        "DSEC_IMAGE_PREFETCH_NODES": "3", "DSEC_OVERCOMMIT_THRESHOLD": "100"},
                          timeout=240)
        yield {"reg": reg, "cluster": c, "srv": srv, "images": imgs, "tmp": tmp, "base": base}
    finally:
        if saved is None:
            os.environ.pop("DSEC_IMAGE_REGISTRY", None)
        else:
            os.environ["DSEC_IMAGE_REGISTRY"] = saved
        if srv is not None:
            srv.proc.terminate()
            srv.proc.wait(60)
        local.down(base, log=lambda _m: None)
        reg.stop()


def _proxies(address: str) -> dict[str, Any]:
    from dsec.cluster.ray import RayNodeProxy, connect, dsec_nodes, get_agent

    connect(address)
    return {nid: RayNodeProxy(nid, get_agent(nid), 120) for nid in sorted(dsec_nodes())}


async def _create_on(proxy: Any, image: str) -> Any:
    from dsec.models import ExecRequest, SandboxSpec

    await proxy.start()
    info = await proxy.create(SandboxSpec(image=image, **SHAPE))
    try:
        r = await proxy.exec(info.id, ExecRequest(cmd="cat /marker"))
        assert r.exit_code == 0, r
        return r.stdout
    finally:
        await proxy.destroy(info.id)


async def _last_pull(proxy: Any, ref_part: str) -> Any:
    pulls = [p for p in (await proxy.health()).pulls if ref_part in p.ref and p.state != "pulling"]
    assert pulls, f"node {proxy.node_id} reports no finished pull of {ref_part}"
    return pulls[-1]


def test_pull_on_placement_then_peer_fetch(env: dict[str, Any]) -> None:
    """A create through `dsec serve --cluster` of an image only the registry holds is placed
    and the node pulls it (the layer leaves the registry once); a node that never pulled it
    then gets every blob from peers, none from the registry; `dsec node ls --json` reports
    both nodes' pulls."""
    srv = env["srv"]
    with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {srv.token}"}, timeout=180) as c:
        r = c.post("/v1/sandboxes", json={**SHAPE, "image": "team/one:1"})
        assert r.status_code == 201, r.text
        info = r.json()
        out = c.post(f"/v1/sandboxes/{info['id']}/exec", json={"cmd": "cat /marker"}).json()
        assert out["stdout"] == "team/one\n", out
        assert c.delete(f"/v1/sandboxes/{info['id']}").status_code == 204
    first = info["node"]
    proxies = _proxies(env["cluster"].address)
    size = sum(li.size for li in env["images"]["team/one"].layers)

    async def pulls_of(p: Any) -> list[Any]:
        return [x for x in (await p.health()).pulls if "team/one" in x.ref and x.state != "pulling"]

    async def go() -> tuple[dict[str, list[Any]], Any, str, str]:
        before = {n: await pulls_of(p) for n, p in proxies.items()}
        other = next(n for n in sorted(proxies) if not before[n])  # a node that never pulled it
        stdout = await _create_on(proxies[other], "team/one:1")
        return before, (await pulls_of(proxies[other]))[-1], stdout, other

    before, p2, stdout, other = asyncio.run(go())
    assert stdout == "team/one\n"
    assert before[first] and before[first][-1].state == "done", before
    # One registry fetch of the layer in all (the node that pulled first; a create the
    # scheduler retried elsewhere would have taken it from that node's peer endpoint).
    from_registry = sum(x.sources.get("registry", 0) for xs in before.values() for x in xs)
    assert size <= from_registry < size + (64 << 10), before
    assert p2.state == "done" and "registry" not in p2.sources, p2
    assert sum(v for k, v in p2.sources.items() if k.startswith("peer:")) >= size, p2
    rows = json.loads(subprocess.run([DSEC, "node", "ls", "--json", "--cluster", env["cluster"].address],
                                     capture_output=True, text=True, timeout=120, check=True).stdout)
    by = {r["id"]: r for r in rows}
    for nid in (first, other):
        assert any("team/one" in p["ref"] and p["state"] == "done" for p in by[nid]["pulls"]), by[nid]


def test_fan_out_three_nodes_one_registry_fetch_per_blob(env: dict[str, Any]) -> None:
    """Three nodes create the same new image at once: in all, each blob comes from the
    registry once (one node's claim); the other nodes get it from peers."""
    proxies = _proxies(env["cluster"].address)
    info = env["images"]["team/fan"]

    async def go() -> list[Any]:
        outs = await asyncio.gather(*(_create_on(p, "team/fan:1") for p in proxies.values()))
        assert outs == ["team/fan\n"] * len(proxies)
        return [await _last_pull(p, "team/fan") for p in proxies.values()]

    pulls = asyncio.run(go())
    from_registry = sum(p.sources.get("registry", 0) for p in pulls)
    blobs = sum(li.size for li in info.layers)
    assert blobs <= from_registry < blobs + (64 << 10), [p.sources for p in pulls]  # + the config, once
    assert sum(v for p in pulls for k, v in p.sources.items() if k.startswith("peer:")) >= 2 * blobs


def test_corrupt_peer_is_skipped_through_the_cluster_directory(env: dict[str, Any]) -> None:
    """A rogue "peer" published in the cluster directory as holding a layer answers with
    other bytes: the node skips it, fetches the layer from the registry, and the sandbox
    runs on the verified layer."""
    from ray.experimental import internal_kv as kv

    proxies = _proxies(env["cluster"].address)
    layer = env["images"]["team/bad"].layers[0]
    asked = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a: Any) -> None:
            pass

        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(layer.size))
            self.end_headers()
            self.wfile.write(os.urandom(layer.size))

    rogue = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=rogue.serve_forever, daemon=True).start()
    keys = ["p2p:ep:evil", f"p2p:has:{layer.digest}:evil"]
    try:
        kv._internal_kv_put(keys[0], f"http://127.0.0.1:{rogue.server_address[1]}", namespace="dsec")
        kv._internal_kv_put(keys[1], "1", namespace="dsec")
        node = max(proxies)

        async def go() -> tuple[str, Any]:
            out = await _create_on(proxies[node], "team/bad:1")
            return out, await _last_pull(proxies[node], "team/bad")

        out, pull = asyncio.run(go())
        assert out == "team/bad\n"
        assert asked and layer.digest in asked[0]
        assert pull.state == "done" and pull.sources.get("registry", 0) >= layer.size, pull
    finally:
        for k in keys:
            kv._internal_kv_del(k, namespace="dsec")
        rogue.shutdown()
        rogue.server_close()


def test_cluster_gc_keeps_used_and_base_layers_drops_idle_others(env: dict[str, Any]) -> None:
    """A node runs a sandbox of a 2-layer image; its cluster GC pass, run as if 2 days had
    passed, removes nothing while the sandbox runs (and that use counts as asked-for then,
    so half a day later it is still kept). A day after that use, the pass removes the top
    (non-base) layer from the node and keeps the base layer (the cluster holds fewer than
    image_base_layer_min_copies=3 copies); the image leaves the node's layer index; the
    directory no longer lists the node as a holder of the top layer. The image goes whole
    (its config too) and the kept base layer stays in the GC's view as a bare copy."""
    import ray
    from ray.experimental import internal_kv as kv

    from dsec.cluster.ray import get_agent
    from dsec.models import SandboxSpec

    proxies = _proxies(env["cluster"].address)
    node = min(proxies)
    info = env["images"]["team/gc"]
    base, top = info.layers[0].digest, info.layers[1].digest
    handle = get_agent(node)

    async def make() -> Any:
        await proxies[node].start()
        return await proxies[node].create(SandboxSpec(image="team/gc:1", **SHAPE))

    sb = asyncio.run(make())
    try:
        assert ray.get(handle.cluster_gc.remote(2 * 86400.0), timeout=120) == []
    finally:
        asyncio.run(proxies[node].destroy(sb.id))
    # In use at "day 2" counts as wanted then: kept until a day later.
    assert top not in ray.get(handle.cluster_gc.remote(2.5 * 86400.0), timeout=120)
    removed = ray.get(handle.cluster_gc.remote(4 * 86400.0), timeout=120)
    assert top in removed and base not in removed, removed
    assert info.id in removed  # the image went whole: its config too, not only the dropped layer
    index = asyncio.run(proxies[node].layer_index())
    assert not any("team/gc" in n for i in index.images for n in i.names), index
    assert kv._internal_kv_get(f"p2p:has:{top}:{node}", namespace="dsec") is None
    assert kv._internal_kv_get(f"p2p:has:{base}:{node}", namespace="dsec") is not None
    # The base layer stays as a bare copy the GC still counts (a base layer this node holds).
    doc = json.loads(kv._internal_kv_get(f"p2p:img:{node}", namespace="dsec"))
    assert base in doc["base"] and base in doc["layers"] and top not in doc["layers"], doc


def test_prefetch_popular_image_then_pool_on_layer_holders(env: dict[str, Any]) -> None:
    """Two creates of team/pop through the API make it popular: the leader's prefetcher
    puts it on every node that lacked it, before any create asks for it there (each such
    node has exactly one pull of it, a prefetch, from peers; `dsec node ls --json` counts
    its prefetched bytes). A create on such a node then fetches nothing (no new pull, no
    registry or peer fetch). A warm pool of team/warm, which only one node holds (the
    scheduler learns it from the nodes' layer indexes), is built on that node: its members
    pull nothing anywhere else."""
    srv = env["srv"]
    proxies = _proxies(env["cluster"].address)
    holder = max(proxies)
    asyncio.run(_create_on(proxies[holder], "team/warm:1"))  # team/warm on this node only
    size = sum(li.size for li in env["images"]["team/pop"].layers)

    async def pulls_of(p: Any, ref: str) -> list[Any]:
        return [x for x in (await p.health()).pulls if ref in x.ref]

    async def holds(p: Any, ref: str) -> bool:
        return any(ref in n for i in (await p.layer_index()).images for n in i.names)

    with httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {srv.token}"}, timeout=180) as c:
        made = []
        for _ in range(2):
            r = c.post("/v1/sandboxes", json={**SHAPE, "image": "team/pop:1"})
            assert r.status_code == 201, r.text
            made.append(r.json())
            assert c.delete(f"/v1/sandboxes/{made[-1]['id']}").status_code == 204
        # The nodes no create pulled it on (a create the scheduler retried elsewhere may
        # have pulled it on a second node): a pull there can only be a prefetch.
        seen = {n: asyncio.run(pulls_of(p, "team/pop")) for n, p in proxies.items()}
        lacking = sorted(n for n, xs in seen.items() if all(x.prefetch for x in xs))
        assert lacking, (made, seen)
        deadline = time.monotonic() + 60
        while not all(asyncio.run(holds(proxies[n], "team/pop")) for n in lacking):
            st = c.get("/v1/scheduler").json()
            assert time.monotonic() < deadline, (lacking, seen, st["prefetch"], st["nodes"])
            time.sleep(0.5)
        # The node holds the image before the leader has counted the job done (after the
        # Ray reply), and a job may finish between two reads: read until they agree.
        for _ in range(100):
            view = c.get("/v1/scheduler").json()["prefetch"]
            metrics = c.get("/metrics").text  # the same counters, for an operator's dashboard
            if view["stats"]["done"] >= len(lacking) and view == c.get("/v1/scheduler").json()["prefetch"]:
                break
            time.sleep(0.1)
        assert view["stats"]["done"] >= len(lacking), view

        def sample(series: str) -> float | None:
            m = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.MULTILINE)
            return float(m.group(1)) if m else None

        assert sample('dsec_image_prefetch_jobs_total{result="done"}') == view["stats"]["done"], metrics[-3000:]
        assert sample("dsec_image_prefetch_bytes_total") == view["stats"]["bytes"] > 0, metrics[-3000:]
        for n in lacking:
            pulls = asyncio.run(pulls_of(proxies[n], "team/pop"))
            assert [(p.prefetch, p.state) for p in pulls] == [(True, "done")], pulls
            assert "registry" not in pulls[0].sources, pulls  # peers first: the creates' node had it
            assert sum(v for k, v in pulls[0].sources.items() if k.startswith("peer:")) >= size, pulls
        rows = json.loads(subprocess.run([DSEC, "node", "ls", "--json", "--cluster", env["cluster"].address],
                                         capture_output=True, text=True, timeout=120, check=True).stdout)
        assert all({r["id"]: r for r in rows}[n]["prefetched_bytes"] >= size for n in lacking), rows

        # A create on a prefetched node: the image is there, nothing is fetched.
        target = lacking[0]

        async def create_there() -> tuple[Any, Any, str, Any, Any]:
            p = proxies[target]
            s0, n0 = await p.p2p_admin("stats", {}), await pulls_of(p, "team/pop")
            out = await _create_on(p, "team/pop:1")
            return s0, n0, out, await p.p2p_admin("stats", {}), await pulls_of(p, "team/pop")

        s0, n0, out, s1, n1 = asyncio.run(create_there())
        assert out == "team/pop\n"
        assert len(n1) == len(n0) == 1, n1  # no pull at create time
        assert (s1["registry_fetches"], s1["from_peers"]) == (s0["registry_fetches"], s0["from_peers"])

        # A warm pool of an image only `holder` holds is built there.
        spec = {**SHAPE, "image": "team/warm:1"}
        assert c.put("/v1/pools", json={"spec": spec, "size": 2}).status_code == 200
        from dsec.control.convert import POOL_LABEL

        async def members() -> dict[str, int]:  # node -> ready team/warm pool members there
            out = {}
            for n, p in proxies.items():
                got = [i for i in await p.list(labels={POOL_LABEL: "1"})
                       if i.image == "team/warm:1" and i.state.value == "ready"]
                if got:
                    out[n] = len(got)
            return out

        try:
            deadline = time.monotonic() + 60
            while sum((where := asyncio.run(members())).values()) < 2:
                assert time.monotonic() < deadline, c.get("/v1/pools").text
                time.sleep(0.5)
            assert where == {holder: 2}, where
            for n in set(proxies) - {holder}:
                assert not asyncio.run(pulls_of(proxies[n], "team/warm")), n
        finally:
            c.put("/v1/pools", json={"spec": spec, "size": 0})
