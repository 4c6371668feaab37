"""Builders shared by the control-plane unit tests."""

from __future__ import annotations

from dsec.config import Settings
from dsec.control.scheduler import Scheduler
from dsec.control.types import MEDIUM, Request

GIB = 1024**3
MIB = 1024**2


def settings(**kw: object) -> Settings:
    return Settings(**kw)  # type: ignore[arg-type]


def sched(nodes: int = 4, cpu: float = 16, pools: bool = False, **kw: object) -> Scheduler:
    s = Scheduler(settings(**kw), pools=pools, seed=7)
    for i in range(nodes):
        s.upsert_node(f"n{i}", cpu, 64 * GIB, 500 * GIB, isolation=("container", "gvisor"))
    s.register_image("img", [("base", 300 * MIB), ("mid", 100 * MIB), ("top", 10 * MIB)], version="v1")
    s.register_image("other", [("base", 300 * MIB), ("x", 500 * MIB)], version="v1")
    return s


def req(rid: str, tenant: str = "t1", image: str = "img", cpu: float = 2, priority: int = MEDIUM,
        **kw: object) -> Request:
    return Request(rid, tenant, image, cpu, 4 * GIB, 10 * GIB, priority, **kw)  # type: ignore[arg-type]
