"""``RecordStore.put_many``: a recycle writes its two sandbox records (the retired id and
the new member) in one commit instead of one per record (issue 15: two commits per
recycle instead of four). All or nothing: a crash between them must not leave one."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.models import SandboxInfo, SandboxSpec, SandboxState
from dsec.node.paths import sandbox_paths
from dsec.node.records import RecordStore, SandboxRecord


def _rec(sid: str, state: SandboxState) -> SandboxRecord:
    info = SandboxInfo(id=sid, state=state, image="busybox", isolation="container", cpu=0.25, memory=1 << 26,
                       disk=1 << 26, pids=64, timeout=60, created_at=1.0)
    return SandboxRecord(info=info, spec=SandboxSpec(image="busybox"), env={}, workdir="/")


def test_put_many_writes_all_in_one_transaction(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "r.db")
    store.put(_rec("sb-0000000000000001", SandboxState.ready))
    store.put_many([_rec("sb-0000000000000001", SandboxState.stopping), _rec("sb-0000000000000002",
                                                                             SandboxState.creating)])
    got = {r.info.id: r.info.state for r in store.all()}
    assert got == {"sb-0000000000000001": SandboxState.stopping, "sb-0000000000000002": SandboxState.creating}

    class Boom(SandboxRecord):
        def model_dump_json(self, **kw: object) -> str:  # type: ignore[override]
            raise RuntimeError("disk full")

    bad = Boom.model_validate(_rec("sb-0000000000000003", SandboxState.creating).model_dump())
    with pytest.raises(RuntimeError):
        store.put_many([_rec("sb-0000000000000001", SandboxState.stopped), bad])
    assert store.get("sb-0000000000000001").info.state is SandboxState.stopping  # type: ignore[union-attr]
    store.close()


def test_sandbox_paths_are_cached_and_derived_from_the_id_alone(tmp_path: Path) -> None:
    a = sandbox_paths(tmp_path, tmp_path / "run", "sb-0000000000000001")
    assert a is sandbox_paths(tmp_path, tmp_path / "run", "sb-0000000000000001")
    assert a.upper == tmp_path / "sandboxes" / "sb-0000000000000001" / "scratch" / "upper"
    assert a.socket == tmp_path / "run" / "s" / "sb-0000000000000001.sock"
