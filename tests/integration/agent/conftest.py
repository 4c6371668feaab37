"""Fixtures for the exec agent: one compiled dsec-init per session, run as PID 1 of a
fresh pid namespace (unshare, root) and driven through the real asyncio client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.runtime.agent.local import LocalAgent, start_local_agent
from dsec.runtime.agent_build import ensure_agent_binary
from dsec.runtime.agent_client import agent_ping


@pytest.fixture(scope="session")
def agent_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_agent_binary(tmp_path_factory.mktemp("agent-bin"))


def wait_ready(sock: Path) -> None:
    async def probe() -> bool:
        return await agent_ping(sock, 1.0)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if asyncio.run(probe()):
            return
        time.sleep(0.02)
    raise AssertionError(f"agent at {sock} never answered ping")


@pytest.fixture(scope="session")
def ns_agent(agent_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAgent]:
    """dsec-init as PID 1 of its own pid namespace, shared by the module's tests."""
    agent = start_local_agent(agent_binary, tmp_path_factory.mktemp("agent") / "agent.sock", pid_namespace=True)
    try:
        wait_ready(agent.sock_path)
        yield agent
    finally:
        agent.stop()


@pytest.fixture
def sock(ns_agent: LocalAgent) -> Path:
    return ns_agent.sock_path
