"""Scheduler benchmark: placement decisions per second of the real ``Scheduler``.

Clusters of 1,000 and 10,000 nodes (64 CPU each) whose layer caches hold 20 Zipf-drawn
images each; requests drawn like the simulator's trace, submitted in batches of
``batch`` and placed by ``next_batch``. Only time inside ``next_batch`` counts. The
kube-scheduler-style baseline (``k8s``) runs on the same cluster in the same process and
the report gives ours/baseline ratios, never absolute pass/fail.
"""

from __future__ import annotations

import random
import time

import numpy as np

from dsec.config import Settings
from dsec.control.scheduler import Scheduler
from dsec.control.types import Request
from dsec.sim.config import SimConfig
from dsec.sim.trace import make_images, popularity


def _decisions_per_s(policy: str, nodes: int, requests: int, batch: int, seed: int) -> dict:
    cfg = SimConfig(seed=seed)
    images = make_images(cfg)
    pop = popularity(cfg)
    rng = np.random.default_rng(seed)
    sched = Scheduler(Settings(), policy=policy, seed=seed, pools=False)
    for i in range(nodes):
        cached = rng.choice(len(images), size=20, replace=False, p=pop)
        layers = {d for k in cached for d, _ in images[k].layers}
        sched.upsert_node(f"n{i}", cfg.node_cpu, cfg.node_memory, cfg.node_disk,
                          isolation=("container", "gvisor"), layers=layers)
    for im in images:
        sched.register_image(im.name, im.layers)
    picks = rng.choice(len(images), size=requests, p=pop)
    tenants = [f"t{k}" for k in range(8)]
    r = random.Random(seed)
    spent, cpu, placed, now = 0.0, 0.0, 0, 0.0
    live: list[str] = []
    for start in range(0, requests, batch):
        for k in range(start, min(requests, start + batch)):
            im = images[int(picks[k])]
            sched.submit(Request(f"q{k}", tenants[k % 8], im.name, im.cpu, im.memory, im.disk,
                                 r.choice((0, 1, 1, 2)), im.isolation), now)
        now += sched.s.batch_window_s
        t0, c0 = time.perf_counter(), time.process_time()
        out = sched.next_batch(now)
        spent += time.perf_counter() - t0
        cpu += time.process_time() - c0
        placed += len(out)
        for p in out:
            sched.on_created(p.request.request_id, f"s{p.request.request_id}", now)  # type: ignore[union-attr]
            live.append(f"s{p.request.request_id}")
        # Keep the cluster about half full so the filter has real work to do.
        while len(live) > nodes * 12:
            sched.on_released(live.pop(r.randrange(len(live))), now)
    return {"policy": policy, "nodes": nodes, "placed": placed, "seconds": spent,
            "decisions_per_s": placed / spent if spent else 0.0,
            # CPU time is what one core gives when the machine is shared; wall is what a user sees.
            "decisions_per_cpu_s": placed / cpu if cpu else 0.0}


def run(requests: int = 20_000, batch: int = 200, seed: int = 1,
        sizes: tuple[int, ...] = (1_000, 10_000)) -> dict:
    """Benchmark ours vs the k8s-style baseline at each cluster size; returns a dict report."""
    out: dict = {"requests": requests, "batch": batch, "sizes": {}}
    for n in sizes:
        ours = _decisions_per_s("ours", n, requests, batch, seed)
        base = _decisions_per_s("k8s", n, max(1000, requests // 10), batch, seed)
        out["sizes"][str(n)] = {"ours_decisions_per_s": ours["decisions_per_s"],
                                "ours_decisions_per_cpu_s": ours["decisions_per_cpu_s"],
                                "k8s_decisions_per_s": base["decisions_per_s"],
                                "k8s_decisions_per_cpu_s": base["decisions_per_cpu_s"],
                                "speedup_vs_k8s": ours["decisions_per_s"] / base["decisions_per_s"]
                                if base["decisions_per_s"] else 0.0}
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
