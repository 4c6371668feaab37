"""Fixtures for API unit tests (helpers live in api_env.py: conftest modules cannot be imported)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from api_env import Env, make_env


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    e = await make_env(tmp_path)
    yield e
    for c in (e.admin, e.alice, e.bob, e.anon):
        await c.aclose()
    await e.services.close()
