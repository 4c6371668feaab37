"""Exec-path benchmark: round trip of `true` through the in-sandbox agent (dsec-init)
versus the cheapest host-side alternative, fork+exec via asyncio.create_subprocess_exec,
measured in the same run. The sandbox benchmark adds `runc exec` next to these.

The agent runs as PID 1 of a fresh pid namespace (unshare) when root, else as a plain
child; both paths use the same asyncio event loop and the same number of calls.
Report: median/p99 per path in ms, the agent/baseline ratios, and concurrent throughput.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from dsec.runtime.agent.local import start_local_agent
from dsec.runtime.agent_build import ensure_agent_binary
from dsec.runtime.agent_client import agent_exec, agent_ping

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            "mean_ms": statistics.fmean(ms)}


async def _agent_calls(sock: Path, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = await agent_exec(sock, ["true"], env=ENV, cwd="/", timeout=10, max_output=1024)
        out.append(time.perf_counter() - t0)
        if r.exit_code != 0:
            raise RuntimeError(f"`true` via agent exited {r.exit_code}: {r.stderr!r}")
    return out


async def _fork_calls(calls: int) -> list[float]:
    true_bin = shutil.which("true") or "/bin/true"
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(true_bin, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, env=ENV)
        await proc.communicate()
        out.append(time.perf_counter() - t0)
    return out


async def _concurrent(sock: Path, total: int, parallel: int) -> float:
    """Execs per second with `parallel` callers in flight."""
    sem = asyncio.Semaphore(parallel)

    async def one() -> None:
        async with sem:
            await agent_exec(sock, ["true"], env=ENV, cwd="/", timeout=30, max_output=1024)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    return total / (time.perf_counter() - t0)


async def _run(sock: Path, calls: int, warmup: int) -> dict:
    deadline = time.monotonic() + 10
    while not await agent_ping(sock, 1.0):
        if time.monotonic() > deadline:
            raise RuntimeError(f"agent at {sock} did not come up")
        await asyncio.sleep(0.02)
    await _agent_calls(sock, warmup)
    await _fork_calls(warmup)
    # interleave halves so drift (CPU frequency, other load) hits both paths alike
    agent_s = await _agent_calls(sock, calls // 2)
    fork_s = await _fork_calls(calls // 2)
    agent_s += await _agent_calls(sock, calls - calls // 2)
    fork_s += await _fork_calls(calls - calls // 2)
    agent, fork = _summary(agent_s), _summary(fork_s)
    return {
        "calls": calls,
        "agent_true": agent,
        "fork_exec_true": fork,
        "ratio_median_agent_over_fork": agent["median_ms"] / fork["median_ms"],
        "ratio_p99_agent_over_fork": agent["p99_ms"] / fork["p99_ms"],
        "agent_execs_per_s_64_parallel": await _concurrent(sock, max(calls // 2, 64), 64),
    }


def run(calls: int = 2000, warmup: int = 100, pid_namespace: bool | None = None) -> dict:
    """Measure; pid_namespace defaults to True when running as root."""
    ns = os.geteuid() == 0 and shutil.which("unshare") is not None if pid_namespace is None else pid_namespace
    with tempfile.TemporaryDirectory(prefix="dsec-bench-agent-") as tmp:
        binary = ensure_agent_binary(Path(tmp) / "bin")
        agent = start_local_agent(binary, Path(tmp) / "agent.sock", pid_namespace=ns)
        try:
            result = asyncio.run(_run(agent.sock_path, calls, warmup))
        finally:
            agent.stop()
    result["agent_pid1_in_pid_namespace"] = ns
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
