"""Synthetic workload: an image catalogue and a day of create requests. Deterministic by seed.

Images share layers the way real agent images do: every image = one of ``base_images``
OS layers + one of ``runtimes`` language-runtime layers + 1-2 small task layers. Image
popularity is Zipf; each image is one task type with one resource shape. Arrivals are a
Poisson process whose rate follows a diurnal sine plus rollout bursts; durations are
lognormal clipped to [min, max]. Everything random that must be identical across the
compared policies (arrivals, per-sandbox CPU use, create failures) is drawn here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dsec.sim.config import GIB, MIB, SimConfig

CPU_CHOICES = (1.0, 2.0, 4.0)
CPU_PROBS = (0.3, 0.5, 0.2)


@dataclass(slots=True)
class SimImage:
    name: str
    layers: tuple[tuple[str, int], ...]
    cpu: float
    memory: int
    disk: int
    isolation: str


@dataclass(slots=True)
class Arrival:
    t: float
    rid: str
    tenant: str
    image: int
    priority: int
    duration: float
    usage: float      # fraction of requested CPU really used
    fail: bool        # the first create attempt fails (node-side error)


def make_images(cfg: SimConfig) -> list[SimImage]:
    rng = np.random.default_rng(cfg.seed)
    bases = [(f"sha256:base{i:03d}", int(rng.uniform(80, 300) * MIB)) for i in range(cfg.base_images)]
    runtimes = [(f"sha256:rt{i:03d}", int(rng.uniform(200, 900) * MIB)) for i in range(cfg.runtimes)]
    out: list[SimImage] = []
    for i in range(cfg.images):
        rt = int(rng.integers(cfg.runtimes))
        layers = [bases[rt % cfg.base_images], runtimes[rt]]
        for j in range(int(rng.integers(1, 3))):
            layers.append((f"sha256:img{i:04d}-{j}", int(rng.lognormal(math.log(40), 1.0) * MIB) + MIB))
        cpu = float(rng.choice(CPU_CHOICES, p=CPU_PROBS))
        iso = "gvisor" if rng.random() < 0.1 else "container"
        out.append(SimImage(f"img{i:04d}", tuple(layers), cpu, int(cpu * 2 * GIB), 10 * GIB, iso))
    return out


def popularity(cfg: SimConfig) -> np.ndarray:
    w = 1.0 / np.arange(1, cfg.images + 1) ** cfg.zipf_s
    return w / w.sum()


def mean_rate(cfg: SimConfig) -> float:
    return cfg.creations_per_day * cfg.rate_scale / 86400.0


def rate_at(cfg: SimConfig, t: float, bursts: np.ndarray) -> float:
    diurnal = 1.0 + cfg.diurnal_amplitude * math.sin(2 * math.pi * (t / 86400.0 - 0.25))
    in_burst = bursts.size and bool(np.any((bursts <= t) & (t < bursts + cfg.burst_s)))
    return mean_rate(cfg) * diurnal * (cfg.burst_factor if in_burst else 1.0)


def mean_duration(cfg: SimConfig) -> float:
    rng = np.random.default_rng(cfg.seed + 7)
    d = np.clip(rng.lognormal(math.log(cfg.duration_median_s), cfg.duration_sigma, 200_000),
                cfg.duration_min_s, cfg.duration_max_s)
    return float(d.mean())


def offered_cpu(cfg: SimConfig, images: list[SimImage]) -> float:
    """Mean requested CPU in use (Little's law), burst share included."""
    pop = popularity(cfg)
    mean_cpu = float(sum(p * im.cpu for p, im in zip(pop, images)))
    burst_share = cfg.bursts_per_day * cfg.burst_s * (cfg.burst_factor - 1) / 86400.0
    return mean_rate(cfg) * (1 + burst_share) * mean_duration(cfg) * mean_cpu


def arrivals(cfg: SimConfig, chunk_s: float = 60.0) -> Iterator[list[Arrival]]:
    """Arrivals in time order, one list per ``chunk_s`` of simulated time."""
    rng = np.random.default_rng(cfg.seed + 1)
    horizon = cfg.hours * 3600.0
    n_bursts = rng.poisson(cfg.bursts_per_day * cfg.hours / 24.0)
    bursts = np.sort(rng.uniform(0, horizon, n_bursts))
    pop = popularity(cfg)
    prio_p = np.array(cfg.priority_mix) / sum(cfg.priority_mix)
    seq = 0
    t0 = 0.0
    while t0 < horizon:
        span = min(chunk_s, horizon - t0)
        secs = np.arange(int(math.ceil(span)))
        rates = np.array([rate_at(cfg, t0 + s, bursts) for s in secs])
        counts = rng.poisson(rates * np.minimum(1.0, span - secs))
        n = int(counts.sum())
        ts = t0 + np.repeat(secs, counts) + rng.random(n)
        ts.sort()
        imgs = rng.choice(cfg.images, size=n, p=pop)
        prios = rng.choice(3, size=n, p=prio_p)
        durs = np.clip(rng.lognormal(math.log(cfg.duration_median_s), cfg.duration_sigma, n),
                       cfg.duration_min_s, cfg.duration_max_s)
        heavy = rng.random(n) < cfg.heavy_fraction
        usage = np.where(heavy, rng.uniform(0.7, 1.0, n), rng.uniform(0.05, 2 * cfg.light_usage - 0.05, n))
        fails = rng.random(n) < cfg.create_failure_rate
        tenants = rng.integers(cfg.tenants, size=n)
        # Plain Python values in one conversion per column (per-element numpy indexing
        # cost more than the whole scheduler decision).
        tn = [f"t{k}" for k in range(cfg.tenants)]
        out = [Arrival(t, f"r{seq + k + 1}", tn[te], im, pr, du, us, fa) for k, (t, te, im, pr, du, us, fa)
               in enumerate(zip(ts.tolist(), tenants.tolist(), imgs.tolist(), prios.tolist(), durs.tolist(),
                                usage.tolist(), fails.tolist()))]
        seq += n
        yield out
        t0 += span


def node_failures(cfg: SimConfig, nodes: int) -> list[tuple[float, int]]:
    """(time, node index) of node failures, identical for every policy."""
    rng = np.random.default_rng(cfg.seed + 2)
    horizon = cfg.hours * 3600.0
    n = rng.poisson(nodes * horizon / (cfg.node_mtbf_h * 3600.0))
    return sorted(zip(rng.uniform(0, horizon, n).tolist(), rng.integers(nodes, size=n).tolist()))
