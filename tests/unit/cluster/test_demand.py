"""Pending demand for autoscalers (dsec.cluster.demand): queued creates older than the
minimum age, grouped by resource shape, and the same as Ray autoscaler bundles; the
scheduler metric carries it."""

from __future__ import annotations

from types import SimpleNamespace

from dsec.cluster.demand import DemandShape, pending_demand, ray_bundles

G = 2**30


def _req(cpu: float, mem: int, at: float, iso: str = "container", gpu: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(cpu=cpu, memory=mem, disk=G, isolation=iso, gpu=gpu, submitted_at=at)


def test_pending_demand_groups_old_enough_requests_by_shape() -> None:
    """Requests younger than min_age (about to be placed) are not demand; the rest are
    counted per (cpu, memory, disk, isolation, gpu), largest count first."""
    reqs = [_req(1, G, 0), _req(1, G, 1), _req(1, G, 2), _req(4, 8 * G, 0), _req(4, 8 * G, 9.9),
            _req(1, G, 0, iso="gvisor"), _req(2, G, 0, gpu="a100")]
    got = pending_demand(reqs, now=10.0, min_age_s=1.0)
    assert [(d.cpu, d.memory, d.isolation, d.gpu, d.count) for d in got] == [
        (1, G, "container", None, 3), (4, 8 * G, "container", None, 1), (2, G, "container", "a100", 1),
        (1, G, "gvisor", None, 1)]
    assert pending_demand(reqs, now=10.0, min_age_s=100.0) == []
    assert pending_demand([], now=0, min_age_s=0) == []


def test_ray_bundles_one_per_pending_sandbox() -> None:
    """Ray's autoscaler wants one bundle per unit of demand: CPU, memory (bytes), GPU."""
    shapes = [DemandShape(cpu=1, memory=G, disk=G, isolation="container", count=2),
              DemandShape(cpu=2, memory=G, disk=G, isolation="container", gpu="a100", count=1)]
    assert ray_bundles(shapes) == [{"CPU": 1, "memory": float(G)}] * 2 + [{"CPU": 2, "memory": float(G), "GPU": 1.0}]


def test_scheduler_metric_exports_what_cannot_be_placed() -> None:
    """A create too large for the only node's free room stays queued and shows up as
    dsec_scheduler_pending_demand{cpu,memory,...} = 1 once older than the minimum age."""
    from dsec.api.sched_metrics import SchedulerCollector
    from dsec.config import Settings
    from dsec.control.scheduler import Scheduler
    from dsec.control.types import Request

    s = Settings(overcommit_ratio=1.0, cluster_demand_min_age_s=0.5)
    sched = Scheduler(s)
    sched.upsert_node("n0", 2, 4 * G, 100 * G)
    sched.register_image("busybox", [("sha256:x", 1)])
    sched.submit(Request("r1", "t", "busybox", 2, G, G), 0.0)
    assert len(sched.next_batch(0.0)) == 1  # fills the node
    sched.submit(Request("r2", "t", "busybox", 2, G, G), 0.1)
    assert sched.next_batch(0.2) == []  # no room: stays queued
    now = [0.3]
    driver = SimpleNamespace(sched=sched, clock=lambda: now[0])
    metric = {m.name: m for m in SchedulerCollector(driver).collect()}["dsec_scheduler_pending_demand"]
    assert metric.samples == []  # younger than cluster_demand_min_age_s
    now[0] = 1.0
    metric = {m.name: m for m in SchedulerCollector(driver).collect()}["dsec_scheduler_pending_demand"]
    assert [(x.labels, x.value) for x in metric.samples] == [
        ({"cpu": "2", "memory": str(G), "disk": str(G), "isolation": "container", "gpu": ""}, 1.0)]
