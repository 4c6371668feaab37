"""Sandbox networking: per-sandbox netns + veth from a pre-built slot pool, egress
allow-lists enforced by nftables in the host namespace. See docs/network.md."""

from dsec.net.manager import NetworkManager
from dsec.net.models import DeniedAttempt, NetAttachment

__all__ = ["DeniedAttempt", "NetAttachment", "NetworkManager"]
