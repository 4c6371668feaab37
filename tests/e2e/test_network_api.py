"""Egress allow-lists through the SDK/API with real sandboxes and real network slots."""

from __future__ import annotations

import pytest
from e2e_server import Server

from dsec.errors import InvalidArgument
from dsec.sdk import Client, Sandbox

pytestmark = pytest.mark.integration


def test_allow_list_is_set_and_updated_live(server: Server) -> None:
    """A sandbox created with an allow-list gets an interface and its list can be replaced
    through sb.network.update; a sandbox without network refuses updates with a clear error."""
    with Client(server.url, server.token) as c:
        with Sandbox.create(image="busybox", cpu=1, memory="256M", network=[], client=c) as sb:
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
