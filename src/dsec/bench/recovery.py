"""Recovery benchmark on real runc sandboxes, each figure next to its baseline.

1. Per-step checkpoint overhead: the same step run as a plain ``exec`` on a plain
   sandbox (baseline) and as an episode step (exec + checkpoint unit, durable before the
   result returns), for steps changing nothing, 100 KB and 1 MB, and a 1 s "realistic"
   step changing 1 MB. Reported as ms and as a fraction of the step's wall time.
2. Restore to the last step of a 50-step episode that changed 20 MB of files: server
   state dropped and sandbox destroyed, then ``open`` (verify parts, unpack layers, new
   sandbox) until the first new step returns; cold (layer cache emptied: any node) and
   warm. Baseline: creating a fresh sandbox of the same image.

Run: ``python -m dsec.bench.recovery [--out DIR]`` (root).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from dsec.blobs import LocalBlobStore, ReplicatedBlobStore
from dsec.checkpoints.engine import EpisodeEngine
from dsec.checkpoints.nodehost import NodeEpisodeHost
from dsec.config import load_settings
from dsec.models import ExecRequest, SandboxSpec

SPEC = SandboxSpec(image="busybox", cpu=1, memory="512M", disk="256M")
STEP_KINDS = {
    "no_change": "true",
    "change_100KB": "head -c 100000 /dev/urandom > /tmp/f_$RANDOM",
    "change_1MB": "head -c 1000000 /dev/urandom > /tmp/g_$RANDOM",
    "realistic_1s_1MB": "sleep 1; head -c 1000000 /dev/urandom > /tmp/h_$RANDOM",
}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


async def _node(work: Path):
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock
    from dsec.node.agent import LocalNodeAgent
    run_dir = Path(tempfile.mkdtemp(prefix="dbr-", dir="/tmp"))
    settings = load_settings(home=work / "home", run_dir=run_dir, net_enabled=False)
    store = ImageStore(work / "home" / "images", settings)
    ensure_stock(store, only=["busybox"], log=lambda _: None)
    node = LocalNodeAgent(settings, images=store)
    await node.manager.start()
    return node, settings


@contextlib.asynccontextmanager
async def engines_side_by_side(work: Path, variants: dict[str, dict]) -> AsyncIterator[tuple]:
    """A real node, one episode engine per settings variant (each with an open episode of
    its own name) and a plain sandbox as the no-logging baseline; all torn down after."""
    node, settings = await _node(work)
    engines = {}
    for mode, update in variants.items():
        store = ReplicatedBlobStore([LocalBlobStore(work / mode / "r1"), LocalBlobStore(work / mode / "r2")])
        engines[mode] = EpisodeEngine(settings.model_copy(update=update), store, NodeEpisodeHost(node),
                                      cache_dir=work / mode / "cache")
        await engines[mode].open(mode, SPEC)
    plain = await node.create(SPEC)
    try:
        yield node, engines, plain
    finally:
        for mode, eng in engines.items():
            await eng.close(mode)
        await node.destroy(plain.id)
        node.manager.close()
        shutil.rmtree(node.settings.runtime_dir, ignore_errors=True)


async def bench_overhead(node, settings, work: Path, reps: int) -> dict:
    store = ReplicatedBlobStore([LocalBlobStore(work / "r1"), LocalBlobStore(work / "r2")])
    eng = EpisodeEngine(settings, store, NodeEpisodeHost(node), cache_dir=work / "cache")
    plain = await node.create(SPEC)
    await eng.open("overhead", SPEC)
    out: dict = {}
    step = 0
    for kind, cmd in STEP_KINDS.items():
        n = reps if "1s" not in kind else max(3, reps // 5)
        base, ep, ckpt = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            await node.exec(plain.id, ExecRequest(cmd=cmd))
            base.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = await eng.step("overhead", step, ExecRequest(cmd=cmd))
            ep.append(time.perf_counter() - t0)
            ckpt.append(r.checkpoint_s)
            step += 1
        mb, me, mc = statistics.median(base), statistics.median(ep), statistics.median(ckpt)
        out[kind] = {"n": n, "plain_exec_ms": mb * 1000, "episode_step_ms": me * 1000,
                     "checkpoint_ms_median": mc * 1000, "checkpoint_ms_p99": _pct(ckpt, 0.99) * 1000,
                     "overhead_fraction_of_step_wall": (me - mb) / me if me else None,
                     "checkpoint_fraction_of_step_wall": mc / me if me else None}
    await eng.close("overhead")
    await node.destroy(plain.id)
    return out


async def bench_restore(node, settings, work: Path, steps: int, total_mb: int, reps: int) -> dict:
    store = ReplicatedBlobStore([LocalBlobStore(work / "q1"), LocalBlobStore(work / "q2")])
    cache = work / "rcache"
    mk = lambda: EpisodeEngine(settings, store, NodeEpisodeHost(node), cache_dir=cache)
    eng = mk()
    await eng.open("restore", SPEC)
    per_step = total_mb * 1_000_000 // steps
    for i in range(steps):
        await eng.step("restore", i, ExecRequest(cmd=f"mkdir -p /work && head -c {per_step} /dev/urandom "
                                                     f"> /work/f{i} && echo {i} >> /work/log"))
    info = await eng.info("restore")
    creates, cold, warm = [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        sb = await node.create(SPEC)
        await node.exec(sb.id, ExecRequest(cmd="true"))
        creates.append(time.perf_counter() - t0)
        await node.destroy(sb.id)
        for bucket, clear in ((cold, True), (warm, False)):
            live = await eng.info("restore")
            await node.destroy(live.sandbox_id)        # the sandbox dies
            await eng.forget("restore")                 # and the server restarts
            if clear:
                shutil.rmtree(cache, ignore_errors=True)  # no unpacked layer here: "any node"
            eng = mk()
            t0 = time.perf_counter()
            opened = await eng.open("restore")
            r = await eng.step("restore", steps + len(cold) + len(warm), ExecRequest(cmd="wc -l < /work/log"))
            bucket.append(time.perf_counter() - t0)
            assert opened.fs_digest == info.fs_digest and r.stdout.strip() == str(steps), r
            steps_done = (await eng.info("restore")).steps
            info = await eng.info("restore")
            assert steps_done == info.steps
    await eng.close("restore")
    ms = lambda xs: {"n": len(xs), "p50_s": _pct(xs, 0.5), "p99_s": _pct(xs, 0.99)}
    return {"steps": steps, "changed_mb": total_mb, "fs_chain_layers_max": settings.checkpoint_full_every,
            "baseline_fresh_create_to_first_exec": ms(creates),
            "restore_to_first_new_step_cold": ms(cold), "restore_to_first_new_step_warm": ms(warm),
            "cold_vs_fresh_create_ratio": _pct(cold, 0.5) / _pct(creates, 0.5)}


async def run(out: Path, reps: int = 20, restore_reps: int = 10) -> dict:
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-recovery-"))
    node, settings = await _node(work)
    try:
        report = {"overhead": await bench_overhead(node, settings, work, reps),
                  "restore": await bench_restore(node, settings, work, 50, 20, restore_reps)}
    finally:
        for sid in list(node.manager.live):
            try:
                await node.manager.destroy(sid)
            except Exception:  # noqa: BLE001
                pass
        node.manager.close()
        shutil.rmtree(node.settings.runtime_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery-bench.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--restore-reps", type=int, default=10)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(run(a.out, a.reps, a.restore_reps)), indent=2))
