"""A warm hand-over answers without waiting for its state writes (issue 15: the warm
acquire -> first exec budget is a few ms, and each state store trip costs one)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from api_env import Env

from dsec.errors import NotFound
from dsec.models import SandboxInfo, SandboxSpec

SPEC = SandboxSpec(image="busybox", cpu=1, memory="64M")


async def test_warm_hand_over_answers_before_its_state_writes_land(env: Env) -> None:
    """The creator hands over another id (a pool member): the create answers while the
    owner row is still being written; the owner can use the sandbox at once (ownership
    from memory), another tenant cannot see it, and the row lands afterwards."""
    member = await env.node.create(SPEC, tenant="alice")

    async def hand_over(spec: SandboxSpec, sandbox_id: str, tenant: str) -> SandboxInfo:
        return member

    state = env.services.state
    real = state.record_sandbox
    gate = asyncio.Event()

    async def slow_record(sandbox_id: str, *a: Any, **kw: Any) -> None:
        if sandbox_id == member.id:
            await gate.wait()  # a slow state store trip
        await real(sandbox_id, *a, **kw)

    state.record_sandbox = slow_record  # type: ignore[method-assign]
    svc = env.services.sandboxes
    svc.set_placement(hand_over)
    alice = await env.services.auth.authenticate(f"Bearer {env.alice_token}")
    bob = await env.services.auth.authenticate("Bearer " + (await env.services.auth.create_tenant("carol"))[1])
    info = await asyncio.wait_for(svc.create(alice, SPEC), 2)
    assert info.id == member.id
    assert (await svc.get(alice, member.id)).id == member.id
    with pytest.raises(NotFound):
        await svc.get(bob, member.id)
    assert await state.sandbox_owner(member.id) is None  # not written yet
    gate.set()
    await svc.flush()
    assert await state.sandbox_owner(member.id) == alice.uid


async def test_a_tenants_creates_do_not_queue_behind_each_others_state_writes(env: Env) -> None:
    """The owner row of a create's reserved id is written outside the tenant's lock:
    with a slow state store, two concurrent creates of one tenant both have their write
    in flight (before: the second waited for the first's trip inside the lock); quotas
    still hold (admission stays under the lock)."""
    state = env.services.state
    real = state.record_sandbox
    gate = asyncio.Event()
    in_flight: list[str] = []

    async def slow_record(sandbox_id: str, *a: Any, **kw: Any) -> None:
        in_flight.append(sandbox_id)
        await gate.wait()
        await real(sandbox_id, *a, **kw)

    state.record_sandbox = slow_record  # type: ignore[method-assign]
    svc = env.services.sandboxes
    alice = await env.services.auth.authenticate(f"Bearer {env.alice_token}")
    a = asyncio.create_task(svc.create(alice, SPEC))
    b = asyncio.create_task(svc.create(alice, SPEC))
    for _ in range(20):
        await asyncio.sleep(0.005)
    assert len(in_flight) == 2
    gate.set()
    assert {(await a).tenant, (await b).tenant} == {"alice"}
    with pytest.raises(Exception, match="max_sandboxes"):  # alice's quota is 2
        await svc.create(alice, SPEC)
