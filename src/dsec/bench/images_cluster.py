"""``dsec bench images-cluster``: 5 nodes start the same image at once, registry link shaped.

Setup (as root; everything created here is removed at the end, processes by PID):

- a network namespace ``dsec-breg-<pid>`` with a veth pair to the host
  (10.251.X.1 host side / 10.251.X.2 inside); the real docker-registry runs inside it on
  10.251.X.2:5000, and the registry's side of the veth is shaped to 1 Gbit/s with
  ``tc qdisc ... tbf`` (what leaves the registry: the blobs nodes pull);
- the stock python image (3 layers) pushed there;
- a local Ray cluster of ``--nodes`` (5) DSec nodes (`dsec cluster up`), empty stores,
  ``DSEC_IMAGE_REGISTRY`` = that registry (``registry_insecure``: plain http off loopback).

Measured, in the same run (and cluster):

1. **all from the registry**: every node pulls the image at once with peers off;
2. **with peers**: the same with peer-to-peer on (one registry fetch per blob, a tree),
   cut-through on (a node serves a blob while still receiving it);
3. **with peers, store-and-forward**: the same with cut-through off (a node serves a
   blob only once it holds all of it): what cut-through buys, in the same run;
   for each: wall time until every node holds every blob (verified), the bytes the
   registry sent (tx counter of its veth end, so HTTP/TCP overhead included), and each
   node's per-blob timeline (source, start, seconds);
4. **cold node create -> first exec** through a node agent: the image on no node (pull
   from the registry), then on a second node while the first holds it (pull from the
   peer); pull time reported apart (the node's own pull record), then unpack + create +
   exec;
5. with ``--prefetch`` (3+ nodes): a third node gets the image by the prefetch path the
   scheduler leader uses (``p2p_admin("prefetch")``: peers first, one blob at a time,
   registered and unpacked), timed apart; then create -> first exec there, which finds
   the image present (the same measure as 4., with the prefetch done before the create).

Between phases each node forgets the image (blobs, unpacked layers), so every phase
starts cold.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from dsec.config import get_settings


def _sh(*args: str, ns: str | None = None, check: bool = True) -> str:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {r.returncode}: {r.stderr.strip()}")
    return r.stdout


class ShapedRegistry:
    """docker-registry in its own netns behind a veth shaped to ``rate`` (tbf)."""

    def __init__(self, work: Path, rate: str = "1gbit") -> None:
        pid = os.getpid()
        self.ns = f"dsec-breg-{pid}"
        self.host_if, self.ns_if = f"dbr{pid % 100000}h", f"dbr{pid % 100000}n"
        x = pid % 250
        self.host_ip, self.reg_ip = f"10.251.{x}.1", f"10.251.{x}.2"
        self.host = f"{self.reg_ip}:5000"
        self.proc: subprocess.Popen[bytes] | None = None
        self.rate = rate
        _sh("ip", "netns", "add", self.ns)
        try:
            _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _sh("ip", "link", "set", self.ns_if, "netns", self.ns)
            _sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _sh("ip", "link", "set", self.host_if, "up")
            _sh("ip", "addr", "add", f"{self.reg_ip}/30", "dev", self.ns_if, ns=self.ns)
            _sh("ip", "link", "set", self.ns_if, "up", ns=self.ns)
            _sh("ip", "link", "set", "lo", "up", ns=self.ns)
            # What leaves the registry (blobs to the nodes) is shaped: the registry's link.
            _sh("tc", "qdisc", "add", "dev", self.ns_if, "root", "tbf", "rate", rate, "burst", "1mb",
                "latency", "50ms", ns=self.ns)
            cfg = {"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
                   "storage": {"filesystem": {"rootdirectory": str(work / "registry")}},
                   "http": {"addr": self.host, "secret": os.urandom(8).hex()}}
            (work / "registry.yml").write_text(yaml.safe_dump(cfg))
            self._log = open(work / "registry.log", "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, "docker-registry", "serve",
                                          str(work / "registry.yml")], stdout=self._log, stderr=subprocess.STDOUT)
            import httpx
            deadline = time.monotonic() + 20
            while True:
                try:
                    httpx.get(f"http://{self.host}/v2/", timeout=1)
                    break
                except httpx.TransportError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("docker-registry did not start: "
                                           + (work / "registry.log").read_text()[-1000:]) from None
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def tx_bytes(self) -> int:
        return int(_sh("cat", f"/sys/class/net/{self.ns_if}/statistics/tx_bytes", ns=self.ns).strip())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        _sh("ip", "link", "del", self.host_if, check=False)  # removes both ends
        _sh("ip", "netns", "del", self.ns, check=False)


def _admin(handles: dict[str, Any], op: str, args: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    import ray

    from dsec.cluster.ray import NodeCallError

    out = dict(zip(handles, ray.get([h.p2p_admin.remote(op, args) for h in handles.values()], timeout=timeout),
                   strict=True))
    for r in out.values():
        if isinstance(r, NodeCallError):
            raise r.error()  # the node's DSecError, naming it
    return out


def _phase(reg: ShapedRegistry, handles: dict[str, Any], ref: str, peers: bool,
           cut_through: bool = True) -> dict[str, Any]:
    _admin(handles, "forget", {"ref": ref})
    os.sync()
    b0 = reg.tx_bytes()
    start = time.time()
    t0 = time.perf_counter()
    res = _admin(handles, "pull", {"ref": ref, "unpack": False, "peers": peers, "cut_through": cut_through})
    wall = time.perf_counter() - t0
    sent = reg.tx_bytes() - b0
    per = {nid: {"seconds": round(r["seconds"], 3), "sources": (r["status"] or {}).get("sources", {})}
           for nid, r in res.items()}
    out = {"wall_s": round(wall, 3), "registry_tx_bytes": sent, "load_avg_1m": round(os.getloadavg()[0], 2),
           "nodes": per}
    if peers:  # per node, per blob: where from, when it started (s after the phase began), how long
        for nid, st in _admin(handles, "stats", {}).items():
            per[nid]["timeline"] = [{"blob": x["digest"][:19], "source": x["source"],
                                     "start_s": round(x["start"] - start, 3), "seconds": x["seconds"]}
                                    for x in st["timeline"] if x["start"] >= start - 0.5]
    return out


def _cold_create(handles: dict[str, Any], address: str, ref: str, prefetch: bool = False) -> dict[str, Any]:
    """create -> first exec on a node without the image: first with the image on no node
    (pull from the registry), then on another node while the first holds it (peer)."""
    import asyncio

    from dsec.cluster.ray import RayNodeProxy
    from dsec.models import ExecRequest, SandboxSpec

    _admin(handles, "forget", {"ref": ref})
    out: dict[str, Any] = {}

    async def one(nid: str) -> dict[str, Any]:
        p = RayNodeProxy(nid, handles[nid], 900)
        await p.start()
        t0 = time.perf_counter()
        info = await p.create(SandboxSpec(image=ref, cpu=0.5, memory="256M", disk="256M"))
        t1 = time.perf_counter()
        r = await p.exec(info.id, ExecRequest(cmd=["python3", "-c", "print(1)"]))
        t2 = time.perf_counter()
        assert r.exit_code == 0, r
        # The create's own pull (a prefetch before it is reported apart, by the caller).
        pulls = [x for x in (await p.health()).pulls
                 if ref.split(":")[0] in x.ref and x.state == "done" and not x.prefetch]
        await p.destroy(info.id)
        fetch_s = pulls[-1].fetch_seconds if pulls else None
        pull_s = pulls[-1].seconds if pulls else None
        return {"create_s": round(t1 - t0, 3), "first_exec_s": round(t2 - t1, 3),
                "create_to_first_exec_s": round(t2 - t0, 3), "pull_fetch_s": fetch_s,
                "pull_with_unpack_s": pull_s,
                "unpack_s": round(pull_s - fetch_s, 3) if pull_s is not None and fetch_s is not None else None,
                "create_after_pull_s": round(t1 - t0 - pull_s, 3) if pull_s is not None else None,
                "pull_sources": pulls[-1].sources if pulls else {}}

    nodes = sorted(handles)
    out["from_registry"] = asyncio.run(one(nodes[0]))
    out["from_peer"] = asyncio.run(one(nodes[1]))
    if prefetch:
        target = nodes[2]
        t0 = time.perf_counter()
        res = _admin({target: handles[target]}, "prefetch", {"ref": ref})[target]
        pre_s = time.perf_counter() - t0
        status = res.get("status") or {}
        out["after_prefetch"] = {**asyncio.run(one(target)), "prefetch_s": round(pre_s, 3),
                                 "prefetch_sources": status.get("sources", {}),
                                 "prefetch_fetch_s": status.get("fetch_seconds"),
                                 "note": "the prefetch ran before the create, in the background; the create "
                                         "pulled nothing (pull_* None)"}
    return out


def run(report_dir: Path | str = "reports", nodes: int = 5, rate: str = "1gbit", rounds: int = 1,
        image: str = "python", node_tmpfs: str = "", prefetch: bool = False) -> dict[str, Any]:
    """``node_tmpfs`` (e.g. ``4g``): the nodes' homes on a tmpfs the bench mounts. On one
    box every "node" otherwise writes to the same disk, and that disk (not the registry
    link) can be what limits both phases; real nodes each have their own."""
    from dsec.cluster import local
    from dsec.cluster.ray import connect, get_agent
    from dsec.images import ImageStore
    from dsec.images.registry_ops import push
    from dsec.images.stock import ensure_stock

    if prefetch and nodes < 3:
        raise SystemExit("--prefetch needs 3 nodes or more (registry, peer, prefetched)")
    if os.geteuid() != 0:
        raise SystemExit("dsec bench images-cluster needs root (network namespace, tc, cgroups)")
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    s = get_settings()
    src = ImageStore(s.home / "images", s)
    ensure_stock(src, [image], log=lambda m: print(m, file=sys.stderr))
    info = src.resolve(image)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-icl-", dir=s.home))
    reg = ShapedRegistry(work, rate)
    base = work / "cluster"
    mounted = False
    if node_tmpfs:
        base.mkdir()
        _sh("mount", "-t", "tmpfs", "-o", f"size={node_tmpfs}", "dsec-bench-nodes", str(base))
        mounted = True
    saved = {k: os.environ.get(k) for k in ("DSEC_IMAGE_REGISTRY", "DSEC_REGISTRY_INSECURE")}
    result: dict[str, Any] = {}
    try:
        ref = f"bench/{image}:latest"
        push(src, image, f"{reg.host}/{ref}", insecure=True)
        os.environ.update({"DSEC_IMAGE_REGISTRY": reg.host, "DSEC_REGISTRY_INSECURE": "true"})
        t0 = time.perf_counter()
        c = local.up(base, nodes, [], timeout_s=900, log=lambda m: print(m, file=sys.stderr))
        up_s = time.perf_counter() - t0
        connect(c.address)
        handles = {n.node_id: get_agent(n.node_id) for n in c.nodes}
        image_bytes = info.size + src.content.size(info.id)
        rounds_out = []
        phases = {"registry_only": (False, True), "with_peers": (True, True),
                  "with_peers_store_forward": (True, False)}
        for r in range(rounds):
            order = list(phases) if r % 2 == 0 else list(reversed(phases))
            one = {k: _phase(reg, handles, ref, *phases[k]) for k in order}
            rounds_out.append(one)
            print(json.dumps({k: {"wall_s": v["wall_s"], "registry_tx_bytes": v["registry_tx_bytes"]}
                              for k, v in one.items()}), file=sys.stderr)
        cold = _cold_create(handles, c.address, ref, prefetch)
        stats = _admin(handles, "stats", {})

        def med(key: str, field: str) -> float:
            if not rounds_out:  # --rounds 0: the cold creates only
                return float("nan")
            return float(statistics.median(x[key][field] for x in rounds_out))

        result = {
            "image": image, "image_bytes": image_bytes, "layers": len(info.layers), "nodes": nodes,
            "registry_link": f"tbf {rate} on the registry's veth (its netns)", "cluster_up_s": round(up_s, 1),
            "node_stores": f"tmpfs {node_tmpfs}" if node_tmpfs else "the host's disk (shared by every node)",
            "rounds": rounds_out,
            "registry_bytes_ratio_with_peers": round(med("with_peers", "registry_tx_bytes") / image_bytes, 3),
            "registry_bytes_ratio_registry_only": round(med("registry_only", "registry_tx_bytes") / image_bytes, 3),
            "wall_ratio_peers_vs_registry_only": round(med("with_peers", "wall_s") / med("registry_only", "wall_s"),
                                                       3),
            "wall_ratio_store_forward_vs_registry_only": round(
                med("with_peers_store_forward", "wall_s") / med("registry_only", "wall_s"), 3),
            "cold_create": cold,
            "blob_endpoints": {n: v["server"] for n, v in stats.items()},
            "load_avg_1m": os.getloadavg()[0],
            "targets": {"registry_bytes_ratio_with_peers": "<= 1.3", "wall_ratio_peers_vs_registry_only": "<= 0.5"},
            "notes": "pulls without unpack (every blob verified and in each node's store); registry bytes are the tx "
                     "counter of the registry's veth end (HTTP/TCP overhead included). cold_create: through a node "
                     "agent (Ray), pull time from the node's own pull record, then unpack + create.",
        }
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            local.down(base, log=lambda m: print(m, file=sys.stderr))
        finally:
            reg.stop()
            if mounted:
                _sh("umount", "-l", str(base), check=False)
            shutil.rmtree(work, ignore_errors=True)
    result = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}  # no rounds
    (report_dir / "images-cluster.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "reports"), indent=2))
