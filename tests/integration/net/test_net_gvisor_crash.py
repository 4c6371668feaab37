"""Crash safety of a gVisor sandbox with a network: a node agent SIGKILLed while it
creates one (runsc and its netstack wrapper half-way) leaves nothing once a new agent
has started: no runsc process, no helper mount, no slot (veth, netns, nft), no dirs."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from netlab import Lab

from dsec.config import load_settings
from dsec.images import ImageStore
from dsec.models import ExecRequest
from dsec.node.agent import LocalNodeAgent

pytestmark = [pytest.mark.integration, pytest.mark.gvisor]

CHILD = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from dsec.config import load_settings
    from dsec.images import ImageStore
    from dsec.models import SandboxSpec
    from dsec.node.agent import LocalNodeAgent
    home, run_dir, images, cidr, allow = sys.argv[1:6]
    async def main():
        s = load_settings(home=home, run_dir=run_dir, layer_compression="tar", net_cidr=cidr, net_slot_pool=0)
        node = LocalNodeAgent(s, images=ImageStore(Path(images), s))
        await node.start()
        print("creating sb-crashgv01", flush=True)
        await node.create(SandboxSpec(image="busybox", isolation="gvisor", network=[allow], cpu=0.5,
                                      memory="256M", disk="64M", pids=1024), sandbox_id="sb-crashgv01")
        print("created", flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")
SID = "sb-crashgv01"


def _traces(sid: str) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                if sid.encode() in (d / "cmdline").read_bytes():
                    out.append(f"process {d.name}")
                if "dsec-netstack" in (d / "mountinfo").read_text():
                    out.append(f"helper mount in {d.name}")
            except OSError:
                continue
    return out


@pytest.mark.parametrize("delay", [0.15, 0.6])
def test_kill_mid_gvisor_network_create_then_restart(lab: Lab, real_node: LocalNodeAgent, delay: float) -> None:
    """SIGKILL the node ``delay`` s into the create (early: slot/wrapper/runsc starting;
    late: usually created). The restarted node adopts a healthy sandbox (exec and its
    network work) or cleans it; after destroy + close nothing of it is left."""
    home = Path(tempfile.mkdtemp(prefix="dsec-net-gvcrash-"))
    run_dir = Path(tempfile.mkdtemp(prefix="dgc-", dir="/tmp"))
    images = real_node.settings.home / "images"
    cidr = f"10.252.{lab.a.addr.split('.')[2]}.128/26"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(home), str(run_dir), str(images), cidr,
                              f"{lab.a.addr}:8000"], stdout=subprocess.PIPE, text=True)
    loop = asyncio.new_event_loop()
    node = None
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("creating"), "child did not start"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)  # by PID: our own child
        child.wait()
        settings = load_settings(home=home, run_dir=run_dir, layer_compression="tar", net_cidr=cidr,
                                 net_slot_pool=0)
        node = LocalNodeAgent(settings, images=ImageStore(images, settings))
        loop.run_until_complete(node.start())
        if SID in node.manager.live:  # adopted: it must really work
            r = loop.run_until_complete(node.exec(SID, ExecRequest(
                cmd=["busybox", "nc", "-w", "2", lab.a.addr, "8000"], timeout=10)))
            assert "ok" in r.stdout, r
            loop.run_until_complete(node.destroy(SID))
        else:
            assert _traces(SID) == []
        net = node.network
        loop.run_until_complete(node.close())
        node = None
        assert _traces(SID) == []
        assert not node_dirs(home, SID)
        if net is not None:
            inv = net_inventory(settings)
            assert inv == {"slots": [], "links": [], "netns": [], "nft": []}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if node is not None:
            loop.run_until_complete(node.close())
        loop.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def node_dirs(home: Path, sid: str) -> list[Path]:
    return [p for p in (home / "sandboxes" / sid,) if p.exists()]


def net_inventory(settings) -> dict[str, list]:
    """Kernel objects of this node's network tag (a fresh SlotOps only reads them)."""
    from dsec.net.slots import SlotOps

    ops = SlotOps(settings)
    try:
        inv = ops.inventory()
        return {"slots": sorted(inv.indices), "links": sorted(inv.links), "netns": sorted(inv.netns),
                "nft": sorted(inv.nft_present)}
    finally:
        ops.close()
