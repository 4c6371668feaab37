"""Trajectory log encoding: zstd JSONL frames, torn tails, async journal."""

from __future__ import annotations

import subprocess
import sys
import time

import zstandard

from dsec.checkpoints.trajectory import (
    JournalWriter,
    StepRecord,
    decode_segment,
    encode_segment,
    read_journal,
)


def _rec(i: int) -> StepRecord:
    return StepRecord(step=i, command=f"echo {i}", exit_code=0, stdout=f"{i}\n" * 50,
                      started_at=time.time(), duration=0.01)


def test_segment_roundtrip_and_standard_zstd():
    """A segment decodes back to its records and is a plain zstd stream of JSON lines."""
    recs = [_rec(i) for i in range(5)]
    data = encode_segment(recs)
    assert decode_segment(data) == recs
    # Standard tools (`zstd -dc | jq`) read concatenated frames: each line is one record's JSON.
    import io
    import json
    text = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    lines = text.decode().splitlines()
    assert [StepRecord.model_validate(json.loads(line)) for line in lines] == recs


def test_torn_tail_loses_only_last_record():
    """Truncating a segment at any byte keeps every complete record before the cut."""
    recs = [_rec(i) for i in range(4)]
    data = encode_segment(recs)
    frame_ends = []
    total = 0
    for r in recs:
        total += len(encode_segment([r]))
        frame_ends.append(total)
    for cut in range(0, len(data), 7):
        got = decode_segment(data[:cut])
        assert got == recs[: sum(1 for e in frame_ends if e <= cut)]


def test_corrupt_tail_frame_is_dropped():
    """A flipped byte inside the last frame drops that frame only (checksummed frames)."""
    recs = [_rec(i) for i in range(3)]
    data = bytearray(encode_segment(recs))
    data[-6] ^= 0xFF
    assert decode_segment(bytes(data)) == recs[:2]


def test_journal_survives_process_kill(tmp_path):
    """Records flushed before a SIGKILL are all readable afterwards; nothing is garbled."""
    path = tmp_path / "j.zst"
    code = f"""
import os, signal
from dsec.checkpoints.trajectory import JournalWriter
w = JournalWriter(__import__('pathlib').Path({str(path)!r}))
for i in range(20):
    w.append({{"step": i, "out": "x" * 1000}})
    if i % 5 == 4:
        w.flush()
w.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False)
    assert proc.returncode == -9
    got = read_journal(path)
    assert [r["step"] for r in got] == list(range(20))


def test_journal_append_does_not_block(tmp_path):
    """append only queues; flush makes everything durable and in order."""
    w = JournalWriter(tmp_path / "j")
    for i in range(100):
        w.append({"step": i})
    w.flush()
    w.close()
    assert [r["step"] for r in read_journal(tmp_path / "j")] == list(range(100))


def test_journal_future_is_the_records_frame(tmp_path):
    """append's future resolves (after the fsync) to exactly the record's zstd frame, so
    a checkpoint unit can reuse it as its trajectory segment without encoding twice."""
    from dsec.checkpoints.trajectory import encode_record
    w = JournalWriter(tmp_path / "j")
    recs = [_rec(i) for i in range(3)]
    frames = [w.append(r).result(timeout=10) for r in recs]
    w.close()
    assert frames == [encode_record(r) for r in recs]
    assert (tmp_path / "j").read_bytes() == b"".join(frames)
    assert decode_segment(b"".join(frames)) == recs


def test_journal_torn_tail_on_a_real_file_loses_only_the_last_step(tmp_path):
    """A journal file cut anywhere inside its last frame (a crash mid-write) still yields
    every earlier step; a cut exactly at a frame boundary loses nothing."""
    path = tmp_path / "j.zst"
    w = JournalWriter(path)
    recs = [_rec(i) for i in range(5)]
    for r in recs:
        w.append(r)
    w.close()
    full = path.read_bytes()
    last = len(encode_segment([recs[-1]]))
    for cut in range(len(full) - last, len(full) + 1):
        with open(path, "r+b") as fh:  # a real truncated file, as a crash leaves it
            fh.truncate(cut)
        got = [r["step"] for r in read_journal(path)]
        assert got == ([0, 1, 2, 3, 4] if cut == len(full) else [0, 1, 2, 3]), cut
        path.write_bytes(full)


def test_journal_restart_replaces_content_atomically(tmp_path):
    """Opening with ``initial`` (a restored episode) replaces the old journal, including a
    record that was never committed, and appends after it."""
    path = tmp_path / "j"
    w = JournalWriter(path)
    for i in range(3):
        w.append(_rec(i))
    w.close()
    w = JournalWriter(path, initial=encode_segment([_rec(0), _rec(1)]))
    w.append(_rec(2).model_copy(update={"command": "other"}))
    w.close()
    assert [(r["step"], r["command"]) for r in read_journal(path)] == [(0, "echo 0"), (1, "echo 1"), (2, "other")]


def test_journal_write_error_reaches_the_caller(tmp_path):
    """A failed write (here: the file handle closed under the writer) fails the pending
    future and every later append/flush, instead of silently losing records."""
    import pytest
    w = JournalWriter(tmp_path / "j")
    w._fh.close()
    fut = w.append(_rec(0))
    with pytest.raises(ValueError):
        fut.result(timeout=10)
    with pytest.raises(ValueError):
        w.flush()
    with pytest.raises(ValueError):
        w.append(_rec(1))
