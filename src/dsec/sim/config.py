"""Simulator knobs. Scheduler tunables live in ``dsec.config.Settings``; these describe
the simulated world (cluster hardware, workload trace) and have one-line docs here."""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1024**3
MIB = 1024**2


@dataclass(slots=True)
class SimConfig:
    seed: int = 1                         # one seed drives trace, failures and latencies
    hours: float = 24.0                   # simulated duration
    creations_per_day: float = 3_000_000  # mean arrival rate (x rate_scale)
    rate_scale: float = 1.0               # scale the arrival rate (CI: 0.01)
    nodes: int | None = None              # None: sized for target_utilisation
    target_utilisation: float = 0.80      # mean requested CPU / capacity when nodes is None
    node_cpu: float = 64.0
    node_memory: int = 256 * GIB
    node_disk: int = 2048 * GIB
    gvisor_node_fraction: float = 1.0     # nodes that also offer gVisor
    images: int = 500                     # distinct images (Zipf popularity)
    zipf_s: float = 1.1                   # Zipf exponent of image popularity
    base_images: int = 8                  # OS base layers shared by all images
    runtimes: int = 24                    # language-runtime layers shared by groups of images
    tenants: int = 8
    diurnal_amplitude: float = 0.3        # rate(t) = mean x (1 + a sin(...))
    bursts_per_day: float = 12.0          # RL rollout waves
    burst_factor: float = 2.0             # rate multiplier during a burst
    burst_s: float = 60.0                 # burst length
    duration_median_s: float = 150.0      # lognormal episode duration (clipped below)
    duration_sigma: float = 1.0
    duration_min_s: float = 30.0
    duration_max_s: float = 1800.0
    priority_mix: tuple[float, float, float] = (0.1, 0.6, 0.3)  # high, medium, low
    heavy_fraction: float = 0.3           # sandboxes that use ~90% of their CPU (tests, builds)
    light_usage: float = 0.2              # CPU use fraction of the others
    pull_bandwidth: float = 500 * MIB     # bytes/s per node from the registry
    start_latency_s: float = 0.25         # runc start (gVisor adds gvisor_extra_s)
    gvisor_extra_s: float = 0.3
    handoff_latency_s: float = 0.005      # hand a warm member to a user
    create_failure_rate: float = 0.003    # per create attempt
    node_mtbf_h: float = 24.0 * 7         # per node mean time between failures
    node_repair_s: float = 600.0          # failed node comes back empty after this
    usage_interval_s: float = 10.0        # node usage sample period
    cache_max_images: int = 20            # layer cache: most recent images kept (SPEC §2)
    cache_max_bytes: int = 50 * GIB       # layer cache byte budget per node
    policies: list[str] = field(default_factory=lambda: ["ours", "random", "least-loaded", "k8s"])
