"""OCI runtime-spec generation for sandboxes (pure: inputs in, dict out).

Least privilege is the default: every opening here has a reason next to it and a test
in tests/integration/sandbox/test_hostile.py that it does not widen more than intended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsec.runtime.seccomp import seccomp_profile

AGENT_PATH_IN_SANDBOX = "/.dsec/init"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The documented minimal capability set: what package managers and build tools need to
# manage files they own inside the sandbox (chown/chmod/override perms), switch to an
# unprivileged user, signal their own processes, and bind low ports on the sandbox's own
# interfaces. Notably absent: SYS_ADMIN, NET_ADMIN, NET_RAW, SYS_PTRACE, MKNOD, SYS_CHROOT,
# SETFCAP, SETPCAP, AUDIT_WRITE, SYS_MODULE, SYS_TIME, DAC_READ_SEARCH.
SANDBOX_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_NET_BIND_SERVICE",
)

MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/proc/sysrq-trigger", "/proc/kallsyms", "/proc/kmsg", "/sys/firmware",
    "/sys/kernel", "/sys/devices/virtual/powercap",
)
READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
)

CPU_PERIOD_US = 100_000


@dataclass(frozen=True)
class RuntimeSpec:
    """Everything the runtime needs, already resolved to concrete values."""

    sandbox_id: str
    rootfs: str
    agent_binary: str
    cpu: float
    memory: int
    pids: int
    nofile: int
    hostname: str
    env: dict[str, str] = field(default_factory=dict)
    netns_path: str | None = None
    cgroup_parent: str = "dsec"
    shm_bytes: int = 64 * 1024 * 1024
    # True: PID 1 installs the seccomp profile on itself (dsec-init --seccomp), so runc
    # compiles none; False: the same profile as OCI linux.seccomp, compiled by runc.
    init_seccomp: bool = False


def _mounts(spec: RuntimeSpec) -> list[dict[str, Any]]:
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={spec.shm_bytes}"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        # The exec agent comes from the host, read-only: the sandbox cannot replace it.
        {"destination": AGENT_PATH_IN_SANDBOX, "type": "bind", "source": spec.agent_binary,
         "options": ["bind", "ro", "nosuid", "nodev"]},
    ]


def _resources(spec: RuntimeSpec) -> dict[str, Any]:
    return {
        # Deny every device, then allow exactly the pseudo-devices a shell expects.
        "devices": [
            {"allow": False, "access": "rwm"},
            *({"allow": True, "type": "c", "major": 1, "minor": m, "access": "rwm"} for m in (3, 5, 7, 8, 9)),
            {"allow": True, "type": "c", "major": 5, "minor": 0, "access": "rwm"},   # /dev/tty
            {"allow": True, "type": "c", "major": 5, "minor": 2, "access": "rwm"},   # /dev/ptmx
            {"allow": True, "type": "c", "major": 136, "access": "rwm"},             # /dev/pts/*
        ],
        "memory": {"limit": spec.memory, "swap": spec.memory},
        "cpu": {"quota": max(1000, int(spec.cpu * CPU_PERIOD_US)), "period": CPU_PERIOD_US},
        "pids": {"limit": spec.pids},
    }


def _namespaces(spec: RuntimeSpec) -> list[dict[str, str]]:
    ns: list[dict[str, str]] = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup")]
    # No path = a fresh empty netns with loopback only (network off). A path = a slot
    # prepared by dsec.net with host-side egress policy.
    ns.append({"type": "network", "path": spec.netns_path} if spec.netns_path else {"type": "network"})
    return ns


def build_config(spec: RuntimeSpec) -> dict[str, Any]:
    """The OCI config.json for one sandbox; PID 1 is the exec agent (which installs the
    seccomp profile on itself with ``init_seccomp``; else runc does)."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "TERM": "xterm", **spec.env}
    caps = list(SANDBOX_CAPABILITIES)
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [AGENT_PATH_IN_SANDBOX, *(["--seccomp"] if spec.init_seccomp else [])],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps,
                             "inheritable": [], "ambient": []},
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": spec.nofile, "soft": spec.nofile},
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
            ],
            "noNewPrivileges": True,
            "oomScoreAdj": 500,
        },
        "root": {"path": spec.rootfs, "readonly": False},
        "hostname": spec.hostname,
        "mounts": _mounts(spec),
        "linux": {
            "cgroupsPath": f"/{spec.cgroup_parent}/{spec.sandbox_id}",
            "resources": _resources(spec),
            "namespaces": _namespaces(spec),
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "rootfsPropagation": "private",
        },
    }
    if not spec.init_seccomp:
        config["linux"]["seccomp"] = seccomp_profile()
    return config
