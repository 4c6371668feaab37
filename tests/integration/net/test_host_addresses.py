"""Host and node addresses are never reachable from a sandbox unless the operator opens a
specific IP:PORT (Settings.net_host_allow) — issue 18 finding 8.

Before the fix a tenant's exact entry ``HOST_IP:PORT`` opened that host listener. Now the
allow-list is refused with a 422 naming the address, and the host-side nftables rules
refuse the traffic even when a rule naming it is installed behind the validator's back.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from netlab import SERVER, Lab, all_tiers, netns_exec, tcp_probe

from dsec.config import Settings
from dsec.errors import InvalidArgument
from dsec.net import NetworkManager
from dsec.net.allowlist import parse_allow_list

pytestmark = pytest.mark.integration


def _sid() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def test_naming_a_host_address_is_refused_with_its_address(lab: Lab, host_server) -> None:
    """An allow-list naming a host address (another interface's, a slot gateway's), on
    create or update, is refused with an error naming the address; no slot is used and
    the sandbox's rules in force stay as they were."""
    port = host_server(lab.a.host_addr)
    before = set(lab.mgr._slot_of)
    for entry, addr in ((f"{lab.a.host_addr}:{port}", lab.a.host_addr), (lab.a.host_addr, lab.a.host_addr),
                        (f"{lab.mgr.ops.addr(5).gateway}:22", str(lab.mgr.ops.addr(5).gateway))):
        with pytest.raises(InvalidArgument, match=addr.replace(".", r"\.") + " is an address of the sandbox host"):
            lab.call(lab.mgr.attach(_sid(), [f"{lab.a.addr}:8000", entry]))
    assert set(lab.mgr._slot_of) == before
    sid = _sid()
    att = lab.call(lab.mgr.attach(sid, [f"{lab.a.addr}:8000"]))
    try:
        with pytest.raises(InvalidArgument, match=lab.a.host_addr.replace(".", r"\.")):
            lab.call(lab.mgr.update(sid, [f"{lab.a.host_addr}:{port}"]))
        assert lab.mgr.attachment(sid).resolved == [f"{lab.a.addr}:8000"]
        assert tcp_probe(netns_exec, att, lab.a.addr, 8000)
        assert not tcp_probe(netns_exec, att, lab.a.host_addr, port)
    finally:
        lab.call(lab.mgr.detach(sid))


@all_tiers
def test_nftables_refuses_host_addresses_even_if_listed(lab: Lab, sandboxes, sandbox_exec, host_server) -> None:
    """A real listener on a host address and on the slot's gateway stays unreachable from a
    real sandbox even when the slot's allow sets name them exactly (validation bypassed):
    the host-side rules need the operator's opening too. Refusals are logged as 'host'."""
    sid, att = sandboxes([])
    port_other = host_server(lab.a.host_addr)
    port_gw = host_server(att.gateway)
    entries = [f"{lab.a.host_addr}:{port_other}", f"{att.gateway}:{port_gw}", lab.a.host_addr, f"{lab.a.addr}:8000"]
    lab.mgr.ops.install_allow(att.slot, sid, entries, parse_allow_list(entries))
    assert tcp_probe(sandbox_exec, att, lab.a.addr, 8000)  # the installed rules are in force
    assert not tcp_probe(sandbox_exec, att, lab.a.host_addr, port_other)
    assert not tcp_probe(sandbox_exec, att, att.gateway, port_gw)
    seen = {(e.destination, e.port, e.target) for e in lab.mgr.denied_events(sid)}
    assert {(lab.a.host_addr, port_other, "host"), (att.gateway, port_gw, "host")} <= seen


# --- an operator opening: a second network manager with net_host_allow set ------------------

class Operator:
    def __init__(self, mgr: NetworkManager, host_addr: str, open_port: int, closed_port: int,
                 peer: str) -> None:
        self.mgr, self.host_addr, self.open_port, self.closed_port = mgr, host_addr, open_port, closed_port
        self.peer = peer  # a declared node address (a "cluster peer"): lab.b, TCP 8000 opened


def _serve(addr: str, port: int, procs: list[subprocess.Popen]) -> None:
    procs.append(subprocess.Popen([sys.executable, str(SERVER), "tcp", addr, str(port)]))
    for _ in range(100):
        if f"{addr}:{port} " in subprocess.run(["ss", "-ltn"], check=False, capture_output=True, text=True).stdout:
            return
        time.sleep(0.05)
    raise RuntimeError(f"host server {addr}:{port} did not start")


@pytest.fixture(scope="module")
def operator(lab: Lab) -> Iterator[Operator]:
    """A node whose operator opened lab.a.host_addr:<open_port> (a real host listener);
    <closed_port> on the same address has a listener too but is not opened. lab.b's
    range is declared as node addresses (cluster peers); lab.b.addr:8000 is opened."""
    open_port, closed_port = random.sample(range(41000, 49000), 2)
    home = Path(tempfile.mkdtemp(prefix="dsec-net-op-"))
    octet = lab.settings.net_cidr.split(".")[2]
    settings = Settings(home=home, net_cidr=f"10.252.{octet}.0/24", net_slot_pool=1,
                        net_host_allow=[f"{lab.a.host_addr}:{open_port}", f"{lab.b.addr}:8000"],
                        net_node_addresses=[lab.b.cidr])
    mgr = NetworkManager(settings)
    procs: list[subprocess.Popen] = []
    try:
        _serve(lab.a.host_addr, open_port, procs)
        _serve(lab.a.host_addr, closed_port, procs)
        lab.call(mgr.start())
        op = Operator(mgr, lab.a.host_addr, open_port, closed_port, lab.b.addr)
        yield op
    finally:
        lab.call(op.mgr.reconcile(set()))
        lab.call(op.mgr.close())
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(home, ignore_errors=True)


def test_operator_opening_reaches_exactly_that_port(lab: Lab, operator: Operator) -> None:
    """With the operator's IP:PORT opening, a sandbox naming it reaches that host listener
    and nothing else of the host; naming the same address's other port is refused (422);
    a sandbox that does not name it (even 0.0.0.0/0) cannot reach it."""
    op, mgr = operator, operator.mgr
    named, wide = _sid(), _sid()
    att = lab.call(mgr.attach(named, [f"{op.host_addr}:{op.open_port}"]))
    att_wide = lab.call(mgr.attach(wide, ["0.0.0.0/0"]))
    try:
        assert tcp_probe(netns_exec, att, op.host_addr, op.open_port)
        assert not tcp_probe(netns_exec, att, op.host_addr, op.closed_port)
        assert not tcp_probe(netns_exec, att_wide, op.host_addr, op.open_port)
        with pytest.raises(InvalidArgument, match=f"except {op.host_addr}:{op.open_port}"):
            lab.call(mgr.update(named, [f"{op.host_addr}:{op.closed_port}"]))
        # Behind the validator's back: the tenant's own exact entry is not enough.
        entries = [f"{op.host_addr}:{op.closed_port}", f"{op.host_addr}:{op.open_port}"]
        mgr.ops.install_allow(att.slot, named, entries, parse_allow_list(entries))
        assert not tcp_probe(netns_exec, att, op.host_addr, op.closed_port)
        assert tcp_probe(netns_exec, att, op.host_addr, op.open_port)
    finally:
        lab.call(mgr.detach(named))
        lab.call(mgr.detach(wide))


def test_declared_node_addresses_are_closed_like_the_host(lab: Lab, operator: Operator) -> None:
    """Addresses the operator declares as the node's (net_node_addresses, e.g. cluster
    peers) are routed, not local, yet get the host's treatment: 0.0.0.0/0 does not reach
    them (while it reaches other remotes), naming an unopened port is a 422, and the
    operator's opened IP:PORT works for a sandbox that names it."""
    op, mgr = operator, operator.mgr
    wide, named = _sid(), _sid()
    att_wide = lab.call(mgr.attach(wide, ["0.0.0.0/0"]))
    att = lab.call(mgr.attach(named, [f"{op.peer}:8000"]))
    try:
        assert tcp_probe(netns_exec, att_wide, lab.a.addr, 8000)  # an ordinary remote
        assert not tcp_probe(netns_exec, att_wide, op.peer, 8000)
        assert tcp_probe(netns_exec, att, op.peer, 8000)
        with pytest.raises(InvalidArgument, match=op.peer.replace(".", r"\.")):
            lab.call(mgr.update(named, [f"{op.peer}:22"]))
        assert any(e.destination == op.peer and e.target == "host" for e in mgr.denied_events(wide))
    finally:
        lab.call(mgr.detach(wide))
        lab.call(mgr.detach(named))


def test_restart_rewrites_wider_chains_of_adopted_slots(lab: Lab, operator: Operator) -> None:
    """A slot attached under an older rule set (here: a chain rule that accepts a host
    address outright, as the code before this fix did for exact entries) is adopted at the
    next start with this version's chains: the host listener closes again."""
    op = operator
    sid = _sid()
    att = lab.call(op.mgr.attach(sid, [f"{op.host_addr}:{op.open_port}"]))
    names, table = op.mgr.ops.names(att.slot), op.mgr.ops.params.table
    op.mgr.ops.nft.run(f"insert rule inet {table} {names.chain_in} ip daddr {op.host_addr} accept\n")
    assert tcp_probe(netns_exec, att, op.host_addr, op.closed_port)  # the old, wider rule is in force
    lab.call(op.mgr.close())  # attached slots stay for the next start
    op.mgr = NetworkManager(op.mgr.settings)
    lab.call(op.mgr.start())
    try:
        assert not tcp_probe(netns_exec, att, op.host_addr, op.closed_port)
        assert tcp_probe(netns_exec, att, op.host_addr, op.open_port)
    finally:
        lab.call(op.mgr.detach(sid))
