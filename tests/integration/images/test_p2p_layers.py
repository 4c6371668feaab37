"""Peer-to-peer layers between node stores, with the real docker-registry and real HTTP blob
endpoints (``dsec.cluster.blobserve``) on loopback: fan-out (one registry fetch per blob
feeds every other node through peers, as a tree), a peer serving corrupt bytes and a peer
dying mid-transfer (both skipped, the next source used, nothing half-written).

Each "node" is its own ImageStore (own DSEC_HOME) with its own blob endpoint, all in
this process. The directory is the in-memory ``MemoryKV`` (the Ray GCS one is covered by
tests/integration/cluster/test_p2p_cluster.py); everything else is what a node runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from registry_env import Registry

from dsec.cluster.p2p import KVDirectory, MemoryKV, NodePeers
from dsec.config import load_settings
from dsec.images import ImageStore
from dsec.images.registry_ops import push, resolve_or_pull

pytestmark = [pytest.mark.integration]


@pytest.fixture
def pushed(store: ImageStore, registry: Registry) -> str:
    push(store, "busybox", f"{registry.host}/team/bb:1")
    return "team/bb:1"


def _node(tmp: Path, name: str, registry: Registry, directory: KVDirectory, **over: Any) -> NodePeers:
    s = load_settings(home=tmp / name, image_registry=registry.host, p2p_serve_max=2, p2p_claim_stale_s=5,
                      **over)
    st = ImageStore(tmp / name / "images", s)
    return NodePeers(name, st, directory, s, "127.0.0.1").start()


@pytest.fixture
def directory() -> KVDirectory:
    return KVDirectory(MemoryKV())


@pytest.fixture
def nodes(tmp_path: Path, registry: Registry, directory: KVDirectory) -> Iterator[list[NodePeers]]:
    made: list[NodePeers] = []
    yield made
    for n in made:
        n.close()


def _no_partial(st: ImageStore) -> None:
    assert list((st.root / "blobs" / "ingest").iterdir()) == []


def test_fan_out_one_registry_fetch_per_blob_feeds_six_nodes(tmp_path: Path, registry: Registry, pushed: str,
                                                             directory: KVDirectory, nodes: list[NodePeers]) -> None:
    """Six nodes pull the same image at once: each blob leaves the registry exactly once
    (one claim), the other five get it from peers, and the layer spreads as a tree: a
    holder that already feeds p2p_serve_max peers is passed over for fresh holders."""
    # p2p_tree_wait_s: long enough that a loaded box's slow first transfers still happen
    # before waiters give up on fresh holders (the default 5 s bounds latency in production).
    nodes += [_node(tmp_path, f"n{i}", registry, directory, p2p_tree_wait_s=60) for i in range(6)]
    barrier = threading.Barrier(len(nodes))

    def go(n: NodePeers) -> str:
        barrier.wait()
        return resolve_or_pull(n.store, pushed).id

    with cf.ThreadPoolExecutor(len(nodes)) as pool:
        ids = list(pool.map(go, nodes))
    assert len(set(ids)) == 1
    info = nodes[0].store.resolve(pushed)
    blobs = [info.id] + [li.digest for li in info.layers]
    assert sum(n.fetcher.registry_fetches for n in nodes) == len(blobs), [n.fetcher.registry_fetches for n in nodes]
    for d in blobs:
        assert sum(n for n, _ in directory.served(d).values()) == len(nodes) - 1, directory.served(d)
    served = directory.served(info.layers[0].digest)  # the config is tiny: one source is fine for it
    # A tree, not a star: several holders served it, none to everybody (p2p_serve_max=2
    # is the aim; counts are published as a serve starts, so racing fetchers on a loaded
    # box can push one holder past it, never to all five).
    assert len(served) >= 2 and max(n for n, _ in served.values()) < len(nodes) - 1, served
    for n in nodes:
        n.store.content.verify(info.layers[0].digest)
        _no_partial(n.store)
        assert sorted(directory.holders(info.layers[0].digest)) == sorted(x.node for x in nodes)


class _Rogue:
    """A "peer" on loopback that answers blob requests with wrong bytes of the right size
    (``corrupt``) or with half the body and then a closed connection (``die``)."""

    def __init__(self, mode: str, size: int) -> None:
        self.asked = 0
        rogue = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_a: Any) -> None:
                pass

            def do_GET(self) -> None:
                rogue.asked += 1
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if mode == "corrupt":
                    self.wfile.write(os.urandom(size))
                else:
                    self.wfile.write(os.urandom(size // 2))
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("mode", ["corrupt", "die"])
def test_bad_peer_is_skipped_and_the_next_source_used(tmp_path: Path, registry: Registry, pushed: str,
                                                      store: ImageStore, directory: KVDirectory,
                                                      nodes: list[NodePeers], mode: str) -> None:
    """The directory says a peer holds the layer, but it serves bytes that do not hash to
    the digest (or dies half-way): the fetch skips it, takes the layer from the next source
    (the registry), and the store holds the verified layer and no partial file."""
    layer = store.resolve("busybox").layers[0]
    rogue = _Rogue(mode, layer.size)
    try:
        directory.publish_endpoint("evil", rogue.url)
        directory.announce("evil", [layer.digest])
        n = _node(tmp_path, "n0", registry, directory)
        nodes.append(n)
        info = resolve_or_pull(n.store, pushed)
        assert rogue.asked == 1
        assert "evil" in n.fetcher.skipped
        why = n.fetcher.skipped["evil"]
        assert ("do not hash" in why) if mode == "corrupt" else ("connection failed" in why), why
        assert n.fetcher.registry_fetches == 2  # config + the layer, from the registry after the bad peer
        assert info.layers[0].digest == layer.digest
        n.store.content.verify(layer.digest)
        _no_partial(n.store)
    finally:
        rogue.stop()


def test_blob_endpoint_is_token_only_read_only_and_by_digest(tmp_path: Path, registry: Registry, pushed: str,
                                                              directory: KVDirectory, nodes: list[NodePeers]) -> None:
    """The peer endpoint refuses a wrong token (401), anything but a digest path (404),
    writes (501), and serves a held blob byte for byte."""
    import httpx

    n = _node(tmp_path, "n0", registry, directory)
    nodes.append(n)
    info = resolve_or_pull(n.store, pushed)
    d = info.layers[0].digest
    url = f"{n.server.url}/v1/blobs/{d}"
    good = {"Authorization": f"Bearer {directory.token()}"}
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{n.server.url}/v1/blobs/../meta.db", headers=good).status_code == 404
    assert httpx.get(f"{n.server.url}/v1/blobs/sha256:{'0' * 64}", headers=good).status_code == 404
    assert httpx.put(url, headers=good, content=b"x").status_code == 501
    r = httpx.get(url, headers=good)
    assert r.status_code == 200 and r.content == n.store.content.path(d).read_bytes()


def test_prefetch_waits_for_a_create_pull_then_fetches_from_peers(tmp_path: Path, registry: Registry, pushed: str,
                                                                 directory: KVDirectory,
                                                                 nodes: list[NodePeers]) -> None:
    """The node side of the scheduler's prefetch (``p2p_admin("prefetch")``): while a pull
    that a create waits on is in flight on the node (here an entry in the node's real pull
    tracker standing for it), the prefetch fetches nothing; a second prefetch meanwhile
    answers "busy" (one at a time per node). Once that pull is done it gets every blob from
    the peer that holds the image (none from the registry), registers the image under the
    name creates use (a create then resolves it with no pull) and counts the bytes as
    prefetched."""
    from dsec.images.registry_ops import PULLS

    nodes += [_node(tmp_path, f"p{i}", registry, directory) for i in range(2)]
    holder, target = nodes
    resolve_or_pull(holder.store, pushed)
    before = PULLS.prefetched_bytes
    create_pull = PULLS.start("stands-for-a-create's-pull", 1, 1)
    finished = False
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(target.admin, "prefetch", {"ref": pushed})
            deadline = time.monotonic() + 30
            while not [p for p in PULLS.snapshot() if p.prefetch and p.state == "pulling"]:
                assert time.monotonic() < deadline and not fut.done(), fut.result() if fut.done() else None
                time.sleep(0.05)
            time.sleep(1.0)  # it is waiting, not fetching
            live = [p for p in PULLS.snapshot() if p.prefetch and p.state == "pulling"]
            assert len(live) == 1 and live[0].blobs_done == 0 and not fut.done(), live
            assert target.admin("prefetch", {"ref": pushed})["skipped"].startswith("busy")
            PULLS.finish(create_pull)
            finished = True
            res = fut.result(timeout=120)
    finally:
        if not finished:
            PULLS.finish(create_pull)
    assert res["skipped"] == "" and res["status"]["prefetch"] and res["status"]["state"] == "done", res
    info = holder.store.resolve(pushed)
    size = sum(li.size for li in info.layers) + holder.store.content.size(info.id)
    assert set(res["status"]["sources"]) == {"peer:p0"}, res
    assert res["status"]["sources"]["peer:p0"] == size
    assert PULLS.prefetched_bytes - before == size
    assert target.store.resolve_fast(pushed).id == info.id
    assert target.store.layers.present(info.layers[0].diff_id)  # unpacked: a create has nothing to do
    assert target.admin("prefetch", {"ref": pushed})["skipped"].startswith("already here")
    _no_partial(target.store)


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_cut_through_a_receiver_reads_a_blob_while_its_holder_still_receives_it(
        tmp_path: Path, store: ImageStore, directory: KVDirectory, registry: Registry,
        nodes: list[NodePeers]) -> None:
    """Cut-through: a node still receiving a layer (half of it written) is a partial holder;
    another node streams the layer from it at once, has the first half before the holder
    has the rest, and commits the verified layer when the holder finishes, without ever
    asking the registry. Protects: the fan-out's wall time is about one registry fetch, not
    one fetch per tree level."""
    layer = store.resolve("busybox").layers[0]
    data = store.content.path(layer.digest).read_bytes()
    half = len(data) // 2
    holder = _node(tmp_path, "h", registry, directory)
    receiver = _node(tmp_path, "r", registry, directory)
    nodes += [holder, receiver]
    got = [0]

    def progress(_label: str, n: int, _total: int) -> None:
        got[0] += n

    def no_registry() -> None:
        raise AssertionError("the receiver went to the registry")

    with holder.store.content.writer(expect=(layer.digest, layer.size)) as w:
        w.write(data[:half])
        assert directory.partial_holders(layer.digest) == ["h"]
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(receiver.fetcher.fetch, receiver.store, layer.digest, layer.size, "layer 0",
                              progress, no_registry)
            _wait(lambda: got[0] >= half or fut.done(), "the first half at the receiver")
            assert got[0] == half and not fut.done()  # it has what exists so far, and waits for the rest
            assert not holder.store.content.has(layer.digest)
            w.write(data[half:])
            w.commit(layer.digest)
            assert fut.result(timeout=30) == "peer:h"
    assert receiver.fetcher.cut_through == 1 and holder.server.stats()["served_partial"] == 1
    receiver.store.content.verify(layer.digest)
    assert directory.partial_holders(layer.digest) == []  # retracted when done
    _no_partial(receiver.store)


def test_cut_through_a_corrupt_byte_is_caught_at_the_receiver_which_falls_back(
        tmp_path: Path, store: ImageStore, registry: Registry, pushed: str, directory: KVDirectory,
        nodes: list[NodePeers]) -> None:
    """A partial holder whose incoming bytes carry one flipped byte streams them on before
    it could know: the receiver hashes what it got, refuses it (nothing renamed into its
    store, no partial file left), skips that node and takes the layer from the registry;
    a sandbox never sees the bad bytes."""
    layer = store.resolve("busybox").layers[0]
    bad = bytearray(store.content.path(layer.digest).read_bytes())
    bad[len(bad) // 3] ^= 0x01
    holder = _node(tmp_path, "h", registry, directory)
    receiver = _node(tmp_path, "r", registry, directory)
    nodes += [holder, receiver]
    with holder.store.content.writer(expect=(layer.digest, layer.size)) as w:
        w.write(bytes(bad))  # every byte there; the holder has not hashed/committed yet
        info = resolve_or_pull(receiver.store, pushed)
        assert holder.server.stats()["served_partial"] == 1
    assert "do not hash" in receiver.fetcher.skipped.get("h", ""), receiver.fetcher.skipped
    assert receiver.fetcher.registry_fetches == 2  # config + the layer, after the bad stream
    assert info.layers[0].digest == layer.digest
    receiver.store.content.verify(layer.digest)
    _no_partial(receiver.store)
    _no_partial(holder.store)


def test_forgotten_blobs_are_retracted_so_the_next_burst_fetches_each_blob_once(
        tmp_path: Path, registry: Registry, pushed: str, directory: KVDirectory, nodes: list[NodePeers]) -> None:
    """A node that deleted a blob it fetched (``forget``; GC alike) takes itself out of the
    directory at once: otherwise peers ask it, get 404, skip it for that fetch and, once
    it holds the blob again, fetch it from the registry a second time."""
    nodes += [_node(tmp_path, f"n{i}", registry, directory) for i in range(3)]
    for n in nodes:  # each fetched (and announced) every blob
        resolve_or_pull(n.store, pushed)
    info = nodes[0].store.resolve(pushed)
    for n in nodes:
        n.admin("forget", {"ref": pushed})
    for d in [info.id] + [li.digest for li in info.layers]:
        assert directory.holders(d) == [], d
    before = sum(n.fetcher.registry_fetches for n in nodes)
    barrier = threading.Barrier(len(nodes))

    def go(n: NodePeers) -> None:
        barrier.wait()
        resolve_or_pull(n.store, pushed)

    with cf.ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(go, nodes))
    assert sum(n.fetcher.registry_fetches for n in nodes) - before == 2  # config + layer, once each
