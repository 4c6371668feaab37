"""A warm hand-over answers without waiting for its state writes (issue 15: the warm
acquire -> first exec budget is a few ms, and each state store trip costs one)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from api_env import Env, until

from dsec.errors import NotFound
from dsec.models import SandboxInfo, SandboxSpec
from dsec.state import IdempotencyRecord

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
    await until(lambda: len(in_flight) == 2)
    assert len(in_flight) == 2
    gate.set()
    assert {(await a).tenant, (await b).tenant} == {"alice"}
    with pytest.raises(Exception, match="max_sandboxes"):  # alice's quota is 2
        await svc.create(alice, SPEC)


async def test_create_with_request_id_takes_two_state_trips(env: Env) -> None:
    """A warm hand-over with a request id (every SDK create) makes two trips to the state
    store's thread: the reservation together with the reserved id's owner row, then the
    answer together with the member's owner row and the reserved id's dead mark (was five:
    each trip is two thread wake-ups). The answer is still durable before it is given, and
    a replay gets the same sandbox."""
    member = await env.node.create(SPEC, tenant="alice")

    async def hand_over(spec: SandboxSpec, sandbox_id: str, tenant: str) -> SandboxInfo:
        return member

    state = env.services.state
    await env.services.audit.flush()
    svc = env.services.sandboxes
    svc.set_placement(hand_over)
    alice = await env.services.auth.authenticate(f"Bearer {env.alice_token}")
    hops: list[list[str]] = []
    real = state._pool.submit  # type: ignore[attr-defined]

    def submit(fn: Any, *args: Any, **kw: Any) -> Any:
        jobs = args[-1] if args and isinstance(args[-1], list) else [(fn,)]
        calls = [getattr(j[0], "__name__", "?") for j in jobs]
        if set(calls) - {"append_audit"}:  # the audit flusher's own trips run on a timer
            hops.append(calls)
        return real(fn, *args, **kw)

    state._pool.submit = submit  # type: ignore[attr-defined]
    spec = SPEC.model_copy(update={"request_id": "r-1"})
    info = await svc.create(alice, spec)
    assert info.id == member.id and len(hops) == 2, hops
    state._pool.submit = real  # type: ignore[attr-defined]
    rec = await state.idem_reserve(IdempotencyRecord(tenant=alice.uid, request_id="r-1", sandbox_id="x",
                                                     created_at=0))
    assert rec.done and rec.info is not None and rec.info["id"] == member.id
    assert await state.sandbox_owner(member.id) == alice.uid
    assert (await svc.create(alice, spec)).id == member.id


async def test_kills_answer_before_their_dead_marks_which_go_in_one_batch(env: Env) -> None:
    """A kill answers without waiting for the state store's dead mark (issue 15: an RL
    episode ends with a kill), kills answered together share one trip, the killed ids are
    gone for their owner at once, and the marks land by ``flush`` (and before reconcile)."""
    svc = env.services.sandboxes
    alice = await env.services.auth.authenticate(f"Bearer {env.alice_token}")
    ids = [(await svc.create(alice, SPEC)).id for _ in range(2)]
    state = env.services.state
    real = state.mark_dead
    gate = asyncio.Event()
    calls: list[list[str]] = []

    async def slow_mark_dead(sandbox_ids: list[str], ts: float) -> None:
        calls.append(list(sandbox_ids))
        await gate.wait()  # a slow state store trip
        await real(sandbox_ids, ts)

    state.mark_dead = slow_mark_dead  # type: ignore[method-assign]
    await asyncio.wait_for(asyncio.gather(*(svc.kill(alice, i) for i in ids)), 2)
    for i in ids:
        with pytest.raises(NotFound):
            await svc.get(alice, i)
    await until(lambda: bool(calls))  # the marks are written off the kill's path
    assert calls == [ids]  # one trip for both
    assert set(ids) <= set(await state.live_sandbox_ids())  # not written yet
    gate.set()
    await svc.flush()
    assert not set(ids) & set(await state.live_sandbox_ids())
