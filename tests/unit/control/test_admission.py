"""Tenant admission (issue 18 #4, #6): reserve, then create; refusals name the quota; the
per-sandbox pids limit never passes the host's pid_max."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from dsec.config import Settings
from dsec.control.admission import Limits, Reservations, Usage, pids_limit, refusal
from dsec.control.convert import pool_can_serve
from dsec.models import SandboxSpec

MIB = 1024 * 1024


def test_refusal_names_the_quota_that_ran_out() -> None:
    """Sandboxes, cpu and memory are each judged on top of what is held; the refusal says which."""
    lim = Limits(max_sandboxes=2, max_cpu=2.0, max_memory=128 * MIB)
    assert refusal(lim, Usage(1, 1.0, 64 * MIB), 1.0, 64 * MIB) is None
    r = refusal(lim, Usage(2, 0.5, 0), 0.5, MIB)
    assert r is not None and r.quota == "max_sandboxes" and r.limit == 2 and r.in_use == 2
    r = refusal(lim, Usage(1, 1.5, 0), 1.0, MIB)
    assert r is not None and r.quota == "max_cpu"
    r = refusal(lim, Usage(1, 0.0, 128 * MIB), 0.5, 64 * MIB)
    assert r is not None and r.quota == "max_memory"
    assert "max_memory" in r.message("t") and "'t'" in r.message("t")
    assert refusal(Limits(max_cpu=0.3), Usage(2, 0.1 + 0.1, 0), 0.1, 0) is None  # float sums still fit


def test_concurrent_reservations_see_each_other() -> None:
    """The #4 reproduction as a pure sequence: creates that reserved but are not listed by
    the node yet still count, so the third 64M create against 128M is refused."""
    res = Reservations()
    lim = Limits(max_memory=128 * MIB)
    assert res.try_reserve("a", "t", lim, [], 0.5, 64 * MIB) is None
    assert res.try_reserve("b", "t", lim, [], 0.5, 64 * MIB) is None
    r = res.try_reserve("c", "t", lim, [], 0.5, 64 * MIB)
    assert r is not None and r.quota == "max_memory"
    assert res.try_reserve("x", "other", lim, [], 0.5, 64 * MIB) is None  # per tenant
    # "a" is now listed by the node and released: counted once, never twice.
    gen = res.generation
    res.release("a")
    assert res.generation == gen + 1
    assert res.usage("t", [("a", 0.5, 64 * MIB)]) == Usage(2, 1.0, 128 * MIB)
    res.release("a")  # idempotent
    assert res.generation == gen + 1
    with pytest.raises(ValueError):
        res.try_reserve("b", "t", lim, [], 0.5, MIB)


@hsettings(max_examples=300, deadline=None)
@given(limit=st.integers(0, 5), mem_limit=st.integers(1, 8),
       ops=st.lists(st.tuples(st.sampled_from(["reserve", "created", "failed", "killed"]), st.integers(0, 20),
                              st.integers(1, 4)), max_size=80))
def test_admitted_never_exceeds_quota(limit: int, mem_limit: int, ops: list[tuple[str, int, int]]) -> None:
    """Whatever the interleaving of admissions, creations finishing (listed by the node,
    reservation released), failures and kills, what the tenant holds (live + in flight)
    never passes max_sandboxes or max_memory."""
    res = Reservations()
    lim = Limits(max_sandboxes=limit, max_memory=mem_limit * MIB)
    inflight: dict[str, int] = {}
    live: dict[str, int] = {}
    for op, i, mem in ops:
        key = f"s{i}"
        if op == "reserve" and key not in inflight and key not in live:
            listing = [(k, 0.0, m * MIB) for k, m in live.items()]
            if res.try_reserve(key, "t", lim, listing, 0.0, mem * MIB) is None:
                inflight[key] = mem
        elif op == "created" and key in inflight:
            live[key] = inflight.pop(key)
            res.release(key)
        elif op == "failed" and key in inflight:
            inflight.pop(key)
            res.release(key)
        elif op == "killed" and key in live:
            live.pop(key)
        held = {**live, **inflight}
        assert len(held) <= limit
        assert sum(held.values()) <= mem_limit
        assert res.usage("t", [(k, 0.0, m * MIB) for k, m in live.items()]).sandboxes == len(held)


def test_pids_limit_never_passes_host_pid_max() -> None:
    """Default: a quarter of the host's pid_max; a setting is honoured up to pid_max, never above."""
    assert pids_limit(None, 32768) == 8192
    assert pids_limit(2048, 32768) == 2048
    assert pids_limit(1_000_000, 32768) == 32768
    assert pids_limit(None, 4) == 8


@given(configured=st.one_of(st.none(), st.integers(8, 10**7)), host=st.integers(1, 4 * 10**6))
def test_pids_limit_bounds(configured: int | None, host: int) -> None:
    """The limit is at least the smallest accepted spec (8) and at most max(8, pid_max)."""
    lim = pids_limit(configured, host)
    assert 8 <= lim <= max(8, host)
    if configured is not None and 8 <= configured <= host:
        assert lim == configured


def test_only_default_pids_take_a_warm_member() -> None:
    """Pool members carry the default pids; other pids are created fresh (#6)."""
    s = Settings()
    assert pool_can_serve(SandboxSpec(), s)
    assert pool_can_serve(SandboxSpec(pids=s.default_pids), s)
    assert not pool_can_serve(SandboxSpec(pids=300), s)
