"""Networking benchmark: slot-pool attach vs. bare netns creation, and throughput
through the policy path vs. a plain veth, each against its baseline in the same run.

    sudo .venv/bin/python -m dsec.bench.net        # prints a JSON report

Traffic only goes to network namespaces this benchmark creates (10.250.N.0/24 "remote"
plus a sandbox slot), never outside the machine.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsec.config import Settings
from dsec.net import NetworkManager


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"n": len(s), "p50_ms": round(statistics.median(s) * 1e3, 3),
            "p95_ms": round(s[int(0.95 * (len(s) - 1))] * 1e3, 3), "mean_ms": round(statistics.fmean(s) * 1e3, 3)}


@contextmanager
def _remote(name: str, octet: int) -> Iterator[tuple[str, str]]:
    """A namespace linked to the host by a veth: (netns name, its address)."""
    host_if = f"{name}h"
    _sh("ip", "netns", "add", name)
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", name)
        _sh("ip", "addr", "add", f"10.250.{octet}.1/24", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        for cmd in (["ip", "addr", "add", f"10.250.{octet}.2/24", "dev", "eth0"],
                    ["ip", "link", "set", "eth0", "up"], ["ip", "link", "set", "lo", "up"]):
            _sh("ip", "netns", "exec", name, *cmd)
        yield name, f"10.250.{octet}.2"
    finally:
        _sh("ip", "link", "del", host_if, check=False)
        _sh("ip", "netns", "del", name, check=False)


def _iperf(server_ns: str, server_addr: str, client_prefix: list[str], seconds: float) -> float:
    srv = subprocess.Popen(["ip", "netns", "exec", server_ns, "iperf3", "-s", "-1", "-B", server_addr,
                            "-p", "5299"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if ":5299 " in _sh("ip", "netns", "exec", server_ns, "ss", "-ltn").stdout:
                break
            time.sleep(0.05)
        out = _sh(*client_prefix, "iperf3", "-c", server_addr, "-p", "5299", "-t", str(seconds), "-J").stdout
        return float(json.loads(out)["end"]["sum_received"]["bits_per_second"])
    finally:
        srv.kill()
        srv.wait()


def _bare_netns(n: int) -> list[float]:
    """Baseline: what a runtime pays for an empty netns (`unshare --net true`)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        _sh("unshare", "--net", "true")
        out.append(time.perf_counter() - t)
    return out


async def _attach_latencies(mgr: NetworkManager, allow: list[str], n: int, pool: int) -> dict[str, Any]:
    warm, cold = [], []
    for i in range(n):
        while len(mgr._ready) < pool:  # let the background filler catch up (not timed)
            await asyncio.sleep(0.01)
        t = time.perf_counter()
        await mgr.attach(f"bench-warm-{i}", allow)
        warm.append(time.perf_counter() - t)
        await mgr.detach(f"bench-warm-{i}")
    mgr.settings.net_slot_pool = 0  # pool off: every attach builds its slot inline
    while mgr._ready:
        idx = mgr._ready.popleft()
        await asyncio.to_thread(mgr.ops.destroy, idx)
    for i in range(max(5, n // 3)):
        t = time.perf_counter()
        await mgr.attach(f"bench-cold-{i}", allow)
        cold.append(time.perf_counter() - t)
        await mgr.detach(f"bench-cold-{i}")
    return {"attach_from_pool": _stats(warm), "attach_cold_build": _stats(cold)}


def _throughput(report: dict[str, Any], sandbox: list[str], rns: str, raddr: str, pns: str,
                rounds: int, seconds: float) -> None:
    """Alternate policy-path and plain-veth iperf3 runs (the 2-core VM is noisy) and
    keep the median of each."""
    # Baseline: a plain veth straight between two namespaces, no routing, no nft.
    _sh("ip", "link", "add", "dsbpa", "netns", pns, "type", "veth", "peer", "name", "dsbpb", "netns", rns)
    _sh("ip", "netns", "exec", pns, "ip", "addr", "add", "10.250.243.1/24", "dev", "dsbpa")
    _sh("ip", "netns", "exec", rns, "ip", "addr", "add", "10.250.243.2/24", "dev", "dsbpb")
    _sh("ip", "netns", "exec", pns, "ip", "link", "set", "dsbpa", "up")
    _sh("ip", "netns", "exec", rns, "ip", "link", "set", "dsbpb", "up")
    policy, plain = [], []
    for _ in range(rounds):
        policy.append(_iperf(rns, raddr, sandbox, seconds))
        plain.append(_iperf(rns, "10.250.243.2", ["ip", "netns", "exec", pns], seconds))
    report["policy_path_bps"] = statistics.median(policy)
    report["plain_veth_bps"] = statistics.median(plain)
    report["throughput_samples_gbps"] = {"policy": [round(x / 1e9, 2) for x in policy],
                                         "plain_veth": [round(x / 1e9, 2) for x in plain]}


def run(n: int = 30, seconds: float = 2.0, rounds: int = 3) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-net-"))
    report: dict[str, Any] = {}
    with _remote("dsbench-r", 241) as (rns, raddr), _remote("dsbench-p", 242) as (pns, _paddr):
        settings = Settings(home=home, net_cidr="10.251.241.0/24", net_slot_pool=4, net_egress_rate="0")
        mgr = NetworkManager(settings)

        async def main() -> None:
            await mgr.start()
            try:
                report.update(await _attach_latencies(mgr, [f"{raddr}:5299"], n, 4))
                att = await mgr.attach("bench-tput", [f"{raddr}:5299"])
                await asyncio.to_thread(_throughput, report, ["nsenter", f"--net={att.netns_path}"],
                                        rns, raddr, pns, rounds, seconds)
                await mgr.detach("bench-tput")
            finally:
                await mgr.reconcile(set())
                await mgr.close()

        asyncio.run(main())
        report["bare_unshare_netns"] = _stats(_bare_netns(n))
    report["attach_pool_vs_bare_netns"] = round(
        report["attach_from_pool"]["p50_ms"] / report["bare_unshare_netns"]["p50_ms"], 3)
    report["throughput_ratio"] = round(report["policy_path_bps"] / report["plain_veth_bps"], 3)
    return report


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
