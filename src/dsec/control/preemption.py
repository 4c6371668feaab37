"""Make room when no node fits: evict idle pool members, or preempt lower priority. Pure.

Any request may displace *idle warm-pool members* (they hold capacity for nobody yet).
Only a request of strictly higher priority may displace *running* sandboxes, and only
when ``preemption_enabled``. Victims on a node are taken pool members first, then lowest
priority first, then newest first (least work lost); the chosen node is the one needing
the fewest running victims, then the fewest victims overall. The driver checkpoints each
running victim (hook), stops it, and the scheduler re-queues it for resumption.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsec.control.types import Node, Request, Running


def _fits_after(node: Node, req: Request, ratio: float, cpu: float, mem: int, disk: int,
                count: int, gpu: int) -> bool:
    return (node.used_cpu - cpu + req.cpu <= node.cpu * ratio + 1e-9
            and node.used_memory - mem + req.memory <= node.memory * ratio
            and node.used_disk - disk + req.disk <= node.disk
            and node.count - count < node.max_sandboxes
            and (req.gpu is None or node.gpu_used.get(req.gpu, 0) - gpu < node.gpus.get(req.gpu, 0)))


def victims_on_node(node: Node, req: Request, residents: list[Running], ratio: float,
                    allow_preempt: bool) -> list[Running] | None:
    """Smallest victim list on ``node`` that lets ``req`` fit, or None."""
    pool = [r for r in residents if r.pool]
    running = [r for r in residents if not r.pool and allow_preempt and r.priority > req.priority]
    running.sort(key=lambda r: (-r.priority, -r.started_at))
    cpu = 0.0
    mem = disk = count = gpu = 0
    chosen: list[Running] = []
    if _fits_after(node, req, ratio, 0.0, 0, 0, 0, 0):
        return chosen
    for r in pool + running:
        chosen.append(r)
        cpu += r.cpu
        mem += r.memory
        disk += r.disk
        count += 1
        if req.gpu is not None and r.gpu == req.gpu:
            gpu += 1
        if _fits_after(node, req, ratio, cpu, mem, disk, count, gpu):
            return chosen
    return None


def select_victims(req: Request, nodes: list[Node], residents: Mapping[str, Mapping[str, Running]],
                   ratio: float, threshold: float, allow_preempt: bool) -> tuple[Node, list[Running]] | None:
    """Best node to make room on for ``req`` and its victims, or None.

    Nodes whose predicted usage is at or above ``threshold`` are never chosen: the
    overcommit rule admits nothing new there, victims or not.
    """
    best: tuple[Node, list[Running]] | None = None
    best_key: tuple[int, int] | None = None
    for node in nodes:
        if (not node.healthy or req.isolation not in node.isolation or node.node_id in req.excluded
                or node.predicted >= threshold):
            continue
        if req.selector and any(node.labels.get(k) != v for k, v in req.selector.items()):
            continue
        res = residents.get(node.node_id)
        v = victims_on_node(node, req, list(res.values()) if res else [], ratio, allow_preempt)
        if v is None:
            continue
        key = (sum(1 for r in v if not r.pool), len(v))
        if best_key is None or key < best_key:
            best, best_key = (node, v), key
            if key == (0, 0):
                break
    return best
