"""One sandbox id minter for every layer (issue 11: "one new_sandbox_id")."""

from __future__ import annotations

import re


def test_node_api_and_episodes_mint_sandbox_ids_with_one_function() -> None:
    """The node agent, the API service and the episode book use the same ``new_sandbox_id``
    from the low-level ``dsec.ids`` (they kept two copies that had drifted: 12 vs 16 hex
    digits), and its ids have the one documented shape."""
    import dsec.checkpoints.episode_sandboxes as episodes
    from dsec.api import service
    from dsec.ids import new_sandbox_id
    from dsec.node import manager

    assert manager.new_sandbox_id is new_sandbox_id
    assert service.new_sandbox_id is new_sandbox_id
    assert episodes.new_sandbox_id is new_sandbox_id
    ids = {new_sandbox_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"sb-[0-9a-f]{16}", i) for i in ids)
