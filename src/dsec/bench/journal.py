"""Exec-path cost of trajectory logging, each figure next to its baseline in the same run.

Two measurements, interleaved rep by rep so machine noise hits every mode alike:

1. Caller-side cost per record (no root): nothing (baseline), synchronous logging
   (encode + write + fsync on the caller's thread, the old way) and the async journal
   (``JournalWriter.append``: queue only; encode/write/fsync on its thread).
2. Episode steps on a real runc sandbox: plain ``exec`` without any logging (baseline),
   an episode step with the journal off (record encoded on the step path) and with the
   journal on (record encoded/written/fsynced by the journal thread while the fs parts
   are stored). Reported as median ms and overhead over the plain exec.

Run: ``python -m dsec.bench.journal [--reps N] [--out DIR]`` (root for part 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from dsec.checkpoints import trajectory as traj


def _rec(i: int) -> traj.StepRecord:
    return traj.StepRecord(step=i, command=f"python solve.py --case {i}", exit_code=0,
                           stdout="ok\n" * 200, stderr="", started_at=time.time(), duration=0.5,
                           fs_changed=True, fs_bytes=1234, fs_digest="sha256:" + "0" * 64)


def bench_caller(work: Path, reps: int) -> dict:
    """Per-record time spent on the caller's thread (the exec path) for each mode."""
    sync_path = work / "sync.zst"
    w = traj.JournalWriter(work / "async.zst")
    fh = open(sync_path, "ab")  # noqa: SIM115 - closed in finally
    base, sync, asy, flush = [], [], [], []
    try:
        for i in range(reps):
            rec = _rec(i)
            t0 = time.perf_counter()
            base.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fh.write(traj.encode_record(rec))
            fh.flush()
            os.fsync(fh.fileno())
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            w.append(rec)
            asy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            w.flush()  # the step boundary (in the engine it overlaps the fs part writes)
            flush.append(time.perf_counter() - t0)
    finally:
        fh.close()
        w.close()
    us = lambda xs: statistics.median(xs) * 1e6
    return {"reps": reps, "baseline_us": us(base), "sync_encode_write_fsync_us": us(sync),
            "async_append_us": us(asy), "async_flush_wait_at_boundary_us": us(flush),
            "append_vs_sync_ratio": us(asy) / us(sync)}


async def bench_steps(work: Path, reps: int) -> dict:
    from dsec.bench.recovery import engines_side_by_side
    from dsec.models import ExecRequest

    variants = {"journal_off": {"checkpoint_journal": False}, "journal_on": {"checkpoint_journal": True}}
    out: dict = {}
    step = 0
    async with engines_side_by_side(work, variants) as (node, engines, plain):
        for kind, cmd in (("no_change", "true"), ("change_100KB", "head -c 100000 /dev/urandom > /tmp/f_$RANDOM")):
            t: dict[str, list[float]] = {"plain_exec": [], "journal_off": [], "journal_on": []}
            for rep in range(reps):
                t0 = time.perf_counter()
                await node.exec(plain.id, ExecRequest(cmd=cmd))
                t["plain_exec"].append(time.perf_counter() - t0)
                order = list(engines.items())
                for mode, eng in (order if rep % 2 else order[::-1]):  # alternate: no order bias
                    t0 = time.perf_counter()
                    await eng.step(mode, step, ExecRequest(cmd=cmd))
                    t[mode].append(time.perf_counter() - t0)
                step += 1
            med = {k: statistics.median(v) * 1000 for k, v in t.items()}
            out[kind] = {"reps": reps, **{f"{k}_ms": v for k, v in med.items()},
                         "overhead_ms_journal_off": med["journal_off"] - med["plain_exec"],
                         "overhead_ms_journal_on": med["journal_on"] - med["plain_exec"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--step-reps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("reports"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-journal-"))
    try:
        report = {"caller_side_per_record": bench_caller(work, a.reps)}
        if os.geteuid() == 0 and a.step_reps:
            report["episode_step_on_runc"] = asyncio.run(bench_steps(work, a.step_reps))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "journal-bench.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
