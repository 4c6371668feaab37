"""SandboxService admission (issue 18 #4): a create's quota reservation lives exactly as
long as its creation: held while a cancelled caller's creation still runs, released when
a creation fails, and never counted twice once the node lists the sandbox."""

from __future__ import annotations

import asyncio

import pytest
from api_env import Env, until

from dsec.errors import QuotaExceeded, SandboxFailure
from dsec.models import SandboxInfo, SandboxSpec
from dsec.state.store import TenantRecord

SPEC = SandboxSpec(image="busybox", cpu=1, memory="64M")


class Gate:
    """A placement seam whose creations wait for ``open`` (a slow node), then create on the node."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.open = asyncio.Event()
        self.fail = False
        self.started = 0

    async def __call__(self, spec: SandboxSpec, sandbox_id: str, tenant: str) -> SandboxInfo:
        self.started += 1
        await self.open.wait()
        if self.fail:
            raise SandboxFailure("node broke")
        return await self.env.node.create(spec, sandbox_id=sandbox_id, tenant=tenant)


async def _alice(env: Env) -> TenantRecord:
    """The fixture's tenant alice (max_sandboxes=2)."""
    return await env.services.auth.authenticate(f"Bearer {env.alice_token}")


async def _settle() -> None:
    # Real time, not a count of loop turns: state writes hop to the store's thread.
    for _ in range(20):
        await asyncio.sleep(0.005)


async def test_cancelled_caller_keeps_its_reservation_until_the_creation_settles(env: Env) -> None:
    """A caller cancelled mid-create (client gone, server shutting down a request) must not
    free quota for the sandbox still being built: with max_sandboxes=2, one cancelled and
    one pending create leave no room for a third; once both landed the node's listing
    counts them (no double count), and a kill makes room again."""
    gate = Gate(env)
    svc = env.services.sandboxes
    svc.set_placement(gate)
    alice = await _alice(env)
    a = asyncio.create_task(svc.create(alice, SPEC))
    b = asyncio.create_task(svc.create(alice, SPEC))
    await until(lambda: gate.started == 2)
    assert gate.started == 2
    a.cancel()
    await _settle()
    with pytest.raises(QuotaExceeded, match="max_sandboxes") as e:
        await asyncio.wait_for(svc.create(alice, SPEC), 5)  # admitted: it would wait at the gate
    assert e.value.details["quota"] == "max_sandboxes" and e.value.details["in_use"] == 2
    gate.open.set()
    info_b = await b

    async def both_built() -> bool:
        return len(await env.node.list(tenant="alice")) == 2

    await until(both_built)
    live = await env.node.list(tenant="alice")
    assert len(live) == 2  # the cancelled caller's sandbox was built all the same
    with pytest.raises(QuotaExceeded, match="max_sandboxes"):
        await svc.create(alice, SPEC)
    await svc.kill(alice, info_b.id)
    assert (await svc.create(alice, SPEC)).tenant == "alice"


async def test_failed_creation_releases_its_reservation(env: Env) -> None:
    """A creation that fails frees its reservation at once: the tenant can create again."""
    gate = Gate(env)
    gate.fail = True
    gate.open.set()
    svc = env.services.sandboxes
    svc.set_placement(gate)
    alice = await _alice(env)
    for _ in range(3):
        with pytest.raises(SandboxFailure):
            await svc.create(alice, SPEC)
    gate.fail = False
    assert len([await svc.create(alice, SPEC) for _ in range(2)]) == 2
    with pytest.raises(QuotaExceeded, match="max_sandboxes"):
        await svc.create(alice, SPEC)
