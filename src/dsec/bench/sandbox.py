"""Sandbox benchmark: ours vs podman/runc baselines in the same run, reported as ratios.

1. create-to-first-exec-result (no warm pool) vs ``podman run --rm IMAGE true`` of the
   same image (loaded into a private podman store from our own export);
2. exec round trip of ``true`` via the in-sandbox agent vs ``runc exec`` on the same sandbox;
3. destroy latency (median; ``runc delete -f`` alone is the reference);
4. N idle sandboxes alive at once and exec p50/p99 across them.

Run: ``dsec bench sandbox`` (root; needs the stock images from ``dsec image ensure-stock``).
"""

from __future__ import annotations

import asyncio
import json
import random
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.config import Settings, get_settings
from dsec.models import ExecRequest, SandboxSpec
from dsec.node.agent import LocalNodeAgent

PODMAN_ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "median_ms": statistics.median(xs) * 1000, "p99_ms": _pct(xs, 0.99) * 1000,
            "min_ms": min(xs) * 1000 if xs else float("nan")}


class _Podman:
    """A private podman store holding our stock image (no registry involved)."""

    def __init__(self, agent: LocalNodeAgent, image: str, work: Path) -> None:
        self.work = work
        self.runroot = Path(tempfile.mkdtemp(prefix="dsb-", dir="/tmp"))
        self.base = ["podman", "--root", str(work / f"podman-{image}"), "--runroot", str(self.runroot),
                     "--storage-driver", "overlay", "--events-backend", "none", "--cgroup-manager", "cgroupfs"]
        oci = work / f"oci-{image}"
        agent.images.export(image, oci, tag="bench", compression="gzip")
        archive = work / f"{image}.tar"
        subprocess.run(["skopeo", "copy", f"oci:{oci}:bench", f"docker-archive:{archive}:dsec-{image}:bench"],
                       check=True, capture_output=True)
        proc = subprocess.run([*self.base, "load", "-q", "-i", str(archive)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"podman load of {archive} failed: {proc.stderr[-1500:]}")
        self.ref = f"dsec-{image}:bench"

    def run_true(self) -> float:
        t0 = time.perf_counter()
        proc = subprocess.run([*self.base, "run", "--rm", "--network", "none", *PODMAN_ULIMITS, self.ref, "true"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"podman run {self.ref} failed: {proc.stderr[-1500:]}")
        return time.perf_counter() - t0

    def close(self) -> None:
        subprocess.run([*self.base, "system", "reset", "-f"], capture_output=True)
        shutil.rmtree(self.runroot, ignore_errors=True)


class _RuncShare:
    """runc's share of a cold create, measured on the agent's own runtime: the wall time
    of ``runc run -d``, runc's CPU on the host side (runc and the runc-init stages it
    reaps: this process's RUSAGE_CHILDREN) and the CPU charged to the new sandbox's
    cgroup by the time it is ready (runc init after it joined, then dsec-init's start)."""

    def __init__(self, agent: LocalNodeAgent) -> None:
        self.agent = agent
        self.wall: list[float] = []
        self.host_cpu: list[float] = []
        self.sandbox_cpu: list[float] = []
        rt = agent.manager.runtime("container")
        inner = rt.run

        async def timed_run(*args: Any, **kw: Any) -> int:
            t0, c0 = time.perf_counter(), _children_cpu()
            try:
                return await inner(*args, **kw)
            finally:
                self.wall.append(time.perf_counter() - t0)
                self.host_cpu.append(_children_cpu() - c0)
        rt.run = timed_run  # type: ignore[method-assign]  # this bench's agent only

    def ready(self, sandbox_id: str) -> None:
        from dsec.node.usage import cgroup_cpu_seconds

        if (secs := cgroup_cpu_seconds(self.agent.manager.cgroup_parent, sandbox_id)) is not None:
            self.sandbox_cpu.append(secs)  # no CPU accounting: not reported

    def report(self) -> dict[str, Any]:
        return {"runc_run_d": _summary(self.wall), "runc_host_cpu": _summary(self.host_cpu),
                **({"sandbox_cpu_at_ready": _summary(self.sandbox_cpu)} if self.sandbox_cpu else {})}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def _create_first_exec(agent: LocalNodeAgent, image: str, share: _RuncShare | None = None,
                             ) -> tuple[float, str]:
    t0 = time.perf_counter()
    info = await agent.create(SandboxSpec(image=image, cpu=1, memory="512M", disk="1G"))
    if share is not None:
        share.ready(info.id)
    r = await agent.exec(info.id, ExecRequest(cmd=["true"]))
    dt = time.perf_counter() - t0
    assert r.exit_code == 0, r
    return dt, info.id


async def _destroy_timed(agent: LocalNodeAgent, sid: str) -> float:
    t0 = time.perf_counter()
    await agent.destroy(sid)
    return time.perf_counter() - t0


async def bench_start(agent: LocalNodeAgent, image: str, rounds: int, work: Path,
                      progress: Callable[[str], None],
                      variants: dict[str, LocalNodeAgent] | None = None) -> dict[str, Any]:
    """``variants``: more nodes (other settings) measured in the same alternation, each
    reported under its name (e.g. the cold path with runc compiling the seccomp profile)."""
    podman = _Podman(agent, image, work)
    ours, theirs, destroys = [], [], []
    others: dict[str, list[float]] = {name: [] for name in variants or {}}
    share = _RuncShare(agent)
    try:
        podman.run_true()  # warm podman's own caches, as ours are warm after ensure-stock
        for i in range(rounds):  # alternate to share the machine's noise fairly
            dt, sid = await _create_first_exec(agent, image, share)
            ours.append(dt)
            destroys.append(await _destroy_timed(agent, sid))
            for name, other in (variants or {}).items():
                dt, sid = await _create_first_exec(other, image)
                others[name].append(dt)
                await other.destroy(sid)
            theirs.append(await asyncio.to_thread(podman.run_true))
            progress(f"start[{image}] {i + 1}/{rounds}")
    finally:
        podman.close()
    o, t = statistics.median(ours), statistics.median(theirs)
    return {"image": image, "ours": _summary(ours), "podman_run_rm": _summary(theirs),
            "ratio_ours_vs_podman": o / t, "destroy": _summary(destroys), "of_ours": share.report(),
            **{name: _summary(xs) for name, xs in others.items()}}


async def bench_exec(agent: LocalNodeAgent, n: int, progress: Callable[[str], None]) -> dict[str, Any]:
    info = await agent.create(SandboxSpec(image="busybox", cpu=1, memory="256M", disk="256M"))
    rt = agent.manager.runtime("container")
    ours, runc = [], []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            await agent.exec(info.id, ExecRequest(cmd=["true"]))
            ours.append(time.perf_counter() - t0)
            if i % 10 == 0:  # runc exec is ~50x slower; sample it
                t0 = time.perf_counter()
                proc = await asyncio.create_subprocess_exec(
                    *rt._base(), "exec", info.id, "true",
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
                await proc.wait()
                runc.append(time.perf_counter() - t0)
        progress(f"exec {n}/{n}")
    finally:
        await agent.destroy(info.id)
    return {"ours": _summary(ours), "runc_exec": _summary(runc),
            "ratio_ours_vs_runc_exec": statistics.median(ours) / statistics.median(runc)}


async def bench_many(agent: LocalNodeAgent, count: int, execs: int, progress: Callable[[str], None]) -> dict:
    ids: list[str] = []
    sem = asyncio.Semaphore(8)
    t0 = time.perf_counter()

    async def one() -> None:
        async with sem:
            info = await agent.create(SandboxSpec(image="busybox", cpu=0.1, memory="32M", disk="16M", pids=64))
            ids.append(info.id)
            if len(ids) % 50 == 0:
                progress(f"idle sandboxes {len(ids)}/{count}")

    try:
        await asyncio.gather(*(one() for _ in range(count)))
        created_s = time.perf_counter() - t0
        rng = random.Random(7)
        lat: list[float] = []

        async def probe(sid: str) -> None:
            t = time.perf_counter()
            r = await agent.exec(sid, ExecRequest(cmd=["true"]))
            lat.append(time.perf_counter() - t)
            assert r.exit_code == 0

        for _ in range(execs // 10):  # 10 concurrent execs at a time across random sandboxes
            await asyncio.gather(*(probe(rng.choice(ids)) for _ in range(10)))
        return {"sandboxes": len(ids), "create_all_s": created_s, "exec": _summary(lat)}
    finally:
        for i in range(0, len(ids), 16):
            await asyncio.gather(*(agent.destroy(s) for s in ids[i:i + 16]))


async def run_async(settings: Settings, rounds: int = 10, exec_n: int = 1000, many: int = 500,
                    progress: Callable[[str], None] = print) -> dict[str, Any]:
    agent = LocalNodeAgent(settings)
    await agent.start()
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-"))
    try:
        report: dict[str, Any] = {"host_cpus": agent.manager.cpu}
        report["start"] = [await bench_start(agent, img, rounds, work, progress) for img in ("busybox", "python")]
        report["exec"] = await bench_exec(agent, exec_n, progress)
        if many:
            report["many"] = await bench_many(agent, many, 1000, progress)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        await agent.close()


def run(out: Path | None = None, **kw: Any) -> dict[str, Any]:
    report = asyncio.run(run_async(get_settings(), **kw))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sandbox-bench.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
