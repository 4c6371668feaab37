"""Plain data of the control plane's hot path.

These are ``slots`` dataclasses, not pydantic models, on purpose: the scheduler makes
thousands of decisions per second over thousands of nodes, and attribute access on a
slots dataclass is several times cheaper than on a pydantic model. Validation happens
once at the edge (``dsec.control.convert`` turns a ``SandboxSpec`` into a ``Request``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HIGH, MEDIUM, LOW = 0, 1, 2
PRIORITIES: dict[str, int] = {"high": HIGH, "medium": MEDIUM, "low": LOW}
PRIORITY_NAMES: tuple[str, ...] = ("high", "medium", "low")

# (image, isolation, cpu request, memory, disk, network, cpu cap or 0): sandboxes of one
# shape are interchangeable.
Shape = tuple[str, str, float, int, int, bool, float, int, int]


@dataclass(slots=True)
class Image:
    """An image's layer index: ordered (digest, size) pairs and a version for pool expiry."""

    name: str
    layers: tuple[tuple[str, int], ...]
    version: str = ""
    total_bytes: int = 0
    # Locality candidates come from the nodes holding the largest layer (most bytes to
    # save) and from those holding the top layer (the most image-specific: a node holding
    # it ran this very image and most likely holds every layer).
    anchor: str = ""
    top: str = ""
    probe: tuple[str, ...] = ()  # (top, anchor), or (anchor,) when they are one layer
    digests: frozenset[str] = frozenset()  # a node holding all of them misses 0 bytes (fast path)

    def __post_init__(self) -> None:
        self.total_bytes = sum(s for _, s in self.layers)
        if self.layers:
            self.anchor = max(self.layers, key=lambda ds: ds[1])[0]
            self.top = self.layers[-1][0]
            self.probe = (self.top, self.anchor) if self.top != self.anchor else (self.anchor,)
            self.digests = frozenset(d for d, _ in self.layers)


@dataclass(slots=True)
class Request:
    """One create request as the scheduler sees it."""

    request_id: str
    tenant: str
    image: str
    cpu: float
    memory: int
    disk: int
    priority: int = MEDIUM
    isolation: str = "container"
    gpu: str | None = None
    network: bool = False
    ttl: float = 1800.0
    labels: dict[str, str] = field(default_factory=dict)
    selector: dict[str, str] = field(default_factory=dict)
    task_type: str | None = None
    owner: str | None = None  # lease owner (run id / client session)
    submitted_at: float = 0.0
    # Set by the scheduler.
    attempts: int = 0
    not_before: float = 0.0
    excluded: set[str] = field(default_factory=set)
    resume_of: str | None = None
    abnormal: bool = False
    payload: Any = None  # the driver keeps the original SandboxSpec here
    # The sandbox's CPU cap (cgroup limit) when it differs from ``cpu``, the share the
    # scheduler reserves: agents idle while the model thinks, so requests < limits.
    cpu_limit: float = 0.0
    # Likewise the memory limit and disk quota when the reservation is a fraction of them
    # (``memory_request_ratio``, ``disk_request_ratio``); 0 = same as ``memory``/``disk``.
    memory_limit: int = 0
    disk_limit: int = 0
    cold: bool = False  # a warm hand-over failed: create this one fresh
    asked: tuple[float, int] | None = None  # (cpu, memory) before right-sizing changed them

    @property
    def shape(self) -> Shape:
        # Pools are keyed by what was asked, not by the right-sized reservation: a declared
        # pool keeps matching once a task type's history starts resizing its requests.
        cpu, memory = self.asked if self.asked is not None else (self.cpu, self.memory)
        return (self.image, self.isolation, cpu, memory, self.disk, self.network, self.cpu_limit,
                self.memory_limit, self.disk_limit)


@dataclass(slots=True)
class Node:
    """The scheduler's view of one node: capacity, allocation, layers, usage, pool members."""

    node_id: str
    cpu: float
    memory: int
    disk: int
    max_sandboxes: int = 2000
    isolation: frozenset[str] = frozenset({"container"})
    gpus: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    healthy: bool = True
    # Allocation (requests of running + creating + warm sandboxes).
    used_cpu: float = 0.0
    used_memory: int = 0
    used_disk: int = 0
    count: int = 0
    gpu_used: dict[str, int] = field(default_factory=dict)
    inflight: int = 0  # creations started and not finished
    layers: set[str] = field(default_factory=set)
    # Usage fraction (0..1+) from ``UsageWindow``; cached so scoring is one attribute read.
    predicted: float = 0.0
    warm: dict[Shape, list[str]] = field(default_factory=dict)  # shape -> idle member ids
    warm_count: int = 0
    batch_load: int = 0  # placed on this node in the current batch (spread factor)


@dataclass(slots=True)
class Placement:
    """A decision for the driver.

    kind: ``create`` (start a new sandbox), ``warm`` (hand over the idle pool member
    ``sandbox_id``), ``pool`` (pre-create a pool member of ``shape``).
    ``evict`` lists sandboxes the driver must remove first (idle pool members, or
    preemption victims, which it checkpoints before stopping).
    """

    kind: str
    node_id: str
    request: Request | None = None
    sandbox_id: str | None = None
    shape: Shape | None = None
    missing_bytes: int = 0
    evict: list[str] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Running:
    """A sandbox the scheduler accounts for (running or idle pool member)."""

    sandbox_id: str
    node_id: str
    tenant: str
    priority: int
    cpu: float
    memory: int
    disk: int
    gpu: str | None
    started_at: float
    request_id: str | None = None
    shape: Shape | None = None
    pool: bool = False
    image_version: str = ""
    request: Request | None = None
    owner: str | None = None
    expires_at: float | None = None  # set at hand-over: the TTL starts then
    labels: dict[str, str] = field(default_factory=dict)
    task_type: str | None = None
    from_pool: bool = False  # handed over from a warm pool: may go back to it when released


@dataclass(slots=True)
class Ticket:
    """What a client learns about its queued request."""

    request_id: str
    state: str  # queued | placed | created | failed
    position: int = 0
    eta_s: float = 0.0
    sandbox_id: str | None = None
    node_id: str | None = None
    error: str | None = None
