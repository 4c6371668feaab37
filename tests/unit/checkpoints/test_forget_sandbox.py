"""A kill's checkpoint bookkeeping (``SandboxCheckpoints.forget_sandbox``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from dsec.blobs.local import LocalBlobStore
from dsec.checkpoints.sandbox_ckpt import _BASES, SandboxCheckpoints
from dsec.config import Settings


class CountingStore(LocalBlobStore):
    """A real local store that counts deletes (each one is a thread hop on a kill)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.deletes: list[str] = []

    def delete(self, key: str) -> None:
        self.deletes.append(key)
        super().delete(key)


def test_kill_of_an_unrestored_sandbox_skips_the_store_but_a_restored_ones_base_goes(tmp_path: Path) -> None:
    """Issue 15: an RL episode ends with a kill, and almost no killed sandbox was restored
    from a checkpoint, so none has a base record: the kill must not pay a store delete (a
    thread hop) for it. A base record written before a restart (found by the one listing
    at the first kill) and one written by a restore in this process are still deleted, so
    no restored sandbox's record outlives it."""
    store = CountingStore(tmp_path / "store")
    store.put(_BASES + "sb-before-restart", b'{"tenant": "t", "checkpoint_id": "ck-1"}')
    ck = SandboxCheckpoints(Settings(home=tmp_path), store, node=SimpleNamespace(manager=SimpleNamespace(before_teardown=[])), cache_dir=tmp_path / "layers")

    async def main() -> None:
        await ck.forget_sandbox("sb-plain")
        assert store.deletes == []  # never restored: nothing to delete
        await ck.forget_sandbox("sb-before-restart")
        assert store.deletes == [_BASES + "sb-before-restart"]
        assert store.list(_BASES) == []
        ck._bases.add("sb-restored-here")  # what a restore's create records before its write
        store.put(_BASES + "sb-restored-here", b"{}")
        await ck.forget_sandbox("sb-restored-here")
        await ck.forget_sandbox("sb-plain-2")
        assert store.deletes == [_BASES + "sb-before-restart", _BASES + "sb-restored-here"]
        assert store.list(_BASES) == []

    asyncio.run(main())
