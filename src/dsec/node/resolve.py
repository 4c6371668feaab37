"""Pure resolution of a user's SandboxSpec against settings, the image and the node."""

from __future__ import annotations

from dataclasses import dataclass

from dsec.config import Settings, parse_bytes
from dsec.errors import InvalidArgument
from dsec.models import ImageInfo, SandboxSpec


@dataclass(frozen=True)
class ResolvedSpec:
    cpu: float
    memory: int
    disk: int
    pids: int
    timeout: float
    isolation: str
    env: dict[str, str]
    workdir: str


def image_env(image: ImageInfo) -> dict[str, str]:
    env = {}
    for item in image.env:
        k, sep, v = item.partition("=")
        if sep:
            env[k] = v
    return env


def resolve_spec(spec: SandboxSpec, settings: Settings, image: ImageInfo,
                 node_cpu: float, node_memory: int, node_disk: int, isolations: list[str]) -> ResolvedSpec:
    """Fill defaults and refuse what this node can never run, naming the limit."""
    cpu = spec.cpu if spec.cpu is not None else settings.default_cpu
    memory = int(spec.memory) if spec.memory is not None else parse_bytes(settings.default_memory)
    disk = int(spec.disk) if spec.disk is not None else parse_bytes(settings.default_disk)
    isolation = spec.isolation or settings.default_isolation
    if isolation not in isolations:
        raise InvalidArgument(f"isolation {isolation!r} is not available on this node (available: "
                              f"{', '.join(isolations)})", field="isolation")
    if spec.cpu is not None and cpu > node_cpu * settings.overcommit_ratio:
        raise InvalidArgument(f"cpu={cpu} exceeds the node limit of {node_cpu:g} CPUs", field="cpu", limit=node_cpu)
    # Defaults are clamped to the node (a 2-core dev box still runs the default shape);
    # explicit requests above the node are refused instead.
    cpu = min(cpu, node_cpu)
    if memory > node_memory:
        if spec.memory is not None:
            raise InvalidArgument(f"memory={memory} bytes exceeds the node limit of {node_memory} bytes",
                                  field="memory", limit=node_memory)
        memory = node_memory
    if disk > node_disk:
        if spec.disk is not None:
            raise InvalidArgument(f"disk={disk} bytes exceeds the node limit of {node_disk} bytes",
                                  field="disk", limit=node_disk)
        disk = node_disk
    env = {**image_env(image), **spec.env}
    return ResolvedSpec(
        cpu=cpu, memory=memory, disk=disk,
        pids=spec.pids or settings.default_pids,
        timeout=spec.timeout or settings.default_timeout_s,
        isolation=isolation, env=env,
        workdir=spec.workdir or image.workdir or "/",
    )
