"""Step-path cost of the periodic full checkpoint: inline squash vs background squash.

Two episodes on real runc sandboxes of one node run the same 50 steps (20 MB of changed
files in total, ``checkpoint_full_every`` layers per full checkpoint), interleaved step by
step so noise hits both alike: one squashes the chain inline on the step that reaches
``full_every`` layers (the old way), the other squashes in the background from the
stored parts. Baseline: the same command as a plain ``exec`` on a plain sandbox.

Run: ``python -m dsec.bench.squash [--steps 50] [--mb 20] [--out DIR]`` (root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
from pathlib import Path


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def run(steps: int, mb: int, full_every: int) -> dict:
    import time

    from dsec.bench.recovery import engines_side_by_side
    from dsec.checkpoints.unit import complete_units
    from dsec.models import ExecRequest

    work = Path(tempfile.mkdtemp(prefix="dsec-bench-squash-"))
    variants = {"inline_squash": {"checkpoint_squash_background": False, "checkpoint_full_every": full_every},
                "background_squash": {"checkpoint_squash_background": True, "checkpoint_full_every": full_every}}
    per_step = mb * 1_000_000 // steps
    t: dict[str, list[float]] = {"plain_exec": [], **{m: [] for m in variants}}
    ck: dict[str, list[float]] = {m: [] for m in variants}
    try:
        async with engines_side_by_side(work, variants) as (node, engines, plain):
            for i in range(steps):
                cmd = f"mkdir -p /work && head -c {per_step} /dev/urandom > /work/f{i} && echo {i} >> /work/log"
                t0 = time.perf_counter()
                await node.exec(plain.id, ExecRequest(cmd=cmd))
                t["plain_exec"].append(time.perf_counter() - t0)
                order = list(engines.items())
                for mode, eng in (order if i % 2 else order[::-1]):
                    t0 = time.perf_counter()
                    r = await eng.step(mode, i, ExecRequest(cmd=cmd))
                    t[mode].append(time.perf_counter() - t0)
                    ck[mode].append(r.checkpoint_s)
            chains = {m: len((await asyncio.to_thread(complete_units, e.store, m))[0].fs_chain)
                      for m, e in engines.items()}
            stats = {m: dict(e.counters) for m, e in engines.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ms = lambda xs: {"p50_ms": _pct(xs, 0.5) * 1000, "p99_ms": _pct(xs, 0.99) * 1000, "max_ms": max(xs) * 1000,
                     "mean_ms": statistics.mean(xs) * 1000}
    out = {"steps": steps, "changed_mb": mb, "full_every": full_every,
           "step_wall": {k: ms(v) for k, v in t.items()},
           "checkpoint_s_per_step": {k: ms(v) for k, v in ck.items()},
           "final_chain_layers": chains,
           "background_squashes": stats["background_squash"]["squashes"],
           "background_squash_seconds_total": stats["background_squash"]["squash_seconds_total"]}
    out["max_checkpoint_ratio_background_vs_inline"] = (out["checkpoint_s_per_step"]["background_squash"]["max_ms"]
                                                        / out["checkpoint_s_per_step"]["inline_squash"]["max_ms"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--mb", type=int, default=20)
    ap.add_argument("--full-every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("reports"))
    a = ap.parse_args()
    report = asyncio.run(run(a.steps, a.mb, a.full_every))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "squash-bench.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
