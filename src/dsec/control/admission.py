"""Tenant admission: may one more sandbox start without passing the tenant's quotas? Pure.

Admission is *reserve, then create*: a create reserves its size in ``Reservations``
before anything is built, and the reservation lasts until the creation has settled (the
sandbox is listed by its node, or the creation failed / was withdrawn). Usage is what
the node lists for the tenant plus every reservation not listed yet, so N creates
racing each other see each other and at most the quota is admitted (issue 18 #4: 30
simultaneous creates against ``max_sandboxes=2`` gave 30 sandboxes, because each only
counted what the node already listed).

The decision (``refusal``) is a small pure function; the service does the I/O (listing
the node) and holds the per-tenant lock around list + decide + reserve.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

_EPS = 1e-9  # cpu is a float sum: 0.1 + 0.2 must still fit a 0.3 quota


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's quotas; None = unlimited."""

    max_sandboxes: int | None = None
    max_cpu: float | None = None
    max_memory: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.max_sandboxes is None and self.max_cpu is None and self.max_memory is None


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tenant holds: live sandboxes plus creations in flight."""

    sandboxes: int = 0
    cpu: float = 0.0
    memory: int = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Which quota ran out, and by how much (for a 429 that names it)."""

    quota: str  # max_sandboxes | max_cpu | max_memory
    limit: float
    in_use: float
    requested: float

    def message(self, tenant: str) -> str:
        unit = {"max_sandboxes": " sandboxes", "max_cpu": " CPUs", "max_memory": " bytes"}[self.quota]
        return (f"tenant {tenant!r} quota {self.quota}={self.limit:g} is used up: {self.in_use:g}{unit} live or "
                f"being created, this create asks for {self.requested:g} more; kill some sandboxes, retry "
                "after others finish, or ask an admin to raise the quota")


def refusal(limits: Limits, usage: Usage, cpu: float, memory: int) -> Refusal | None:
    """None when one more sandbox of (cpu, memory) fits the tenant's quotas on top of
    ``usage``; else the first quota it would pass (sandboxes, then cpu, then memory)."""
    if limits.max_sandboxes is not None and usage.sandboxes + 1 > limits.max_sandboxes:
        return Refusal("max_sandboxes", limits.max_sandboxes, usage.sandboxes, 1)
    if limits.max_cpu is not None and usage.cpu + cpu > limits.max_cpu + _EPS:
        return Refusal("max_cpu", limits.max_cpu, usage.cpu, cpu)
    if limits.max_memory is not None and usage.memory + memory > limits.max_memory:
        return Refusal("max_memory", limits.max_memory, usage.memory, memory)
    return None


@dataclass(frozen=True, slots=True)
class Held:
    tenant: str
    cpu: float
    memory: int


class Reservations:
    """Creations admitted and not settled yet, by key (the sandbox id chosen at submit).

    ``generation`` changes on every release: a caller that listed the node before a
    release may have missed the released sandbox in both the listing and the
    reservations, so it lists again (see ``SandboxService._admit``).
    """

    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        self.generation = 0

    def __len__(self) -> int:
        return len(self._held)

    def usage(self, tenant: str, live: Iterable[tuple[str, float, int]]) -> Usage:
        """Usage of ``tenant``: its ``live`` sandboxes (id, cpu, memory) plus its
        reservations whose id the node does not list yet (never counted twice)."""
        n, cpu, mem = 0, 0.0, 0
        seen: set[str] = set()
        for sid, c, m in live:
            if sid in seen:
                continue
            seen.add(sid)
            n, cpu, mem = n + 1, cpu + c, mem + m
        for key, h in self._held.items():
            if h.tenant == tenant and key not in seen:
                n, cpu, mem = n + 1, cpu + h.cpu, mem + h.memory
        return Usage(n, cpu, mem)

    def try_reserve(self, key: str, tenant: str, limits: Limits, live: Iterable[tuple[str, float, int]],
                    cpu: float, memory: int) -> Refusal | None:
        """Decide and, when admitted, reserve in one step (no await in between)."""
        if key in self._held:
            raise ValueError(f"reservation {key!r} already held")
        why = None if limits.unlimited else refusal(limits, self.usage(tenant, live), cpu, memory)
        if why is None:
            self._held[key] = Held(tenant, cpu, memory)
        return why

    def release(self, key: str) -> None:
        """The creation settled (created and listed, failed, or withdrawn). Idempotent."""
        if self._held.pop(key, None) is not None:
            self.generation += 1


def pids_limit(configured: int | None, host_pid_max: int) -> int:
    """The most processes one sandbox may ask for on this node (issue 18 #6: a tenant
    asking for 1,000,000 on a host whose pid_max is 32,768 could exhaust host PIDs).

    ``configured`` (setting ``sandbox_max_pids``) is honoured up to the host's pid_max;
    unset, it is a quarter of pid_max (8192 on a default 32768 host), so no single sandbox
    can take most of the host's PIDs. Never below 8, the smallest ``pids`` a spec accepts."""
    host = max(8, host_pid_max)
    want = host // 4 if configured is None else configured
    return max(8, min(want, host))
