"""Property tests (hypothesis) of the scheduler's invariants under random operation sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from dsec.control.types import HIGH, LOW, MEDIUM
from dsec.errors import DSecError

from .helpers import GIB, req, sched

OPS = st.lists(st.tuples(
    st.sampled_from(["submit", "batch", "create", "fail", "release", "usage", "lose", "heal"]),
    st.integers(0, 30),            # request id / index
    st.sampled_from([0.5, 1, 2, 4, 8]),
    st.sampled_from([HIGH, MEDIUM, LOW]),
    st.floats(0.0, 1.2),
), min_size=1, max_size=120)

FAST = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_capacity(s) -> None:  # type: ignore[no-untyped-def]
    ratio = s.s.overcommit_ratio
    for n in s.cluster.node_list:
        assert n.used_cpu <= n.cpu * ratio + 1e-6, (n.node_id, n.used_cpu)
        assert n.used_memory <= n.memory * ratio
        assert n.used_disk <= n.disk and n.count <= n.max_sandboxes
        # Allocation equals what the scheduler accounts for on the node: nothing leaks.
        res = s.residents[n.node_id].values()
        pend = [r for r, nid in s.placed.values() if nid == n.node_id]
        assert abs(n.used_cpu - sum(r.cpu for r in res) - sum(r.cpu for r in pend)) < 1e-6


@FAST
@given(ops=OPS, pools=st.booleans())
def test_never_over_capacity_and_never_two_sandboxes_per_request(ops: list, pools: bool) -> None:
    """Whatever happens, no node is allocated beyond the overcommit bound, accounting is exact,
    and no request id ever has two sandboxes (alive or placed) at once or in its lifetime."""
    s = sched(nodes=3, cpu=8, pools=pools, warm_pool_plan_interval_s=1.0)
    now = 0.0
    created: dict[str, str] = {}  # request id -> sandbox id (successful creations)
    outstanding: list = []
    for op, i, cpu, prio, x in ops:
        now += 0.05
        if op == "submit":
            try:
                s.submit(req(f"r{i}", tenant=f"t{i % 3}", cpu=cpu, priority=prio), now)
            except DSecError:
                pass
        elif op == "batch":
            for p in s.next_batch(now):
                if p.kind == "warm":
                    assert p.request.request_id not in created
                    created[p.request.request_id] = p.sandbox_id
                elif p.kind in ("create", "pool"):
                    outstanding.append(p)
        elif op in ("create", "fail") and outstanding:
            p = outstanding.pop(i % len(outstanding))
            rid = p.request.request_id
            if rid not in s.placed or s.placed[rid][1] != p.node_id:
                continue  # the node was lost meanwhile; the scheduler already moved on
            if op == "create":
                sid = f"sb-{rid}-{now}"
                s.on_created(rid, sid, now)
                if p.kind == "create":
                    assert rid not in created, f"second sandbox for {rid}"
                    created[rid] = sid
            else:
                s.on_failed(rid, now, "injected")
        elif op == "release" and s.running:
            sid = sorted(s.running)[i % len(s.running)]
            s.on_released(sid, now, cpu_peak=1.0, memory_peak=GIB)
        elif op == "usage":
            s.usage_sample(f"n{i % 3}", now, x)
        elif op == "lose":
            s.node_lost(f"n{i % 3}", now)
        elif op == "heal":
            s.set_node_health(f"n{i % 3}", True)
        _check_capacity(s)
        alive = [r.request_id for r in s.running.values() if r.request_id]
        assert len(alive) == len(set(alive))
        assert not (set(alive) & set(s.placed))


@hsettings(max_examples=25, deadline=None)
@given(flood=st.integers(1, 6), aging=st.sampled_from([5.0, 20.0, 60.0]), hold=st.sampled_from([1.0, 3.0]))
def test_low_priority_not_starved_under_high_flood(flood: int, aging: float, hold: float) -> None:
    """A tenant's low request is placed within a bounded wait even while another tenant
    floods high-priority work that alone could keep the cluster busy."""
    s = sched(nodes=1, cpu=4, overcommit_ratio=1.0, priority_aging_s=aging, preemption_enabled=False)
    s.submit(req("victim", tenant="small", cpu=2, priority=LOW), 0.0)
    live: list[tuple[float, str]] = []
    now, k, placed_at = 0.0, 0, None
    while now < 10 * aging + 100 and placed_at is None:
        now += 0.5
        for _ in range(flood):
            k += 1
            try:
                s.submit(req(f"h{k}", tenant="big", cpu=2, priority=HIGH), now)
            except DSecError:
                pass
        for end, sid in [x for x in live if x[0] <= now]:
            live.remove((end, sid))
            s.on_released(sid, now)
        for p in s.next_batch(now):
            s.on_created(p.request.request_id, f"sb-{p.request.request_id}", now)
            live.append((now + hold, f"sb-{p.request.request_id}"))
            if p.request.request_id == "victim":
                placed_at = now
    assert placed_at is not None and placed_at <= 2 * aging + 2 * hold + 1.0
