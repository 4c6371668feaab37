"""Wire specs -> the scheduler's plain requests: defaults, CPU request vs cap, lease keys.

Pure functions, applied once at the edge by the driver (the I/O side).
"""

from __future__ import annotations

from dsec.config import Settings, parse_bytes
from dsec.control.types import PRIORITIES, Request
from dsec.models import SandboxSpec

POOL_LABEL = "dsec.pool"
FOR_LABEL = "dsec.for"  # on a warm member handed over: the sandbox id its request reserved (failover retries)
OWNER_LABEL = "dsec.owner"  # the lease owner, kept on the sandbox so a restart can adopt it


def spec_to_request(spec: SandboxSpec, tenant: str, request_id: str, s: Settings, *,
                    owner: str | None = None, task_type: str | None = None) -> Request:
    """Validated wire spec -> the scheduler's plain request (defaults from Settings).

    The sandbox's ``cpu`` is its cgroup cap; the scheduler reserves ``cpu x
    cpu_request_ratio`` of it (Kubernetes' request vs limit): agent sandboxes spend most of
    their life waiting for the model, and the usage-based overcommit guard stops admitting
    when measured load says the node is really busy. Memory and disk likewise reserve
    ``memory_request_ratio`` / ``disk_request_ratio`` of their limits (the limits stay the
    sandbox's cgroup limit and tmpfs quota)."""
    mem = spec.memory if isinstance(spec.memory, int) else parse_bytes(spec.memory or s.default_memory)
    disk = spec.disk if isinstance(spec.disk, int) else parse_bytes(spec.disk or s.default_disk)
    limit = spec.cpu or s.default_cpu
    mem_req, disk_req = share_request(mem, s.memory_request_ratio), share_request(disk, s.disk_request_ratio)
    return Request(request_id, tenant, spec.image, cpu_request(limit, s), mem_req, disk_req,
                   PRIORITIES[spec.priority], spec.isolation or s.default_isolation, spec.gpu,
                   spec.network is not None, spec.timeout or s.default_timeout_s, dict(spec.labels),
                   task_type=task_type or spec.labels.get("task"), owner=owner, payload=spec,
                   cpu_limit=limit, memory_limit=mem if mem_req != mem else 0,
                   disk_limit=disk if disk_req != disk else 0)


def pool_can_serve(spec: SandboxSpec, s: Settings) -> bool:
    """May a warm-pool member be handed over for ``spec``? Members are built with the
    default ``pids`` (not part of a pool shape), and a claim cannot change a runc
    container's limits: a request for other pids is created fresh, so the limit asked for
    is the one in its cgroup (issue 18 #6)."""
    return spec.pids is None or spec.pids == s.default_pids


def pool_member_spec(req: Request) -> SandboxSpec:
    """The spec a warm-pool member of ``req``'s shape is built (or recycled) with."""
    return SandboxSpec(image=req.image, cpu=req.cpu_limit or req.cpu, memory=req.memory_limit or req.memory,
                       disk=req.disk_limit or req.disk, isolation=req.isolation,  # type: ignore[arg-type]
                       network=[] if req.network else None, labels={POOL_LABEL: "1"}, timeout=7 * 24 * 3600)


def lease_key(tenant: str, owner: str) -> str:
    """Leases are per tenant: two tenants may both call their run "r1"."""
    return f"{tenant}/{owner}"


def share_request(limit: int, ratio: float) -> int:
    """Bytes reserved for a memory limit / disk quota of ``limit`` (whole MiB, so equal
    shapes stay equal; at least 1 MiB)."""
    if ratio >= 1.0:
        return limit
    mib = 1 << 20
    return max(mib, round(limit * ratio / mib) * mib)


def cpu_request(limit: float, s: Settings) -> float:
    """The CPU share reserved for a sandbox capped at ``limit`` CPUs (rounded to milli-CPUs
    so equal shapes stay equal)."""
    return max(0.001, round(limit * s.cpu_request_ratio, 3))
