"""Identifiers minted by more than one layer (node agent, API service, episode book).

Kept in this leaf module (stdlib only) so the node and the API import the same function
instead of each keeping a copy that drifts (they had: 12 vs 16 hex digits)."""

from __future__ import annotations

import secrets

SANDBOX_ID_PREFIX = "sb-"


def new_sandbox_id() -> str:
    """A fresh sandbox id: ``sb-`` + 16 hex digits (64 random bits, unique across a
    cluster's nodes without coordination; short enough for cgroup and unit names)."""
    return SANDBOX_ID_PREFIX + secrets.token_hex(8)
