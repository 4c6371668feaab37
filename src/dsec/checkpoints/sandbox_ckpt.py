"""Checkpoints of plain sandboxes: ``sb.checkpoint()`` and ``Sandbox.restore(id)``.

No second checkpoint format: a sandbox checkpoint is one checkpoint unit of the episode
machinery (``dsec.checkpoints.unit``), written with the same pieces the episode engine
uses — ``FsTracker.capture`` (diff of the overlay upper dir into a content-addressed
layer + manifest), ``put_part`` (parts first), ``commit_unit`` (metadata last, its key
embeds its digest) — and restored with ``complete_units`` + ``FsTracker.restored`` +
``materialize`` (every part digest-verified) and a node create with the checkpoint
layers as extra read-only lowers.

Layout: the unit of checkpoint ``ck-<hex>`` of tenant key ``T`` is the single unit of the
pseudo-episode ``sbckpt.T.<hex>`` (``dsec.state.keys.sandbox_checkpoint_episode``). The
API's tenant key is the tenant's immutable uid, so a tenant re-created under the same
name sees none of its predecessor's checkpoints; the scheduler's preemption checkpoints
use its tenant name (internal, never listed). Neither key contains a dot and episode keys
start with a uid then ``--``, so no episode can collide with it; and a lookup is always
under the caller's own key, so another tenant's checkpoint id is simply not found. Because
the units live under ``episodes/``, ``collect_garbage`` sees their parts as referenced.

Bounds (issue 18 #3): a capture whose files' apparent size (sparse files at full length)
exceeds the sandbox's disk quota is refused before anything is read; a restore unpacks at
most the checkpointed sandbox's disk quota per layer, writes zero runs as holes, and its
unpacked layers (``LayerCache``) are deleted once no mounted sandbox uses them.

A sandbox keeps one ``FsTracker`` in memory, so its second checkpoint stores only what
changed since the first (the chain is squashed every ``checkpoint_full_every``). A
restored sandbox's root is image + checkpoint layers + a fresh upper; the checkpoint it
came from is recorded in the store (``sandbox-checkpoints/bases/<sandbox id>``) BEFORE
the sandbox exists, so after a server restart its next checkpoint still stacks on the
right base instead of silently dropping the restored files.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.models.checkpoint import CheckpointInfo
from dsec.blobs import BlobStore
from dsec.checkpoints.fsdiff import image_lookup
from dsec.checkpoints.fsstate import FsTracker
from dsec.checkpoints.layer_cache import LayerCache, disk_quota
from dsec.checkpoints.nodehost import NodeEpisodeHost
from dsec.checkpoints.unit import (
    LayerRef,
    UnitMeta,
    commit_unit,
    complete_units,
    list_unit_keys,
    load_meta,
    put_part,
    read_part,
)
from dsec.config import Settings
from dsec.models import SandboxInfo, SandboxSpec
from dsec.state.keys import sandbox_checkpoint_episode, sandbox_checkpoint_prefix

log = logging.getLogger(__name__)

CHECKPOINT_ID_PATTERN = r"^ck-[0-9a-f]{24}$"
_BASES = "sandbox-checkpoints/bases/"
_LIVE_STATES = ("idle", "running", "ready")


def _episode_id(tenant: str, checkpoint_id: str) -> str:
    return sandbox_checkpoint_episode(tenant, checkpoint_id.removeprefix("ck-"))


def _unknown(checkpoint_id: str) -> errors.NotFound:
    return errors.NotFound(f"checkpoint {checkpoint_id} not found: it never existed, was deleted, or belongs to "
                           "another tenant; list yours with GET /v1/checkpoints", checkpoint_id=checkpoint_id)


def info_of(meta: UnitMeta) -> CheckpointInfo:
    return CheckpointInfo(id=meta.meta["checkpoint_id"], sandbox_id=meta.meta["sandbox_id"],
                          image=meta.compat.image, image_id=meta.compat.image_id, created_at=meta.created_at,
                          fs_digest=meta.fs_digest, size=sum(p.size for p in meta.fs_chain),
                          parent=meta.meta.get("parent"))


@dataclass
class _Tracked:
    tracker: FsTracker
    parent: str | None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


Create = Callable[[SandboxSpec, str, str], Awaitable[SandboxInfo]]
"""(spec, sandbox id, tenant) -> the new sandbox: ``dsec.api.service.Creator``'s shape."""


class SandboxCheckpoints:
    """Checkpoint / restore / list / delete for one node's plain sandboxes.

    Tenancy and dead-sandbox checks are the caller's (the API layer); this class trusts
    the ``tenant`` it is given and owns the storage format.
    """

    def __init__(self, settings: Settings, store: BlobStore, node: Any, cache_dir: Path | None = None) -> None:
        self.settings, self.store, self.node = settings, store, node
        self.host = NodeEpisodeHost(node)  # image view, upper dir, freeze/thaw: the engine's own hooks
        self.cache_dir = cache_dir or settings.checkpoint_cache_dir or settings.home / "ckpt-layers"
        self.layers = LayerCache.at(self.cache_dir, settings.checkpoint_layer_gc_grace_s)
        self._tracked: dict[str, _Tracked] = {}
        # Ids that may have a base record: the restores this process made, plus (once, at
        # the first kill) the records already in the store (restores before a restart).
        # A kill of any other sandbox skips the store delete and its thread hop (issue 15:
        # an RL episode ends with a kill, and almost none are restored sandboxes).
        self._bases: set[str] = set()
        self._bases_listed = False
        hooks = getattr(getattr(node, "manager", None), "before_teardown", None)
        if isinstance(hooks, list):  # TTL, reaper, lease: every teardown, not only API kills
            hooks.append(self._sweep_after_teardown)

    def _sweep_after_teardown(self, sandbox_id: str) -> None:
        """Teardown hook (runs before the unmount): sweep unused layers shortly after it."""
        self.layers.sweep_soon()

    # --- checkpoint ----------------------------------------------------------------
    async def checkpoint(self, tenant: str, sandbox_id: str) -> CheckpointInfo:
        rec = self.node.manager.live_record(sandbox_id)  # Conflict if it is not live
        spec = rec.spec.model_copy(update={"request_id": None})
        view = await self.host.image_view(spec)
        tracked = await self._tracker(sandbox_id, view.lower_dirs)
        tracked.tracker.max_bytes = disk_quota(spec, self.settings)
        async with tracked.lock:
            upper = self.host.upper_dir(sandbox_id)
            await self.host.freeze(sandbox_id)  # no process may change files mid-walk
            try:
                cap, adopt = await asyncio.to_thread(tracked.tracker.capture, upper, self._read_layer)
            except OSError as e:
                self._raise_if_gone(sandbox_id, e)
                raise
            finally:
                await self.host.thaw(sandbox_id)
            checkpoint_id = "ck-" + secrets.token_hex(12)
            meta = UnitMeta(episode_id=_episode_id(tenant, checkpoint_id), seq=0, kind="checkpoint", steps=0,
                            compat=view.compat, compat_hash=view.compat.hash(), spec=spec.model_dump(mode="json"),
                            fs_chain=cap.chain, fs_manifest=cap.manifest_ref, fs_digest=cap.fs_digest,
                            meta={"checkpoint_id": checkpoint_id, "sandbox_id": sandbox_id, "tenant": tenant,
                                  "parent": tracked.parent})

            def write() -> None:
                for part in cap.new_parts:  # parts first ...
                    put_part(self.store, part)
                commit_unit(self.store, meta)  # ... metadata last: the commit point

            await asyncio.to_thread(write)
            adopt()  # the tracker moves on only once the unit is durable
        self._prune()
        return info_of(meta)

    def _raise_if_gone(self, sandbox_id: str, cause: BaseException) -> None:
        """A walk that failed because the sandbox was killed/expired meanwhile is a 409."""
        try:
            self.node.manager.live_record(sandbox_id)
        except errors.DSecError:
            raise errors.Conflict(f"sandbox {sandbox_id} stopped during the checkpoint; nothing was saved",
                                  sandbox_id=sandbox_id) from cause

    def _read_layer(self, ref: LayerRef) -> bytes:
        return read_part(self.store, ref)

    async def _tracker(self, sandbox_id: str, image_dirs: list[Path]) -> _Tracked:
        tracked = self._tracked.get(sandbox_id)
        if tracked is not None:
            return tracked
        in_image = image_lookup(image_dirs)
        full_every, level = self.settings.checkpoint_full_every, self.settings.checkpoint_zstd_level
        base = await asyncio.to_thread(self._base_of, sandbox_id)
        if base is None:
            tracker = FsTracker(in_image=in_image, full_every=full_every, level=level)
            parent = None
        else:  # restored sandbox (possibly before a server restart): stack on its checkpoint
            meta, parent = base
            tracker = await asyncio.to_thread(FsTracker.restored, self.store, meta.fs_chain, meta.fs_manifest,
                                              in_image, full_every, level, meta.inline)
        return self._tracked.setdefault(sandbox_id, _Tracked(tracker, parent))

    def _base_of(self, sandbox_id: str) -> tuple[UnitMeta, str] | None:
        try:
            ref = json.loads(self.store.get(_BASES + sandbox_id))
        except errors.NotFound:
            return None
        metas = complete_units(self.store, _episode_id(ref["tenant"], ref["checkpoint_id"]))
        if not metas:
            raise errors.CheckpointError(
                f"sandbox {sandbox_id} was restored from checkpoint {ref['checkpoint_id']}, which is gone or "
                "incomplete; a new checkpoint would miss its files. Checkpoint a sandbox restored from an "
                "existing checkpoint instead", sandbox_id=sandbox_id)
        return metas[0], ref["checkpoint_id"]

    def _prune(self) -> None:
        """Forget trackers of sandboxes that are gone (their walk state can be large)."""
        live = self.node.manager.live
        for sid in [s for s in self._tracked if s not in live]:
            del self._tracked[sid]

    # --- restore -------------------------------------------------------------------
    async def load(self, tenant: str, checkpoint_id: str) -> UnitMeta:
        """The checkpoint's verified metadata (NotFound naming it if unknown)."""
        if not re.match(CHECKPOINT_ID_PATTERN, checkpoint_id):
            raise _unknown(checkpoint_id)
        ep = _episode_id(tenant, checkpoint_id)
        metas = await asyncio.to_thread(complete_units, self.store, ep)
        if metas:
            return metas[0]
        if await asyncio.to_thread(list_unit_keys, self.store, ep):
            raise errors.CheckpointError(f"checkpoint {checkpoint_id} is damaged (a part is missing or its "
                                         "metadata does not verify); restore another one",
                                         checkpoint_id=checkpoint_id)
        raise _unknown(checkpoint_id)

    async def prepare_restore(self, tenant: str, checkpoint_id: str) -> tuple[SandboxSpec, Create]:
        """Verify the checkpoint and unpack its layers; return its spec and the create to run.

        The returned create records the new sandbox's base before the sandbox exists.
        """
        meta = await self.load(tenant, checkpoint_id)
        spec = SandboxSpec.model_validate(meta.spec)
        view = await self.host.image_view(spec)
        if view.compat.hash() != meta.compat_hash:
            raise errors.Conflict(
                f"checkpoint {checkpoint_id} was taken on image {meta.compat.image_id} ({meta.compat.isolation}) "
                f"but {spec.image!r} now resolves to {view.compat.image_id} ({view.compat.isolation}); re-import "
                "the original image to restore it", checkpoint_id=checkpoint_id)
        tracker = await asyncio.to_thread(FsTracker.restored, self.store, meta.fs_chain, meta.fs_manifest,
                                          image_lookup(view.lower_dirs), self.settings.checkpoint_full_every,
                                          self.settings.checkpoint_zstd_level, meta.inline)
        if tracker.fs_digest != meta.fs_digest:
            raise errors.DigestMismatch(f"checkpoint {checkpoint_id}: manifest does not match its metadata")
        lowers = await asyncio.to_thread(self.layers.materialize, self.store, meta.fs_chain, meta.inline,
                                         disk_quota(spec, self.settings))
        pinned = [lowers]  # unpinned once: after the create (mounted or failed) or by release()

        def release() -> None:
            if pinned:
                self.layers.unpin(pinned.pop())

        async def create(spec: SandboxSpec, sandbox_id: str, owner: str) -> SandboxInfo:
            body = json.dumps({"tenant": tenant, "checkpoint_id": checkpoint_id}).encode()
            self._bases.add(sandbox_id)  # before the write: a kill racing it still deletes it
            try:
                await asyncio.to_thread(self.store.put, _BASES + sandbox_id, body)
                try:
                    info = await self.node.create(spec, sandbox_id=sandbox_id, tenant=owner,
                                                  extra_lower_dirs=lowers)
                except BaseException:
                    await asyncio.to_thread(self.store.delete, _BASES + sandbox_id)
                    raise
            finally:
                release()
            self._tracked[info.id] = _Tracked(tracker, checkpoint_id)
            return info

        create.release = release  # type: ignore[attr-defined]  # a create that never ran (429)
        return spec, create

    # --- list / delete -------------------------------------------------------------
    async def list(self, tenant: str, sandbox_id: str | None = None) -> list[CheckpointInfo]:
        def scan() -> list[CheckpointInfo]:
            out = []
            for key in self.store.list(sandbox_checkpoint_prefix(tenant)):
                if "/units/" not in key:
                    continue
                meta = load_meta(self.store, key)
                if meta is not None and meta.meta.get("tenant") == tenant and \
                        (sandbox_id is None or meta.meta.get("sandbox_id") == sandbox_id):
                    out.append(info_of(meta))
            return sorted(out, key=lambda i: i.created_at)
        return await asyncio.to_thread(scan)

    async def delete(self, tenant: str, checkpoint_id: str) -> None:
        """Delete the metadata (the checkpoint stops existing at once); parts are left to
        ``collect_garbage`` since a later checkpoint of the same sandbox may share them."""
        await self.load(tenant, checkpoint_id)
        ep = _episode_id(tenant, checkpoint_id)
        for _, key in await asyncio.to_thread(list_unit_keys, self.store, ep):
            await asyncio.to_thread(self.store.delete, key)
        await self.layers.gc()

    async def purge(self, tenant: str) -> int:
        """Delete every checkpoint of ``tenant`` (a removed tenant's uid); returns how many."""
        keys = await asyncio.to_thread(self.store.list, sandbox_checkpoint_prefix(tenant))
        for key in keys:
            await asyncio.to_thread(self.store.delete, key)
        await self.layers.gc()
        return sum(1 for k in keys if "/units/" in k)

    async def forget_sandbox(self, sandbox_id: str) -> None:
        """Drop a killed sandbox's base record and tracker (its teardown scheduled the sweep)."""
        self._tracked.pop(sandbox_id, None)
        if not self._bases_listed:
            listed = await asyncio.to_thread(self.store.list, _BASES)
            self._bases.update(k[len(_BASES):] for k in listed)
            self._bases_listed = True
        if sandbox_id not in self._bases:  # not restored: it never had a base record
            return
        try:
            await asyncio.to_thread(self.store.delete, _BASES + sandbox_id)
        except errors.NotFound:
            pass
        self._bases.discard(sandbox_id)
