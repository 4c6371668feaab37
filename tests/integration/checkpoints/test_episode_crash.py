"""Crash safety of episodes: die at every fault point, corrupt every part, fill the disk.

Each crash runs the scripted agent in a real child process that dies (os._exit) at a
named fault point of the checkpoint protocol; the parent resumes the episode and checks
that it continues from the last complete unit, never runs a logged command twice, and
ends in exactly the state of a fault-free run.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_agent import command, make_engine, run_agent
from ckpt_helpers import tree

from dsec import errors
from dsec.blobs import cas_key
from dsec.checkpoints.unit import complete_units, list_unit_keys, load_meta
from dsec.models import ExecRequest, SandboxSpec
from dsec.node import syscalls
from dsec.testing.faults import FAULT_EXIT_CODE

pytestmark = pytest.mark.integration
N = 8
NO_INLINE = {"checkpoint_inline_max_bytes": 0}
HERE = Path(__file__).parent



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Outputs, fs digests and final tree of a fault-free run."""
    work = tmp_path_factory.mktemp("ref")
    eng = make_engine(work)

    async def go():
        res = await run_agent(eng, "ep", N)
        info = await eng.info("ep")
        t = tree(work / "sbx" / info.sandbox_id / "merged", mtimes=False)
        await eng.close("ep")
        return res, t
    res, t = asyncio.run(go())
    return [(r.stdout, r.exit_code, r.fs_digest) for r in res], t


async def _resume_and_finish(eng, ep="ep"):
    info = await eng.open(ep)
    res = await run_agent(eng, ep, N)
    live = await eng.info(ep)
    t = tree(Path(eng.host.root) / live.sandbox_id / "merged", mtimes=False)
    ctx = await eng.context(ep)
    await eng.close(ep)
    return info, res, t, ctx


def _check_finished(reference, info, res, t, ctx):
    ref_out, ref_tree = reference
    assert [(r.stdout, r.exit_code, r.fs_digest) for r in res] == ref_out
    assert all(r.replayed for r in res[: info.steps]) and not any(r.replayed for r in res[info.steps:])
    assert t == ref_tree  # includes /work/log: one line per step, so no step ran twice
    assert t["work/log"] and len(res) == N
    assert ctx == {"messages": ["m0", "m1", "m2", "m3"]}


POINTS = ["ckpt.after_part.fs@3", "ckpt.after_part.trajectory@4", "ckpt.after_parts@5",
          "ckpt.after_meta@6", "ckpt.mid_retention@2", "blob.local.mid_write@7",
          "blob.local.before_rename@10", "ckpt.after_part.context@1"]


@pytest.mark.parametrize("point", POINTS)
def test_crash_at_fault_point_resumes_from_last_complete_unit(work, reference, point):
    """A process killed at any write of the unit protocol leaves only complete units;
    the resumed episode fast-forwards the logged steps and ends equal to a fault-free run."""
    make_engine(work)  # builds the image dir once, outside the child
    name, _, nth = point.partition("@")
    proc = subprocess.run([sys.executable, str(HERE / "ckpt_agent.py"), str(work), "ep", str(N)],
                          env={**os.environ, "DSEC_FAULTS": f"{name}=exit@{nth}"}, timeout=120, check=False)
    assert proc.returncode == FAULT_EXIT_CODE
    eng = make_engine(work)
    # Nothing partial is visible: every unit with metadata is complete.
    keys = list_unit_keys(eng.store, "ep")
    assert len(complete_units(eng.store, "ep")) == len(keys) > 0
    info, res, t, ctx = asyncio.run(_resume_and_finish(eng))
    assert 0 <= info.steps < N
    _check_finished(reference, info, res, t, ctx)
    # The crashed process's sandbox was recorded before it existed, so resuming removed it.
    assert syscalls.mounts_under(str(work / "sbx")) == []
    assert eng.store.list("episodes/ep/sandboxes/") == []


def _newest_meta(eng):
    return load_meta(eng.store, list_unit_keys(eng.store, "ep")[0][1])


def _run_fault_free(work, n=N, **settings):
    eng = make_engine(work, **settings)
    asyncio.run(run_agent(eng, "ep", n))
    asyncio.run(eng.forget("ep"))
    return eng


@pytest.mark.parametrize("part", ["metadata", "fs", "manifest", "trajectory", "context"])
@pytest.mark.parametrize("replica", ["r1", "r2"])
def test_one_corrupt_replica_loses_nothing(work, reference, part, replica):
    """Corrupting or truncating any part on one replica is healed from the other replica:
    the episode resumes at its last step."""
    eng = _run_fault_free(work, **NO_INLINE)  # every part a separate blob (inline ones live in the metadata)
    meta = _newest_meta(eng)
    key = {"metadata": lambda: list_unit_keys(eng.store, "ep")[0][1],
           "fs": lambda: cas_key(meta.fs_chain[-1].digest),
           "manifest": lambda: cas_key(meta.fs_manifest.digest),
           "trajectory": lambda: cas_key(meta.trajectory[-1].digest),
           "context": lambda: cas_key(meta.context.digest)}[part]()
    path = work / replica / key
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if replica == "r1" else data[:-3] + b"XYZ")
    info, res, t, ctx = asyncio.run(_resume_and_finish(make_engine(work, **NO_INLINE)))
    assert info.steps == N
    _check_finished(reference, info, res, t, ctx)


@pytest.mark.parametrize("part", ["metadata", "fs", "trajectory"])
def test_corrupt_everywhere_falls_back_to_previous_unit(work, reference, part):
    """When a part of the newest unit is bad on every replica, restore uses the previous
    complete unit (one step fewer), re-runs that step live, and still ends correct."""
    eng = _run_fault_free(work, **NO_INLINE)
    meta = _newest_meta(eng)
    key = {"metadata": lambda: list_unit_keys(eng.store, "ep")[0][1],
           "fs": lambda: cas_key(meta.fs_chain[-1].digest),
           "trajectory": lambda: cas_key(meta.trajectory[-1].digest)}[part]()
    for r in ("r1", "r2"):
        p = work / r / key
        p.write_bytes(b"\0" * max(p.stat().st_size, 1))
    info, res, t, ctx = asyncio.run(_resume_and_finish(make_engine(work, **NO_INLINE)))
    assert info.steps < N
    _check_finished(reference, info, res, t, ctx)
    # New units are numbered above the corrupt one, so the next resume sees every step.
    info, res, t, ctx = asyncio.run(_resume_and_finish(make_engine(work, **NO_INLINE)))
    assert info.steps == N
    _check_finished(reference, info, res, t, ctx)


def test_disk_full_is_storage_full_and_previous_unit_intact(work, reference):
    """A checkpoint root on a tiny tmpfs fills up mid-episode: the client gets StorageFull,
    the last unit stays complete, and after space is freed the episode finishes correctly
    (the failed step was never logged, so it runs once, live)."""
    small = work / "small"
    small.mkdir()
    syscalls.mount_tmpfs(str(small), 48 * 1024)
    eng = make_engine(work, roots=[work / "r1", small], **NO_INLINE)

    async def go():
        await eng.open("ep", SandboxSpec(image="bb"))
        for i in range(N):
            try:
                await eng.step("ep", i, ExecRequest(cmd=command(i)))
            except errors.StorageFull as exc:
                return i, exc
        return N, None
    failed_at, exc = asyncio.run(go())
    assert exc is not None and "full" in str(exc) and failed_at < N
    units = complete_units(eng.store, "ep")
    assert units and units[0].steps == failed_at
    syscalls.umount(str(small))  # "free space": the mount point dir is empty and on the big disk
    eng2 = make_engine(work, roots=[work / "r1", small], **NO_INLINE)
    asyncio.run(eng.forget("ep"))
    info, res, t, ctx = asyncio.run(_resume_and_finish(eng2))
    assert info.steps == failed_at
    _check_finished(reference, info, res, t, ctx)


def test_episode_on_s3_store_resumes(work, reference, s3_store_factory):
    """The same episode with an S3 checkpoint store (real S3 protocol server): a crash of
    the client process mid-episode resumes from S3 alone on a fresh engine and cache."""
    from dsec.checkpoints.engine import EpisodeEngine
    eng = make_engine(work)
    eng.store = s3_store_factory()

    async def partial():
        await eng.open("ep", SandboxSpec(image="bb"))
        for i in range(5):
            await eng.step("ep", i, ExecRequest(cmd=command(i)))
            if i == 3:
                await eng.save_context("ep", {"messages": ["m0", "m1", "m2", "m3"]})
        await eng.forget("ep")
    asyncio.run(partial())
    fresh = EpisodeEngine(eng.settings, s3_store_factory(), eng.host, cache_dir=work / "other-node-cache")
    info, res, t, ctx = asyncio.run(_resume_and_finish(fresh))
    assert info.steps == 5
    _check_finished(reference, info, res, t, ctx)


def test_crash_before_the_first_unit_leaves_no_sandbox_behind(work, reference):
    """Killed while writing the episode's very first unit: no unit exists, so the next open
    creates the episode afresh, and the sandbox the dead process made (recorded before it
    existed) is destroyed rather than leaked."""
    make_engine(work)
    proc = subprocess.run([sys.executable, str(HERE / "ckpt_agent.py"), str(work), "ep", str(N)],
                          env={**os.environ, "DSEC_FAULTS": "ckpt.after_parts=exit@1"}, timeout=120, check=False)
    assert proc.returncode == FAULT_EXIT_CODE
    eng = make_engine(work)
    assert list_unit_keys(eng.store, "ep") == [] and len(eng.store.list("episodes/ep/sandboxes/")) == 1

    async def go():
        res = await run_agent(eng, "ep", N)   # opens with the agent's spec: a fresh episode
        await eng.close("ep")
        return res
    res = asyncio.run(go())
    assert not any(r.replayed for r in res)
    assert [(r.stdout, r.exit_code, r.fs_digest) for r in res] == reference[0]
    assert syscalls.mounts_under(str(work / "sbx")) == []
    assert eng.store.list("episodes/ep/sandboxes/") == []
