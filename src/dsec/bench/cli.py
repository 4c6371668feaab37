"""``dsec bench cli``: how fast the CLI answers, against ``podman run --rm`` in the same run.

On a fresh DSEC_HOME with a real ``dsec serve`` (busybox stock image), alternating in
each round: ``dsec --help``, ``dsec ps``, ``dsec run busybox -- true`` (create, exec,
kill: end to end, process start included), ``podman run --rm busybox true`` of the same
image (private podman store, runc, ``--ulimit nofile/nproc=1024``), and ``python -c pass``
(the interpreter's own start-up, the floor every Python CLI pays); wall time and the CPU
time of the command's own processes (podman's includes conmon/runc only when they are its
children). Targets (issue 17):
``--help`` and ``ps`` <= 150 ms, ``run`` <= 300 ms; the report says whether each was met
on this machine, and the run/podman ratio.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

TARGETS_MS = {"dsec_help": 150.0, "dsec_ps": 150.0, "dsec_run_true": 300.0}


def _timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr[-1500:]}")
    return dt


def _children_cpu() -> float:
    """CPU seconds (user + system) used so far by this process's finished children."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "median_ms": round(statistics.median(s) * 1000, 1),
            "p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1000, 1), "min_ms": round(s[0] * 1000, 1)}


def run(rounds: int = 20, progress: Callable[[str], Any] = print) -> dict[str, Any]:
    from dsec.api.launch import start_serve
    from dsec.bench.sandbox import _Podman
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    work = Path(tempfile.mkdtemp(prefix="dsec-bench-cli-"))
    home = work / "home"
    dsec = str(Path(sys.executable).parent / "dsec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env["DSEC_HOME"] = str(home)
    progress("building busybox into a fresh DSEC_HOME and starting `dsec serve`")
    store = ImageStore(home / "images", Settings(home=home))
    ensure_stock(store, only=["busybox"], log=lambda _: None)
    srv = start_serve(home, log_name="bench-cli-serve.log")
    podman = None
    try:
        progress("loading the same busybox image into a private podman store")
        podman = _Podman(SimpleNamespace(images=store), "busybox", work)  # type: ignore[arg-type]
        cases: dict[str, Callable[[], float]] = {
            "python_startup": lambda: _timed([sys.executable, "-c", "pass"], env),
            "dsec_help": lambda: _timed([dsec, "--help"], env),
            "dsec_ps": lambda: _timed([dsec, "ps"], env),
            "dsec_run_true": lambda: _timed([dsec, "run", "busybox", "--", "true"], env),
            "podman_run_rm_true": podman.run_true,
        }
        for fn in cases.values():  # warm caches on both sides (unpacked layers, page cache)
            fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        cpu: dict[str, list[float]] = {k: [] for k in cases}
        for r in range(rounds):
            progress(f"round {r + 1}/{rounds}")
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                c0 = _children_cpu()
                times[name].append(cases[name]())
                cpu[name].append(_children_cpu() - c0)
    finally:
        if podman is not None:
            podman.close()
        srv.stop()
    # Wall time is what a user waits; on a busy machine it mostly measures the queue for a
    # core, so the CPU time the command's processes used is reported next to it.
    report: dict[str, Any] = {"rounds": rounds, **{k: {**_stats(v), "cpu_median_ms": round(
        statistics.median(cpu[k]) * 1000, 1)} for k, v in times.items()}}
    report["load_avg_1m"] = os.getloadavg()[0]
    run_ms, podman_ms = report["dsec_run_true"]["median_ms"], report["podman_run_rm_true"]["median_ms"]
    report["ratio_run_vs_podman"] = round(run_ms / podman_ms, 3)
    report["targets_ms"] = TARGETS_MS
    report["targets_met"] = {k: report[k]["median_ms"] <= t for k, t in TARGETS_MS.items()}
    if str(work) not in Path("/proc/mounts").read_text():  # never delete through a leftover mount
        shutil.rmtree(work, ignore_errors=True)
    return report
