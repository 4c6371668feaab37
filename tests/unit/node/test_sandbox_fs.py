"""SandboxFS on a plain directory (no root): special files are refused without being
opened, limits count apparent sizes before reading, listings page in bounded memory,
and the streamed tar is a faithful archive (issue 18 #2, #3, #11, #13)."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import InvalidArgument, NotFound, PayloadTooLarge
from dsec.node.files import SandboxFS


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() on a thread; fails the test if it is still blocked after ``seconds``."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the call blocked"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture
def fs(tmp_path: Path) -> SandboxFS:
    (tmp_path / "root").mkdir()
    return SandboxFS(str(tmp_path / "root"))


def test_fifos_are_refused_without_blocking(fs: SandboxFS) -> None:
    """Write (with or without a reader on the other end), read and tar upload onto a
    fifo answer 422 naming it at once; a write used to block forever in open()."""
    os.mkdir(f"{fs.root}/q")
    os.mkfifo(f"{fs.root}/q/f")
    for op in (lambda: fs.write("/q/f", b"x"), lambda: fs.read("/q/f", 10)):
        with pytest.raises(InvalidArgument, match="is a fifo"):
            _within(2, op)
    reader = os.open(f"{fs.root}/q/f", os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(InvalidArgument, match="is a fifo"):
            _within(2, lambda: fs.write("/q/f", b"x"))
    finally:
        os.close(reader)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        ti = tarfile.TarInfo("f")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(InvalidArgument, match="is a fifo"):
        _within(2, lambda: fs.upload_tar("/q", buf.getvalue()))
    with tarfile.open(fileobj=io.BytesIO(fs.download_tar("/", 1 << 20))) as tf:
        assert [m.name for m in tf] == ["q"]  # the fifo is left out of downloads


def test_sparse_files_count_their_apparent_size(fs: SandboxFS) -> None:
    """A 1 GiB hole is 413 for read and tar before a byte is read (fast, no memory)."""
    with open(f"{fs.root}/big", "wb") as fh:
        fh.truncate(1 << 30)
    with pytest.raises(PayloadTooLarge, match="apparent"):
        _within(2, lambda: fs.read("/big", 1 << 20))
    with pytest.raises(PayloadTooLarge, match="apparent"):
        _within(2, lambda: fs.tar_size("/", 1 << 20))


def test_streamed_tar_round_trips(fs: SandboxFS, tmp_path: Path) -> None:
    """iter_tar's pieces form a tar that tarfile reads back: dirs, files (one over a
    chunk), symlinks, long names; a file cut while archived is zero-padded to its size."""
    os.makedirs(f"{fs.root}/a/b")
    payload = os.urandom((1 << 20) + 12345)
    Path(f"{fs.root}/a/b/data").write_bytes(payload)
    long = "n" * 150
    Path(f"{fs.root}/a/{long}").write_bytes(b"long")
    os.symlink("/etc/passwd", f"{fs.root}/a/link")
    total = fs.tar_size("/a", 16 << 20)
    data = b"".join(fs.iter_tar("/a", 16 << 20))
    assert len(data) == total
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        got = {m.name: m for m in tf}
        assert tf.extractfile(got["b/data"]).read() == payload  # type: ignore[union-attr]
        assert tf.extractfile(got[long]).read() == b"long"  # type: ignore[union-attr]
        assert got["link"].issym() and got["link"].linkname == "/etc/passwd"
    it = fs.iter_tar("/a", 16 << 20)
    first = next(it)  # the big file's first piece is out ...
    os.truncate(f"{fs.root}/a/b/data", 10)  # ... when the sandbox cuts it
    rest = b"".join(it)
    with tarfile.open(fileobj=io.BytesIO(first + rest)) as tf:
        member = tf.getmember("b/data")
        assert member.size == len(payload) and len(tf.extractfile(member).read()) == len(payload)  # type: ignore[union-attr]


def test_listing_pages_in_name_order(fs: SandboxFS) -> None:
    """list_page returns `limit` entries after the cursor and the next cursor; the last
    page has none; an unknown directory is 404."""
    os.mkdir(f"{fs.root}/d")
    for i in range(25):
        Path(f"{fs.root}/d/n{i:02d}").write_bytes(b"x" * i)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        entries, cursor = fs.list_page("/d", 10, cursor)
        seen += [e.name for e in entries]
        pages += 1
        if cursor is None:
            break
    assert seen == [f"n{i:02d}" for i in range(25)] and pages == 3
    assert [e.size for e in fs.list_page("/d", 2, "n10")[0]] == [11, 12]
    with pytest.raises(NotFound):
        fs.list_page("/nope", 10, None)
