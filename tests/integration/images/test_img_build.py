"""Builds with the real unshare+chroot+overlay runner: caching, failures, isolation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dsec.errors import BuildFailed, NotFound
from dsec.images import ImageStore, Snapshotter
from dsec.images.build import Builder, UnshareRunner, load_spec, make_runner
from dsec.node import syscalls

pytestmark = pytest.mark.integration


def _spec(tmp_path: Path, steps: list[dict], **kw: object) -> Path:  # type: ignore[type-arg]
    (tmp_path / "ctx/app").mkdir(parents=True, exist_ok=True)
    (tmp_path / "ctx/app/hello.txt").write_text("hello from host\n")
    p = tmp_path / "ctx/spec.yaml"
    p.write_text(yaml.safe_dump({"from": "busybox", "steps": steps, **kw}))
    return p


STEPS = [
    {"copy": {"src": "app/", "dest": "/work/app"}},
    {"run": "cp /work/app/hello.txt /work/copied.txt && rm /etc/hosts"},
    {"env": {"GREETING": "hi"}},
    {"workdir": "/work"},
    {"run": "echo $GREETING > greeting.txt; ip -o link | wc -l > links.txt"},
]


def _read(store: ImageStore, ref: str, tmp_path: Path, *paths: str) -> list[str | None]:
    snap = Snapshotter(store)
    m = snap.prepare("read", ref, tmp_path / "scr")
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    snap.mount(m, root)
    try:
        return [(root / p.lstrip("/")).read_text() if (root / p.lstrip("/")).exists() else None for p in paths]
    finally:
        syscalls.umount(str(root))
        snap.release("read")


@pytest.mark.parametrize("backend", ["unshare", "manager"])
def test_build_runs_steps_and_caches(store: ImageStore, tmp_path: Path, backend: str) -> None:
    """copy/run/env/workdir steps produce the right tree on both RUN backends (unshare+chroot,
    real runc sandbox via the SandboxManager); an unchanged rebuild does no work; changing
    only the last step rebuilds only that layer; RUN has no network by default."""
    b = Builder(store, make_runner(backend, store))
    spec = _spec(tmp_path, STEPS)
    r1 = b.build(load_spec(spec), "app:1", spec.parent)
    assert (r1.built, r1.cached) == (3, 0) and len(r1.image.layers) == 4
    copied, greeting, links, hosts = _read(store, "app:1", tmp_path, "/work/copied.txt", "/work/greeting.txt",
                                           "/work/links.txt", "/etc/hosts")
    assert copied == "hello from host\n" and greeting == "hi\n" and hosts is None
    assert links.strip() == "1"  # only loopback: network off
    r2 = b.build(load_spec(spec), "app:1", spec.parent)
    assert (r2.built, r2.cached) == (0, 3) and r2.image.id == r1.image.id
    spec = _spec(tmp_path, STEPS[:-1] + [{"run": "echo changed > /work/last.txt"}])
    r3 = b.build(load_spec(spec), "app:2", spec.parent)
    assert (r3.built, r3.cached) == (1, 2) and r3.image.layers[:3] == r1.image.layers[:3]
    assert r3.image.workdir == "/work" and "GREETING=hi" in r3.image.env


def test_copy_change_invalidates_later_steps(store: ImageStore, tmp_path: Path) -> None:
    """Changing a copied file's content rebuilds the copy step and everything after it."""
    b = Builder(store, UnshareRunner(store.settings))
    spec = _spec(tmp_path, STEPS[:2])
    b.build(load_spec(spec), "app:1", spec.parent)
    (tmp_path / "ctx/app/hello.txt").write_text("changed\n")
    r = b.build(load_spec(spec), "app:1", spec.parent)
    assert (r.built, r.cached) == (2, 0)


@pytest.mark.parametrize("backend", ["unshare", "manager"])
def test_failing_step_registers_nothing(store: ImageStore, tmp_path: Path, backend: str) -> None:
    """A failing RUN step raises BuildFailed naming the step and output; no image appears,
    no scratch dir, lease or build sandbox is left behind."""
    b = Builder(store, make_runner(backend, store))
    spec = _spec(tmp_path, [{"run": "echo about-to-fail; exit 7"}])
    before = {i.id for i in store.list()}
    with pytest.raises(BuildFailed, match=r"(?s)step 1/1 \(run\).*code 7.*about-to-fail"):
        b.build(load_spec(spec), "broken:1", spec.parent)
    assert {i.id for i in store.list()} == before
    with pytest.raises(NotFound):
        store.resolve("broken:1")
    assert not [p for p in store.root.iterdir() if p.name.startswith("build-")]
    assert store.db.leases() == {}
    sandboxes = store.root / "node-build" / "sandboxes"
    assert not sandboxes.exists() or list(sandboxes.iterdir()) == []
    import glob
    assert glob.glob("/run/dsec-build-*") == []  # the manager backend's run dir is gone too
