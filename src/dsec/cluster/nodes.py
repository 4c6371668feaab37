"""The cluster view of nodes (``dsec node ls``): what each node agent reports."""

from __future__ import annotations

import asyncio
from typing import Any

from dsec import errors


def row(node_id: str, address: str, alive: bool, health: Any, cap: Any, sandboxes: list[Any], index: Any,
        pid: int | None, overcommit: float) -> dict[str, Any]:
    """One node's line (pure): state is ready / lost (no live Ray node, or its agent does
    not answer) / unhealthy (the agent answers but cannot create: e.g. runc missing)."""
    if not alive or health is None:
        state = "lost"
    else:
        state = "ready" if health.ok else "unhealthy"
    return {"id": node_id, "address": address, "state": state, "agent_pid": pid,
            "sandboxes": len(sandboxes),
            "cpu_allocated": round(sum(s.cpu for s in sandboxes), 3),
            "cpu_bound": round(cap.cpu * overcommit, 3) if cap else 0,
            "memory_allocated": sum(s.memory for s in sandboxes),
            "memory_bound": int(cap.memory * overcommit) if cap else 0,
            "images": sorted({n for i in (index.images if index else []) for n in i.names}),
            "problems": list(health.problems) if health is not None else ["agent unreachable"],
            "pulls": [p.model_dump() for p in getattr(health, "pulls", None) or []],
            "prefetched_bytes": int(getattr(health, "prefetched_bytes", 0) or 0)}


def pulls_text(pulls: list[dict[str, Any]]) -> str:
    """The PULLS column (pure): pulls in progress as ``ref pct%``, else ``-``."""
    live = [p for p in pulls if p.get("state") == "pulling"]
    return ", ".join(f"{p['ref']} {100 * p['done_bytes'] // max(1, p['total_bytes'])}%" for p in live) or "-"


def merge_server_states(rows: list[dict[str, Any]], server: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Pure: the control plane's view (GET /v1/nodes of the running `dsec serve --cluster`)
    wins for draining and lost, which only it knows or judges first (heartbeats); rows
    keep their own state when no server answered (``server`` None)."""
    if not server:
        return rows
    by_id = {n["id"]: n for n in server}
    out = []
    for r in rows:
        s = by_id.get(r["id"])
        if s is not None and s.get("state") in ("draining", "lost") and r["state"] != "lost":
            r = {**r, "state": s["state"]}
        out.append(r)
    return out


async def node_rows(address: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    from dsec.cluster.ray import RayNodeProxy, connect, dsec_nodes, get_agent
    from dsec.config import load_settings

    connect(address)
    overcommit = load_settings().overcommit_ratio

    async def one(nid: str, n: dict[str, Any]) -> dict[str, Any]:
        h = get_agent(nid) if n.get("Alive") else None
        health = cap = index = pid = None
        sandboxes: list[Any] = []
        if h is not None:
            p = RayNodeProxy(nid, h, timeout_s)
            try:
                await p.start()
                cap = p.capacity()
                health, sandboxes, index, pid = await asyncio.wait_for(asyncio.gather(
                    p.health(), p.list(), p.layer_index(), p.agent_pid()), timeout_s)
            except (errors.DSecError, TimeoutError, Exception):  # noqa: BLE001 - shown as lost
                health = None
        return row(nid, str(n.get("NodeManagerAddress", "")), bool(n.get("Alive")), health, cap, sandboxes,
                   index, pid, overcommit)

    nodes = dsec_nodes()
    return list(await asyncio.gather(*(one(nid, n) for nid, n in sorted(nodes.items()))))
