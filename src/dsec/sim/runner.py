"""Run several placement policies over the same trace and write one report."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from dsec.config import Settings
from dsec.control.placement import POLICIES
from dsec.sim.config import SimConfig
from dsec.sim.engine import PLAIN, cluster_size, parse_policy, run_policy
from dsec.sim.report import write_report
from dsec.sim.trace import mean_rate


def _timed(cfg: SimConfig, name: str, settings: Settings | None,
           cb: Callable[[float], None] | None = None) -> dict:
    t0 = time.perf_counter()
    c0 = time.process_time()
    r = run_policy(cfg, name, settings, cb)
    r["wall_s"] = time.perf_counter() - t0
    r["cpu_s"] = time.process_time() - c0
    return r


def run_all(cfg: SimConfig, out: Path | None, settings: Settings | None = None,
            progress: Callable[[str, float], None] | None = None, jobs: int = 1) -> tuple[dict, list[dict]]:
    for p in cfg.policies:
        if parse_policy(p)[0] not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {sorted(POLICIES)} "
                             f"(append {PLAIN!r} for the stand-alone variant)")
    meta = {"seed": cfg.seed, "hours": cfg.hours, "rate_scale": cfg.rate_scale, "nodes": cluster_size(cfg),
            "node_cpu": cfg.node_cpu, "images": cfg.images, "zipf_s": cfg.zipf_s,
            "arrivals_expected": mean_rate(cfg) * cfg.hours * 3600, "policies": list(cfg.policies)}
    results = []
    if jobs > 1 and len(cfg.policies) > 1:
        # Policies are independent runs over the same trace: one process each, same results.
        with ProcessPoolExecutor(max_workers=min(jobs, len(cfg.policies))) as pool:
            futs = [pool.submit(_timed, cfg, name, settings) for name in cfg.policies]
            for name, fut in zip(cfg.policies, futs, strict=True):
                results.append(fut.result())
                if progress:
                    progress(name, 1.0)
                if out is not None:  # a partial report survives an interrupted long run
                    write_report(out, meta, results)
    else:
        for name in cfg.policies:
            cb = (lambda f, n=name: progress(n, f)) if progress else None
            results.append(_timed(cfg, name, settings, cb))
            if out is not None:
                write_report(out, meta, results)
    return meta, results
