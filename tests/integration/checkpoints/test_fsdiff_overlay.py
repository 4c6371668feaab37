"""Incremental checkpoints of a real overlay upper dir restore byte for byte."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from ckpt_helpers import tree

from dsec.blobs import LocalBlobStore, put_blob
from dsec.checkpoints import fsdiff
from dsec.checkpoints.fsstate import FsTracker, materialize
from dsec.checkpoints.unit import read_part

pytestmark = pytest.mark.integration


def _steps(m: Path) -> list:
    """A scripted sequence of filesystem edits covering every overlay case."""
    def s0():
        (m / "work").mkdir()
        (m / "work" / "a.py").write_text("print(1)\n")
        (m / "work" / "big.bin").write_bytes(random.Random(0).randbytes(300_000))

    def s1():
        (m / "etc" / "hosts").write_text("10.0.0.1 db\n")       # copy-up of an image file
        os.remove(m / "etc" / "conf.d" / "a.conf")              # whiteout of an image file
        os.chmod(m / "bin" / "tool", 0o700)                      # metadata-only copy-up

    def s2():
        pass                                                     # a step that changes nothing

    def s3():
        os.remove(m / "work" / "a.py")                           # upper-only file deleted
        os.symlink("../etc/hosts", m / "work" / "hosts-link")
        shutil.rmtree(m / "etc" / "conf.d")                      # image dir deleted ...
        (m / "etc" / "conf.d").mkdir()                           # ... and recreated: opaque
        (m / "etc" / "conf.d" / "c.conf").write_text("c=1\n")

    def s4():
        shutil.rmtree(m / "work")                                # dir of earlier layers gone
        (m / "work").mkdir()
        (m / "work" / "b.py").write_text("print(2)\n")
        os.mkfifo(m / "work" / "pipe")

    def s5():
        os.remove(m / "work" / "pipe")
        (m / "work" / "b.py").write_text("print(3)\n")
        os.chown(m / "work" / "b.py", 1234, 5678)
    return [s0, s1, s2, s3, s4, s5]


@pytest.mark.parametrize("full_every", [2, 20])
def test_checkpoint_chain_restores_byte_for_byte(tmp_path, image_dir, overlays, full_every):
    """After every step, restoring the checkpoint chain over the image gives the same tree,
    also when the chain is periodically squashed into a full checkpoint; steps that change
    nothing write no layer."""
    store = LocalBlobStore(tmp_path / "blobs")
    ov = overlays(tmp_path / "live", [image_dir])
    in_image = fsdiff.image_lookup([image_dir])
    tr = FsTracker(in_image=in_image, full_every=full_every)
    for i, step in enumerate(_steps(ov.merged)):
        step()
        cap, commit = tr.capture(ov.upper, lambda r: read_part(store, r))
        for blob in cap.new_parts:
            put_blob(store, blob)
        commit()
        assert cap.changed == (i != 2)
        assert len(tr.chain) <= full_every
        lowers = materialize(store, tr.chain, tmp_path / "cache")
        restored = overlays(tmp_path / f"r{i}", lowers + [image_dir])
        assert tree(restored.merged) == tree(ov.merged), f"step {i}"


def test_resumed_run_has_same_digest_as_straight_run(tmp_path, image_dir, overlays):
    """A run restored mid-way and continued in a fresh sandbox reaches the same canonical
    filesystem digest and the same tree as the uninterrupted run."""
    store = LocalBlobStore(tmp_path / "blobs")
    in_image = fsdiff.image_lookup([image_dir])
    steps_a = _steps((ov_a := overlays(tmp_path / "a", [image_dir])).merged)
    tr_a = FsTracker(in_image=in_image, full_every=20)
    digests_a = []
    for step in steps_a:
        step()
        cap, commit = tr_a.capture(ov_a.upper, lambda r: read_part(store, r))
        [put_blob(store, b) for b in cap.new_parts]
        commit()
        digests_a.append(cap.fs_digest)

    ov_b = overlays(tmp_path / "b", [image_dir])
    tr_b = FsTracker(in_image=in_image, full_every=20)
    steps_b = _steps(ov_b.merged)
    digests_b = []
    for i in range(3):
        steps_b[i]()
        cap, commit = tr_b.capture(ov_b.upper, lambda r: read_part(store, r))
        [put_blob(store, b) for b in cap.new_parts]
        commit()
        digests_b.append(cap.fs_digest)
    # crash: resume in a new overlay from the checkpoint chain
    lowers = materialize(store, tr_b.chain, tmp_path / "cache")
    ov_c = overlays(tmp_path / "c", lowers + [image_dir])
    tr_c = FsTracker.restored(store, tr_b.chain, tr_b.manifest_ref, in_image, 20, 3)
    steps_c = _steps(ov_c.merged)
    for i in range(3, 6):
        steps_c[i]()
        cap, commit = tr_c.capture(ov_c.upper, lambda r: read_part(store, r))
        [put_blob(store, b) for b in cap.new_parts]
        commit()
        digests_b.append(cap.fs_digest)
    assert digests_b == digests_a
    assert tree(ov_c.merged, mtimes=False) == tree(ov_a.merged, mtimes=False)  # two runs: different clocks
