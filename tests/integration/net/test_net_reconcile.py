"""Crash safety: a node process SIGKILLed at any step of building, attaching or
detaching a slot leaves nothing behind once a new manager has started and reconciled;
slots of sandboxes that survived keep working and are re-adopted."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from netlab import Lab, netns_exec, tcp_probe

from dsec.config import Settings
from dsec.net import NetworkManager
from dsec.net.faults import ENV, POINTS

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    from dsec.config import Settings
    from dsec.net import NetworkManager
    home, cidr, mode, allow = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    async def main():
        m = NetworkManager(Settings(home=home, net_cidr=cidr, net_slot_pool=0))
        await m.start()
        if mode == "survivors":
            await m.attach("keep", [allow])
            await m.attach("gone", [allow])
            os.kill(os.getpid(), signal.SIGKILL)
        fault = os.environ.pop("DSEC_NET_FAULT")
        await m.attach("warm", [allow])  # a healthy neighbour, built without faults
        os.environ["DSEC_NET_FAULT"] = fault
        await m.attach("victim", [allow])
        await m.detach("victim")
        print("fault point not reached", file=sys.stderr)
    asyncio.run(main())
""")


def _leftovers(mgr: NetworkManager) -> dict[str, object]:
    ops = mgr.ops
    inv = ops.inventory()
    return {"slots": sorted(inv.indices), "links": sorted(inv.links), "netns": sorted(inv.netns),
            "nft": sorted(inv.nft_present), "records": sorted(ops.records.load_all())}


def _run_child(home: Path, cidr: str, mode: str, allow: str, fault: str | None) -> int:
    env = dict(os.environ)
    if fault:
        env[ENV] = fault
    return subprocess.run([sys.executable, "-c", CHILD, str(home), cidr, mode, allow], env=env, check=False,
                          timeout=60).returncode


@pytest.fixture
def crash_home() -> Iterator[Path]:
    home = Path(tempfile.mkdtemp(prefix="dsec-net-crash-"))
    yield home
    shutil.rmtree(home, ignore_errors=True)  # empty dirs once reconciled (each run left 11)


@pytest.mark.parametrize("point", POINTS)
def test_kill_at_fault_point_then_reconcile(lab: Lab, crash_home: Path, point: str) -> None:
    """SIGKILL at ``point``; a restarted manager's start() + reconcile(no live) leaves
    no veth, IFB, netns file, nft object or record of the dead process."""
    cidr = f"10.252.{int(lab.a.addr.split('.')[2])}.0/26"
    rc = _run_child(crash_home, cidr, "fault", f"{lab.a.addr}:8000", point)
    assert rc == -9, f"child did not die at {point} (rc={rc})"
    loop = asyncio.new_event_loop()
    mgr = NetworkManager(Settings(home=crash_home, net_cidr=cidr, net_slot_pool=0))
    try:
        loop.run_until_complete(mgr.start())
        cleaned = loop.run_until_complete(mgr.reconcile(set()))
        assert cleaned > 0
        assert _leftovers(mgr) == {"slots": [], "links": [], "netns": [], "nft": [], "records": []}
    finally:
        loop.run_until_complete(mgr.close())
        loop.close()
    tables = subprocess.run(["nft", "list", "tables"], check=False, capture_output=True, text=True).stdout
    assert f"dsec_{mgr_tag(crash_home)}" not in tables


def mgr_tag(home: Path) -> str:
    from dsec.net.alloc import instance_tag

    return instance_tag(str((home / "run").resolve()))


def test_survivor_is_adopted_others_removed(lab: Lab, crash_home: Path) -> None:
    """After a crash, reconcile({'keep'}) keeps that sandbox's network working (and
    updatable), and removes the dead sandbox's."""
    cidr = f"10.252.{int(lab.a.addr.split('.')[2])}.64/26"
    assert _run_child(crash_home, cidr, "survivors", f"{lab.a.addr}:8000", None) == -9
    loop = asyncio.new_event_loop()
    mgr = NetworkManager(Settings(home=crash_home, net_cidr=cidr, net_slot_pool=0))
    try:
        loop.run_until_complete(mgr.start())
        assert loop.run_until_complete(mgr.reconcile({"keep"})) > 0
        left = _leftovers(mgr)
        assert len(left["slots"]) == 1 and len(left["netns"]) == 1
        att = loop.run_until_complete(mgr.update("keep", [f"{lab.a.addr}:8000"]))
        assert tcp_probe(netns_exec, att, lab.a.addr, 8000)
        assert not tcp_probe(netns_exec, att, lab.a.addr, 8001)
        loop.run_until_complete(mgr.detach("keep"))
        loop.run_until_complete(mgr.detach("keep"))  # idempotent
        assert _leftovers(mgr)["slots"] == []
    finally:
        loop.run_until_complete(mgr.reconcile(set()))
        loop.run_until_complete(mgr.close())
        loop.close()
