"""Egress allow-lists through the SDK/API with real sandboxes and real network slots."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from e2e_server import Server, running_server

from dsec.errors import InvalidArgument
from dsec.sdk import Client, Sandbox

pytestmark = pytest.mark.integration

DISTINCT = 2  # denied destinations itemized per sandbox (small, to see the bound)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "dsec-home", {"DSEC_NET_DENIED_AUDIT_DISTINCT": str(DISTINCT),
                                                        "DSEC_NET_DENIED_AUDIT_POLL_S": "0.5"}) as srv:
        yield srv


@pytest.mark.parametrize("isolation", ["container", pytest.param("gvisor", marks=pytest.mark.gvisor)])
def test_allow_list_is_set_and_updated_live(server: Server, isolation: str) -> None:
    """A sandbox created with an allow-list gets an interface (on both tiers) and its list
    can be replaced through sb.network.update; a sandbox without network refuses updates
    with a clear error."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", cpu=1, memory="256M", network=[], isolation=isolation,
                            client=c) as sb:
            out = sb.exec("ip -4 addr show eth0").stdout
            assert "inet 10." in out  # a slot address from the private range
            info = sb.network.update(["10.250.9.9:80"])
            assert info.network == ["10.250.9.9:80"]
            assert c.get(sb.id).network == ["10.250.9.9:80"]
            kinds = [e.kind for e in c.audit(sb.id)]
            assert "network_update" in kinds
        with Sandbox.create(image="busybox", cpu=1, memory="256M", client=c) as off:
            assert "eth0" not in off.exec("ip link").stdout  # network=None: loopback only
            with pytest.raises(InvalidArgument, match="network=None"):
                off.network.update(["10.250.9.9:80"])


def _denied(c: Client, sid: str, kind: str = "network_denied") -> list:
    return [e for e in c.audit(sid) if e.kind == kind]


def test_denied_attempts_reach_the_audit_log(server: Server) -> None:
    """Connections refused by the allow-list land in the sandbox's audit log while it
    lives (destination, port, time; the first DISTINCT destinations itemized) and a
    summary with the counts lands at teardown; `dsec logs` shows them."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", cpu=1, memory="256M", network=[], client=c) as sb:
            sid = sb.id
            route = sb.exec("ip route").stdout
            gw = next(line.split()[2] for line in route.splitlines() if line.startswith("default via"))
            t0 = time.time()
            # The gateway is the node itself: refused (host services), nothing leaves the machine.
            r = sb.exec(f"for p in 9 9 9 10 11; do nc -w 1 {gw} $p </dev/null; done; echo done")
            assert r.stdout.strip() == "done"
            itemized = _denied(c, sid)  # a read pulls the node's records at once
            assert [(e.data["destination"], e.data["port"], e.data["protocol"]) for e in itemized] == [
                (gw, 9, "tcp"), (gw, 10, "tcp")]
            assert all(e.data["target"] == "host" and e.data["time"] >= t0 - 1 for e in itemized)
        summary = _denied(c, sid, "network_denied_summary")
        assert len(summary) == 1
        d = summary[0].data
        assert (d["total"], d["destinations"], d["not_itemized"]) == (5, DISTINCT, 1)
        assert [(x["port"], x["count"]) for x in d["counts"]] == [(9, 3), (10, 1)]
        assert len(_denied(c, sid)) == DISTINCT  # teardown re-read did not duplicate
    out = server.cli("logs", sid).stdout
    assert "network_denied" in out and gw in out


def test_cli_shows_and_updates_the_allow_list(server: Server) -> None:
    """`dsec run --allow` opens a destination; `dsec network ID` shows the list, replaces
    it live (--allow) and closes everything (--deny-all)."""
    import json

    r = server.cli("run", "busybox", "--allow", "10.250.9.9:80", "--keep", "--json", "--", "true")
    sid = json.loads(r.stdout)["sandbox_id"]
    try:
        assert json.loads(server.cli("network", sid, "--json").stdout)["network"] == ["10.250.9.9:80"]
        assert json.loads(server.cli("network", sid, "--allow", "10.250.9.10:443", "--json").stdout)[
            "network"] == ["10.250.9.10:443"]
        assert "nothing allowed" in server.cli("network", sid, "--deny-all").stdout
    finally:
        server.cli("kill", sid)
