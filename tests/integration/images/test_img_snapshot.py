"""Snapshotter on real overlayfs: prepare/mount/commit, whiteouts, leases vs GC,
verification of cached layers, and one unpack per digest across threads and processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from dsec.images import ImageStore, Snapshotter
from dsec.images.craft import CraftedImage, Entry, layer_tar, write_oci_layout
from dsec.node import syscalls

pytestmark = pytest.mark.integration


def _run(root: Path, script: str) -> str:
    proc = subprocess.run(["chroot", str(root), "/bin/sh", "-c", script], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_prepare_mount_commit_roundtrip(store: ImageStore, tmp_path: Path) -> None:
    """Changes in a sandbox (new file, deleted file, replaced dir) commit to a layer whose
    whiteouts/opaque dirs reproduce the same view when stacked on the image."""
    snap = Snapshotter(store)
    m = snap.prepare("sb1", "busybox", tmp_path / "s1")
    assert m.lower_dirs == [str(p) for p in reversed(store.layer_dirs(m.image.id))]
    root = tmp_path / "r1"
    root.mkdir()
    snap.mount(m, root)
    try:
        _run(root, "echo new > /work/new.txt; rm /etc/hosts; rm -rf /usr/bin; mkdir /usr/bin; "
                   "ln -s /bin/busybox /usr/bin/only")
    finally:
        syscalls.umount(str(root))
    layer = snap.commit(Path(m.upper_dir))
    assert snap.commit(Path(m.upper_dir)).digest == layer.digest  # deterministic
    snap.release("sb1")
    base = store.resolve("busybox")
    import json
    cfg = json.loads(store.content.read_bytes(base.id))
    cfg["rootfs"]["diff_ids"].append(layer.diff_id)
    info = store.register(json.dumps(cfg).encode(), base.layers + [layer], ["child:1"])
    m2 = snap.prepare("sb2", "child:1", tmp_path / "s2")
    root2 = tmp_path / "r2"
    root2.mkdir()
    snap.mount(m2, root2)
    try:
        out = _run(root2, "cat /work/new.txt; ls /etc; ls /usr/bin")
    finally:
        syscalls.umount(str(root2))
        snap.release("sb2")
    assert out.split() == ["new", "group", "passwd", "only"]
    assert info.id == store.resolve("child:1").id


def test_prepare_errors_and_empty_extra_lowers(store: ImageStore, tmp_path: Path) -> None:
    """Unknown image -> NotFound and no lease left; extra lower dirs go on top."""
    from dsec.errors import NotFound
    snap = Snapshotter(store)
    with pytest.raises(NotFound):
        snap.prepare("k", "nope", tmp_path / "s")
    assert "k" not in store.db.leases()
    (tmp_path / "extra").mkdir()
    m = snap.prepare("k", "busybox", tmp_path / "s", extra_lower_dirs=[tmp_path / "extra"])
    assert m.lower_dirs[0] == str(tmp_path / "extra") and Path(m.work_dir).is_dir()
    assert snap.access_order(m.image.id)[0][0] == m.image.layers[0].diff_id


def test_lease_protects_layers_from_gc(store: ImageStore, tmp_path: Path) -> None:
    """GC never deletes blobs/layers held by a lease, even after the image is removed."""
    snap = Snapshotter(store)
    m = snap.prepare("running", "busybox", tmp_path / "s")
    store.remove("busybox")
    report = store.gc(unused_s=0)
    leased = {m.image.id, m.image.layers[0].digest}
    assert report.removed_blobs and not leased & set(report.removed_blobs)  # only the manifest went
    assert all(Path(d).is_dir() for d in m.lower_dirs)
    snap.release("running")
    report = store.gc(unused_s=0)
    assert m.image.layers[0].digest in report.removed_blobs
    assert store.layers.all_diff_ids() == [] and not store.content.has(m.image.layers[0].digest)


def test_tampered_unpacked_layer_is_reunpacked(store: ImageStore, home: Path) -> None:
    """A modified unpacked layer is detected on first use by a new process and re-unpacked."""
    info = store.resolve("busybox")
    fs = store.layer_dirs(info.id)[0]
    (fs / "etc/passwd").write_text("evil:x:0:0::/:/bin/sh\n" * 3)
    fresh = ImageStore(store.root, store.settings)
    assert fresh.layers.verify(info.layers[0].diff_id) is not None
    # Node start-up pre-verification repairs it before any use: once the thread is done the
    # layer verifies again and exactly one re-unpack happened (not one deferred to first use).
    t = fresh.start_preverify()
    t.join(timeout=60)
    assert not t.is_alive()
    assert fresh.misses == 1 and fresh.layers.verify(info.layers[0].diff_id) is None
    fs2 = fresh.layer_dirs(info.id)[0]
    assert fresh.misses == 1 and (fs2 / "etc/passwd").read_text().startswith("root:")
    # a wrong seal (stale tree from old code) is never trusted either
    seal = fs2.parent / "seal.json"
    from dsec.images.layers import SEAL_FORMAT
    stale = seal.read_text().replace(f'"format": {SEAL_FORMAT}', '"format": 0')
    assert stale != seal.read_text()
    seal.write_text(stale)
    third = ImageStore(store.root, store.settings)
    third.layer_dirs(info.id)
    assert third.misses == 1 and third.layers.verify(info.layers[0].diff_id) is None


def test_concurrent_prepares_share_one_unpack(store: ImageStore, tmp_path: Path) -> None:
    """8 threads preparing an image whose layer is not unpacked cause exactly one unpack."""
    write_oci_layout(tmp_path / "l", CraftedImage([layer_tar([Entry("d", type=tarfile.DIRTYPE, mode=0o755)] +
                                                             [Entry(f"d/{i}", os.urandom(20000)) for i in range(200)])]))
    info = store.import_archive(tmp_path / "l", name="c:1")
    for d in store.layers.all_diff_ids():
        store.layers.remove(d)
    fresh = ImageStore(store.root, store.settings)
    snap = Snapshotter(fresh)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            snap.prepare(f"t{i}", "c:1", tmp_path / f"s{i}")
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and fresh.misses == 1 and fresh.hits == 7
    assert info.id == fresh.resolve("c:1").id


CHILD = """
import sys
from pathlib import Path
from dsec.config import load_settings
from dsec.images import ImageStore
s = load_settings(home=Path(sys.argv[1]))
st = ImageStore(Path(sys.argv[1]) / "images", s)
st.layer_dirs(st.resolve("c:1").id)
print(st.misses)
"""


def test_concurrent_processes_share_one_unpack(store: ImageStore, tmp_path: Path, home: Path) -> None:
    """Three processes ensuring the same missing layer: exactly one of them unpacks it."""
    write_oci_layout(tmp_path / "l", CraftedImage([layer_tar([Entry(f"f{i}", os.urandom(20000)) for i in range(150)])]))
    store.import_archive(tmp_path / "l", name="c:1")
    for d in store.layers.all_diff_ids():
        store.layers.remove(d)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(home)], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate()[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(outs) == ["0", "0", "1"]
