"""Fixtures for the sandbox security/correctness suite.

One image store (busybox; python only for tests that ask for it) and one compiled
dsec-init per session; a fresh node (own DSEC_HOME and run dir) per test, so reconcile
and leak checks see only that test's sandboxes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sbx_helpers import TIERS, SharedEnv, build_probe, node_settings, start_node, stop_node

from dsec.images import ImageStore
from dsec.images.stock import ensure_stock
from dsec.node.agent import LocalNodeAgent
from dsec.runtime.agent_build import ensure_agent_binary


@pytest.fixture(scope="session")
def sbx_env(tmp_path_factory: pytest.TempPathFactory) -> SharedEnv:
    home = tmp_path_factory.mktemp("sbx-images")
    store = ImageStore(home / "images", node_settings(home, home / "run"))
    ensure_stock(store, only=["busybox"], log=lambda _: None)
    bin_dir = home / "bin"
    ensure_agent_binary(bin_dir)
    return SharedEnv(home, store, bin_dir)


@pytest.fixture(scope="session")
def python_image(sbx_env: SharedEnv) -> str:
    """The stock python image (python3, gcc, git, pip, bash): about 20 s once per session."""
    ensure_stock(sbx_env.store, only=["python"], log=lambda _: None)
    return "python"


@pytest.fixture(scope="session")
def probe_binary(sbx_env: SharedEnv) -> bytes:
    return build_probe(sbx_env.images_home).read_bytes()


@pytest.fixture
async def node(sbx_env: SharedEnv, tmp_path: Path) -> AsyncIterator[LocalNodeAgent]:
    n = await start_node(sbx_env, tmp_path / "home")
    try:
        yield n
    finally:
        await stop_node(n)


@pytest.fixture(params=[pytest.param(t, marks=[pytest.mark.gvisor] if t == "gvisor" else []) for t in TIERS])
def tier(request: pytest.FixtureRequest) -> str:
    if request.param == "gvisor" and shutil.which("runsc") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI lacks runsc")
        pytest.skip("needs runsc")
    return request.param
