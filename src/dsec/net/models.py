"""Results of the network manager (pydantic, so they travel over any NodeAgent transport)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class NetAttachment(BaseModel):
    """What the runtime needs to put a sandbox on its network slot."""

    netns_path: str = Field(description="Bind-mounted netns: OCI linux.namespaces network path")
    address: str = Field(description="Sandbox IPv4 address (eth0 inside the netns)")
    gateway: str = Field(description="Host side of the veth; the sandbox's default route")
    resolved: list[str] = Field(default_factory=list,
                                description="Canonical allow rules in force (host names pinned to IPs)")
    hosts: dict[str, list[str]] = Field(default_factory=dict,
                                        description="Pinned name -> IPs; write these into /etc/hosts")
    mac: str = ""
    host_if: str = ""
    slot: int = -1


class DeniedAttempt(BaseModel):
    """One refused packet from a sandbox (for its audit log)."""

    time: float = Field(description="Unix time the node read the record")
    destination: str
    protocol: str = Field(description="tcp, udp, icmp or the IP protocol number")
    port: int | None = None
    target: Literal["remote", "host"] = Field(description="host = one of the node's own addresses")
    seq: int = Field(0, description="Increases with every attempt the node records (resume point for readers)")
