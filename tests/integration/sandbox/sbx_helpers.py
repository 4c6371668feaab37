"""Helpers for the sandbox security/correctness suite: a node per test on a shared image
store, neighbour health checks, and a leak inventory of everything a sandbox owns."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsec.config import load_settings
from dsec.images import ImageStore
from dsec.models import ExecRequest, ExecResult, SandboxInfo, SandboxSpec
from dsec.node import cgroups
from dsec.node.agent import LocalNodeAgent

HERE = Path(__file__).parent
TIERS = ["container", "gvisor"]
# Small shapes keep hostile workloads cheap and their limits easy to hit.
SMALL = {"cpu": 0.5, "memory": "256M", "disk": "64M", "pids": 128}
# On gVisor (ptrace platform) the pids cgroup counts the runsc Sentry, gofer and stub
# tasks: about 30 plus 7-9 host tasks per guest process (docs/security.md), so a small
# limit would kill the Sentry under an ordinary workload.
GVISOR_PIDS = 1024


@dataclass
class SharedEnv:
    """What every test node shares: the image store (built once) and the agent binary dir."""

    images_home: Path
    store: ImageStore
    bin_dir: Path


def node_settings(home: Path, run_dir: Path, **over: object):
    # run_dir is short: agent sockets live there and sun_path is limited to 108 bytes.
    return load_settings(home=home, run_dir=run_dir, layer_compression="tar", net_enabled=False, **over)


async def start_node(env: SharedEnv, home: Path, run_dir: Path | None = None, **over: object) -> LocalNodeAgent:
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "bin").exists():
        (home / "bin").symlink_to(env.bin_dir)  # reuse the compiled dsec-init
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="dsr-", dir="/tmp"))
    node = LocalNodeAgent(node_settings(home, run_dir, **over), images=env.store)
    await node.manager.start()  # no reaper loop: tests call reap_once() themselves
    return node


async def stop_node(node: LocalNodeAgent) -> None:
    for sid in list(node.manager.live):
        with contextlib.suppress(Exception):  # best effort; the leak assertions are in the tests
            await node.manager.destroy(sid)
    node.manager.close()
    run_dir = node.settings.runtime_dir
    if run_dir.name.startswith("dsr-"):
        shutil.rmtree(run_dir, ignore_errors=True)


async def make(node: LocalNodeAgent, isolation: str, image: str = "busybox", **spec: object) -> SandboxInfo:
    shape = {**SMALL, **({"pids": GVISOR_PIDS} if isolation == "gvisor" else {}), **spec}
    return await node.create(SandboxSpec(image=image, isolation=isolation, **shape))  # type: ignore[arg-type]


async def sh(node: LocalNodeAgent, sid: str, cmd: str | list[str], timeout: float = 30, **kw: object) -> ExecResult:
    return await node.exec(sid, ExecRequest(cmd=cmd, timeout=timeout, **kw))  # type: ignore[arg-type]


class Neighbour:
    """A bystander sandbox with a canary file; hostile neighbours must not disturb it."""

    def __init__(self, node: LocalNodeAgent, info: SandboxInfo, canary: bytes) -> None:
        self.node, self.id, self.canary = node, info.id, canary

    @classmethod
    async def make(cls, node: LocalNodeAgent, isolation: str) -> Neighbour:
        info = await make(node, isolation)
        canary = os.urandom(16).hex().encode()
        await node.write_file(info.id, "/work/canary", canary)
        return cls(node, info, canary)

    async def assert_healthy(self) -> None:
        r = await sh(self.node, self.id, "cat /work/canary; echo; echo ok", timeout=30)
        assert (r.exit_code, r.stdout) == (0, self.canary.decode() + "\nok\n"), r
        assert await self.node.read_file(self.id, "/work/canary") == self.canary


def assert_host_healthy() -> None:
    """The host can still fork and exec (no pid/memory exhaustion leaked out)."""
    subprocess.run(["true"], timeout=10, check=True)


def gvisor_host_pids(sandbox_id: str) -> list[int]:
    """Host processes of a gVisor sandbox (runsc sandbox, gofer; they carry the id in argv)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if sandbox_id.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def leftovers(node: LocalNodeAgent, sandbox_id: str, pids: list[int | None] = ()) -> list[str]:
    """Every resource of ``sandbox_id`` still on the host; [] means fully cleaned."""
    m = node.manager
    p = m.paths(sandbox_id)
    out = [f"cgroup {d}" for d in cgroups.sandbox_cgroup_dirs("dsec", sandbox_id)]
    base = str(p.base)
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4]
            if mp == base or mp.startswith(base + "/"):
                out.append(f"mount {mp}")
    out += [f"{iso} state" for iso in m.isolations if m.runtime(iso).has_state(sandbox_id)]
    if p.base.exists():
        out.append(f"dir {p.base}")
    if p.socket.exists():
        out.append(f"socket {p.socket}")
    out += [f"pid {pid} alive" for pid in pids if pid and _running(pid)]
    out += [f"host process {pid} names it" for pid in gvisor_host_pids(sandbox_id)]
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead init waits a moment for the host's init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def cgroup_file(controller: str, sandbox_id: str, name: str) -> Path:
    return cgroups.CGROUP_ROOT / controller / "dsec" / sandbox_id / name


def build_probe(dest_dir: Path) -> Path:
    """Compile the static syscall probe (sbx_probe.c) once."""
    out = dest_dir / "sbx-probe"
    if not out.exists():
        subprocess.run(["gcc", "-static", "-O1", "-o", str(out), str(HERE / "sbx_probe.c")], check=True,
                       capture_output=True)
    return out


async def reap_until_gone(node: LocalNodeAgent, sandbox_id: str, pid: int | None, passes: int = 50) -> None:
    """Run reaper passes until the dead sandbox is reaped (its init may linger as a zombie
    for a moment until the host's init collects it, and the reaper counts zombies alive)."""
    import asyncio

    from dsec.runtime.oci_runtime import wait_gone

    if pid:
        await asyncio.to_thread(wait_gone, pid, 10)
    for _ in range(passes):
        await node.manager.reap_once()
        if sandbox_id not in node.manager.live:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"reaper never removed dead sandbox {sandbox_id}")


async def count_procs(node: LocalNodeAgent, sandbox_id: str, pattern: str, expect: int, polls: int = 50) -> int:
    """How many processes in the sandbox match ``pattern`` (a grep -E on `ps -o args`),
    polled until it equals ``expect``: signals are delivered, and a forked child shows its
    parent's args until it execs, asynchronously to our exec."""
    import asyncio

    n = -1
    for _ in range(polls):
        r = await sh(node, sandbox_id, f"ps -o args | grep -v grep | grep -cE '{pattern}'")
        assert r.stdout.strip().isdigit(), r
        n = int(r.stdout)
        if n == expect:
            return n
        await asyncio.sleep(0.05)
    return n
