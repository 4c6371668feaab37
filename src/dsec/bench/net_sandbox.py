"""Sandbox networking benchmark on both isolation tiers, each against a baseline in the
same run (ratios, alternating samples: the 2-core VM is noisy).

1. create-to-first-exec with a one-entry allow-list vs. the same with ``network=None``;
2. bulk TCP throughput from inside a sandbox to an allowed destination vs. the same
   transfer from a plain namespace over a plain veth (busybox ``dd | nc``: the stock
   image has no iperf3; egress shaping off so the path, not the limit, is measured).

    sudo .venv/bin/python -m dsec.bench.net_sandbox    # JSON report (needs busybox image)

Traffic only goes to namespaces this benchmark creates (10.250.N.0/24).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec.bench.net import _remote, _sh
from dsec.config import load_settings
from dsec.images import ImageStore
from dsec.images.stock import ensure_stock
from dsec.models import ExecRequest, SandboxSpec
from dsec.node.agent import LocalNodeAgent

PORT = 5399
SHAPE: dict[str, Any] = {"cpu": 1, "memory": "512M", "disk": "64M"}


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


async def _create_first_exec(node: LocalNodeAgent, tier: str, network: list[str] | None) -> float:
    t = time.perf_counter()
    info = await node.create(SandboxSpec(image="busybox", isolation=tier, network=network,
                                         pids=1024 if tier == "gvisor" else 128, **SHAPE))
    res = await node.exec(info.id, ExecRequest(cmd=["true"]))
    dt = time.perf_counter() - t
    await node.destroy(info.id)
    assert res.exit_code == 0, res
    return dt


def _sink(rns: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(["ip", "netns", "exec", rns, "socat", "-u", f"TCP-LISTEN:{PORT},fork,reuseaddr",
                          "OPEN:/dev/null"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if f":{PORT} " in _sh("ip", "netns", "exec", rns, "ss", "-ltn").stdout:
            return p
        time.sleep(0.05)
    p.kill()
    raise RuntimeError("sink did not start")


def _send_cmd(addr: str, mib: int) -> str:
    return f"dd if=/dev/zero bs=64k count={mib * 16} 2>/dev/null | nc -w 5 {addr} {PORT}"


def _plain_send(pns: str, addr: str, mib: int) -> float:
    # Pinned to one CPU: the sandboxes are created with cpu=1, so both sides get one core.
    t = time.perf_counter()
    _sh("ip", "netns", "exec", pns, "taskset", "-c", "1", "busybox", "sh", "-c", _send_cmd(addr, mib))
    return mib * 8 * 1024 * 1024 / (time.perf_counter() - t)


async def _sandbox_send(node: LocalNodeAgent, sid: str, addr: str, mib: int) -> float:
    t = time.perf_counter()
    res = await node.exec(sid, ExecRequest(cmd=_send_cmd(addr, mib), timeout=120))
    assert res.exit_code == 0, res
    return mib * 8 * 1024 * 1024 / (time.perf_counter() - t)


def run(n: int = 8, rounds: int = 5, mib: int = 128, tiers: tuple[str, ...] = ("container", "gvisor")) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="dsec-bench-netsb-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dnb-", dir="/tmp"))
    report: dict[str, Any] = {"n": n, "rounds": rounds, "mib": mib}
    with _remote("dsbsb-r", 238) as (rns, raddr), _remote("dsbsb-p", 239) as (pns, _paddr):
        # Baseline path: a veth straight between a plain namespace and the remote.
        _sh("ip", "link", "add", "dsbsa", "netns", pns, "type", "veth", "peer", "name", "dsbsb", "netns", rns)
        _sh("ip", "netns", "exec", pns, "ip", "addr", "add", "10.250.237.1/24", "dev", "dsbsa")
        _sh("ip", "netns", "exec", rns, "ip", "addr", "add", "10.250.237.2/24", "dev", "dsbsb")
        _sh("ip", "netns", "exec", pns, "ip", "link", "set", "dsbsa", "up")
        _sh("ip", "netns", "exec", rns, "ip", "link", "set", "dsbsb", "up")
        settings = load_settings(home=home, run_dir=run_dir, layer_compression="tar",
                                 net_cidr="10.251.238.0/24", net_slot_pool=4, net_egress_rate="0")
        store = ImageStore(home / "images", settings)
        ensure_stock(store, only=["busybox"], log=lambda _: None)
        node = LocalNodeAgent(settings, images=store)
        sink = _sink(rns)

        async def main() -> None:
            await node.start()
            try:
                allow = [f"{raddr}:{PORT}"]
                for tier in tiers:
                    await _create_first_exec(node, tier, None)  # warm caches, not timed
                    await _create_first_exec(node, tier, allow)
                    off, on = [], []
                    for _ in range(n):
                        off.append(await _create_first_exec(node, tier, None))
                        await asyncio.sleep(0.2)  # let the slot pool refill (as between real creates)
                        on.append(await _create_first_exec(node, tier, allow))
                    info = await node.create(SandboxSpec(image="busybox", isolation=tier, network=allow,
                                                         pids=1024 if tier == "gvisor" else 128, **SHAPE))
                    sb, plain = [], []
                    for _ in range(rounds):
                        sb.append(await _sandbox_send(node, info.id, raddr, mib))
                        plain.append(await asyncio.to_thread(_plain_send, pns, "10.250.237.2", mib))
                    await node.destroy(info.id)
                    report[tier] = {
                        "create_first_exec_network_none_ms": _median_ms(off),
                        "create_first_exec_allow_list_ms": _median_ms(on),
                        "create_ratio": round(statistics.median(on) / statistics.median(off), 3),
                        "sandbox_mbps": round(statistics.median(sb) / 1e6, 1),
                        "plain_veth_mbps": round(statistics.median(plain) / 1e6, 1),
                        "throughput_ratio": round(statistics.median(sb) / statistics.median(plain), 3),
                    }
            finally:
                await node.close()

        try:
            asyncio.run(main())
        finally:
            sink.kill()
            sink.wait()
            shutil.rmtree(run_dir, ignore_errors=True)
    return report


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
