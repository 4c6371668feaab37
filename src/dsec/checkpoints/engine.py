"""Episodes: logged steps, per-step checkpoint units, resume with fast-forward.

The server owns an episode's trajectory and checkpoints, so a crash of the client, the
sandbox, the node agent or the server loses nothing acknowledged:

* ``step(n, cmd)`` with ``n`` below the log length returns the logged result without
  running anything (after checking the command matches, else ReplayDiverged);
* the first new step runs live, then its unit (fs diff if the upper changed, manifest,
  trajectory segment, metadata last) is written before the result is returned, so an
  acknowledged step is always durable and a logged command never runs twice;
* if a unit cannot be written (disk full, crash), the step is not logged and the
  sandbox, now ahead of the log, is replaced from the last unit before the next step.

Restore walks units newest first and takes the first whose every part verifies.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from dsec import errors
from dsec.blobs import BlobStore, sha256_hex
from dsec.checkpoints import owners
from dsec.checkpoints import trajectory as traj
from dsec.checkpoints.episode_sandboxes import SandboxBook
from dsec.checkpoints.fsdiff import image_lookup
from dsec.checkpoints.fsstate import FsTracker
from dsec.checkpoints.host import EpisodeHost, ImageView
from dsec.checkpoints.layer_cache import LayerCache, disk_quota
from dsec.checkpoints.squasher import BackgroundSquasher
from dsec.checkpoints.unit import (
    PartRef,
    UnitMeta,
    apply_retention,
    check_episode_id,
    commit_unit,
    complete_units,
    list_unit_keys,
    put_part,
    read_part,
)
from dsec.config import Settings
from dsec.models import ExecRequest, SandboxSpec
from dsec.models.episode import CheckpointRef, EpisodeInfo, StepResult
from dsec.state.store import StateStore
from dsec.testing.faults import FaultInjected, fault_point

log = logging.getLogger(__name__)


@dataclass
class _Live:
    id: str
    spec: SandboxSpec
    view: ImageView
    tracker: FsTracker
    sandbox_id: str | None = None
    records: list[traj.StepRecord] = field(default_factory=list)
    segments: list[PartRef] = field(default_factory=list)
    context: PartRef | None = None
    weights_ref: str | None = None
    user_meta: dict = field(default_factory=dict)
    seq: int = -1  # seq of the last committed (or restored) unit
    next_seq: int = 0  # above every seq in the store, even of units we fell back from
    last_key: str = ""
    inline: dict[str, str] = field(default_factory=dict)  # inline parts of the last unit
    unit_keys: list[tuple[int, str]] | None = None  # (seq, key) of stored units; None = list the store
    epoch: int = 0  # owner epoch: writes from an older epoch are fenced
    dirty: bool = False  # sandbox fs is ahead of the last unit: replace before the next step
    squashing: asyncio.Future | None = None  # background squash of the layer chain, if running
    journal: traj.JournalWriter | None = None  # local trajectory journal (appended off the exec path)
    traj_bytes: bytes = b""  # every committed record's zstd frame, in order (= the whole trajectory)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _stdin_digest(stdin: str | None) -> str | None:
    return None if stdin is None else hashlib.sha256(stdin.encode()).hexdigest()


class EpisodeEngine:
    def __init__(self, settings: Settings, store: BlobStore, host: EpisodeHost,
                 cache_dir: Path | None = None, state: StateStore | None = None) -> None:
        self.settings, self.store, self.host = settings, store, host
        # Owner epochs by compare-and-set in the state store (shared by every API server);
        # without one, the blob store's owner record (one server only: see owners.py).
        self.owners = owners.EpisodeOwners(store, state)
        self.cache_dir = cache_dir or settings.checkpoint_cache_dir or settings.home / "ckpt-layers"
        self.layers = LayerCache.at(self.cache_dir, settings.checkpoint_layer_gc_grace_s)
        self._live: dict[str, _Live] = {}
        self.counters: dict[str, float] = {"units_written": 0, "unit_failures": 0, "unit_seconds_total": 0.0,
                                           "restores": 0, "restore_fallbacks": 0, "restore_seconds_total": 0.0,
                                           "steps_replayed": 0, "steps_live": 0, "bytes_checkpointed": 0,
                                           "squashes": 0, "squash_failures": 0, "squash_seconds_total": 0.0}
        # Old units are deleted off the step's critical path; a crash before the delete
        # only leaves an extra old (complete) unit for the next retention pass.
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-retention")
        # Full checkpoints are squashed off the step path, from already-stored parts.
        self._squasher = BackgroundSquasher(store, settings, self.counters)
        self._open_locks: dict[str, asyncio.Lock] = {}
        self.sandboxes = SandboxBook(store, host)

    # --- open / restore ---------------------------------------------------------------
    async def open(self, episode_id: str, spec: SandboxSpec | None = None,
                   sandbox_id: str | None = None) -> EpisodeInfo:
        """Create the episode, or resume it from its newest complete checkpoint unit.

        Every open makes the caller the episode's owner with a new epoch (``info.epoch``);
        writes carrying an older epoch are refused with ``EpisodeFenced``. ``sandbox_id``:
        the id of the sandbox a create/restore makes (a control plane that placed and
        accounted it under that id); by default the engine picks one.
        """
        check_episode_id(episode_id)
        async with self._open_locks.setdefault(episode_id, asyncio.Lock()):
            live = self._live.get(episode_id)
            if live is not None:
                async with live.lock:  # no write of the previous owner is half-way through
                    live.epoch = await self.owners.claim(episode_id, [live.epoch])
                return self._info(live)
            units = await asyncio.to_thread(owners.restorable, self.store, episode_id)
            if not units:
                if await asyncio.to_thread(list_unit_keys, self.store, episode_id):
                    raise errors.CheckpointError(
                        f"episode {episode_id!r} has checkpoint units but none is complete; "
                        "inspect it with `dsec episode show` or delete it to start over")
                epoch = await self.owners.claim(episode_id, [])
                return await self._create(episode_id, spec or SandboxSpec(), epoch, sandbox_id)
            epoch = await self.owners.claim(episode_id, [m.epoch for m in units])
            t0 = time.perf_counter()
            failures = []
            next_seq = 1 + max(seq for seq, _ in await asyncio.to_thread(list_unit_keys, self.store, episode_id))
            for meta in units:
                try:
                    live = await self._restore(meta, sandbox_id)
                    live.next_seq, live.epoch = next_seq, epoch
                except (errors.DigestMismatch, errors.NotFound, errors.CheckpointError) as exc:
                    log.warning("episode %s: unit %d unusable (%s); falling back", episode_id, meta.seq, exc)
                    self.counters["restore_fallbacks"] += 1
                    failures.append(f"unit {meta.seq}: {exc}")
                    continue
                self._live[episode_id] = live
                self.counters["restores"] += 1
                self.counters["restore_seconds_total"] += time.perf_counter() - t0
                return self._info(live, resumed=True, restore_s=time.perf_counter() - t0)
            raise errors.CheckpointError(
                f"no checkpoint unit of episode {episode_id!r} could be restored ({'; '.join(failures)}); "
                "nothing partial was restored", episode_id=episode_id)

    def _fence(self, live: _Live, epoch: int | None, stored: int | None = None) -> None:
        owners.check_fence(live.id, epoch, live.epoch, stored)

    async def _evict_stale(self, live: _Live) -> None:
        """This server's copy was superseded: forget it and destroy its sandbox."""
        if self._live.get(live.id) is live:
            self._live.pop(live.id, None)
        if live.sandbox_id:
            sid, live.sandbox_id = live.sandbox_id, None
            try:
                await self.sandboxes.drop(live.id, sid)
            except errors.DSecError as exc:
                log.warning("episode %s: destroying superseded sandbox %s failed: %s", live.id, sid, exc)
        await self._close_journal(live)

    async def _create(self, episode_id: str, spec: SandboxSpec, epoch: int,
                      sandbox_id: str | None = None) -> EpisodeInfo:
        view = await self.host.image_view(spec)
        tracker = self._tune(FsTracker(in_image=image_lookup(view.lower_dirs),
                                       full_every=self.settings.checkpoint_full_every,
                                       level=self.settings.checkpoint_zstd_level), spec)
        live = _Live(id=episode_id, spec=spec, view=view, tracker=tracker, epoch=epoch)
        orphans = await self.sandboxes.orphans(episode_id)  # of a create that crashed before its first unit
        live.sandbox_id = await self.sandboxes.new(episode_id, spec, [], sandbox_id)
        self.sandboxes.reap_later(episode_id, orphans)
        try:
            live.journal = await self._open_journal(episode_id, b"")
            async with live.lock:
                await self._write_unit(live, "open")
        except BaseException:
            if live.sandbox_id:  # a fenced open unit already dropped it (_evict_stale)
                await self.sandboxes.drop(episode_id, live.sandbox_id)
            await self._close_journal(live)
            raise
        self._live[episode_id] = live
        return self._info(live)

    def _load_parts(self, meta: UnitMeta) -> tuple[list[traj.StepRecord], bytes]:
        records: list[traj.StepRecord] = []
        raw = []
        for seg in meta.trajectory:
            raw.append(read_part(self.store, seg, meta.inline))
            records.extend(traj.decode_segment(raw[-1]))
        if len(records) != meta.steps or [r.step for r in records] != list(range(meta.steps)):
            raise errors.CheckpointError(f"unit {meta.seq}: trajectory has {len(records)} steps, expected {meta.steps}")
        if meta.context is not None:
            read_part(self.store, meta.context, meta.inline)
        return records, b"".join(raw)

    def _tune(self, tracker: FsTracker, spec: SandboxSpec) -> FsTracker:
        tracker.max_bytes = disk_quota(spec, self.settings)  # a unit never holds more than the sandbox may
        tracker.background = self.settings.checkpoint_squash_background
        tracker.max_chain = max(self.settings.checkpoint_max_chain, self.settings.checkpoint_full_every + 1)
        return tracker

    def _maybe_squash(self, live: _Live) -> None:
        if live.tracker.background and live.squashing is None:
            live.squashing = self._squasher.maybe_start(live.id, live.tracker, live.inline,
                                                        lambda: setattr(live, "squashing", None))

    # --- local journal --------------------------------------------------------------------
    def _journal_path(self, episode_id: str) -> Path:
        root = self.settings.checkpoint_journal_dir or self.settings.home / "journals"
        return root / f"{episode_id}.jsonl.zst"

    async def _open_journal(self, episode_id: str, initial: bytes) -> traj.JournalWriter | None:
        """The episode's journal, restarted from ``initial`` (the trajectory of its unit)."""
        if not self.settings.checkpoint_journal:
            return None
        return await asyncio.to_thread(traj.JournalWriter, self._journal_path(episode_id), initial)

    async def _close_journal(self, live: _Live, remove: bool = False) -> None:
        """Stop the journal; ``remove`` (episode closed) deletes it: the units hold the trajectory."""
        j, live.journal = live.journal, None
        if j is not None:
            try:
                await asyncio.to_thread(j.close)
            except OSError as exc:  # the units hold the trajectory; the journal is a local copy
                log.warning("episode %s: closing its journal failed: %s", live.id, exc)
        if remove:
            self._journal_path(live.id).unlink(missing_ok=True)

    async def _restore(self, meta: UnitMeta, sandbox_id: str | None = None) -> _Live:
        spec = SandboxSpec.model_validate(meta.spec)
        view = await self.host.image_view(spec)
        if view.compat.hash() != meta.compat_hash:
            raise errors.CheckpointError(
                f"episode {meta.episode_id!r} was checkpointed on image {meta.compat.image_id} "
                f"({meta.compat.isolation}) but {spec.image!r} now resolves to {view.compat.image_id} "
                f"({view.compat.isolation}); re-import the original image to resume")
        records, traj_bytes = await asyncio.to_thread(self._load_parts, meta)
        in_image = image_lookup(view.lower_dirs)
        tracker = await asyncio.to_thread(FsTracker.restored, self.store, meta.fs_chain, meta.fs_manifest,
                                          in_image, self.settings.checkpoint_full_every,
                                          self.settings.checkpoint_zstd_level, meta.inline)
        if tracker.fs_digest != meta.fs_digest:
            raise errors.DigestMismatch(f"unit {meta.seq}: manifest digest does not match the metadata")
        self._tune(tracker, spec)
        lowers = await asyncio.to_thread(self.layers.materialize, self.store, meta.fs_chain, meta.inline,
                                         disk_quota(spec, self.settings))
        try:
            # Survivors of a crash may be ahead of the log: never reused, destroyed once the new
            # sandbox exists (off the restore path; their store markers make it crash-proof).
            orphans = await self.sandboxes.orphans(meta.episode_id)
            live = _Live(id=meta.episode_id, spec=spec, view=view, tracker=tracker, records=records,
                         segments=list(meta.trajectory), context=meta.context, weights_ref=meta.weights_ref,
                         user_meta={k: v for k, v in meta.meta.items() if not k.startswith("_")}, seq=meta.seq,
                         next_seq=meta.seq + 1, last_key=meta.key, inline=dict(meta.inline),
                         traj_bytes=traj_bytes)
            live.sandbox_id = await self.sandboxes.new(meta.episode_id, spec, lowers, sandbox_id)
        finally:
            self.layers.unpin(lowers)  # mounted now (or failed): the mount keeps them from the sweep
        self.sandboxes.reap_later(meta.episode_id, orphans)
        live.journal = await self._open_journal(meta.episode_id, traj_bytes)
        return live

    async def _last_unit(self, live: _Live) -> UnitMeta:
        units = await asyncio.to_thread(complete_units, self.store, live.id)
        for meta in units:
            if meta.key == live.last_key:
                return meta
        raise errors.CheckpointError(f"episode {live.id!r}: its last unit {live.last_key!r} is gone from the "
                                     "store; close and reopen the episode to fall back to an older unit")

    async def _replace_sandbox(self, live: _Live) -> None:
        """Give ``live`` a fresh sandbox equal to its last unit (after a failed unit or a stop)."""
        meta = await self._last_unit(live)
        if live.sandbox_id:
            await self.sandboxes.drop(live.id, live.sandbox_id)
            live.sandbox_id = None
        await self._close_journal(live)
        fresh = await self._restore(meta)
        live.sandbox_id, live.tracker, live.dirty = fresh.sandbox_id, fresh.tracker, False
        live.inline, live.journal, live.traj_bytes = fresh.inline, fresh.journal, fresh.traj_bytes

    # --- steps ------------------------------------------------------------------------
    def _get(self, episode_id: str) -> _Live:
        live = self._live.get(episode_id)
        if live is None:
            raise errors.NotFound(f"episode {episode_id!r} is not open on this server; open it first "
                                  "(Episode.open resumes it from its checkpoints)", episode_id=episode_id)
        return live

    async def step(self, episode_id: str, step: int, req: ExecRequest, epoch: int | None = None) -> StepResult:
        live = self._get(episode_id)
        async with live.lock:
            self._fence(live, epoch)
            n = len(live.records)
            if step < n:
                rec = live.records[step]
                if not rec.same_command(req.cmd, req.cwd, req.env, _stdin_digest(req.stdin)):
                    # Never echo the logged command: the error must not be a way to read the
                    # log (issue 18 #1); its digest tells the owner which step differs, the
                    # trajectory export shows the command itself.
                    logged = hashlib.sha256(repr((rec.command, rec.cwd)).encode()).hexdigest()[:16]
                    raise errors.ReplayDiverged(
                        f"episode step {step}: the agent now runs {req.cmd!r} (cwd={req.cwd!r}) but the log "
                        f"has a different command at this step (logged command+cwd sha256 {logged}...; see "
                        "the trajectory export); a resumed agent must replay the same commands in the same "
                        "order", step=step, logged_sha256=logged)
                self.counters["steps_replayed"] += 1
                return StepResult(step=step, replayed=True, exit_code=rec.exit_code, stdout=rec.stdout,
                                  stderr=rec.stderr, duration=rec.duration, timed_out=rec.timed_out,
                                  truncated=rec.truncated, fs_digest=rec.fs_digest, checkpoint_s=rec.checkpoint_s)
            if step > n:
                raise errors.Conflict(f"episode {episode_id!r}: step {step} requested but only {n} steps are "
                                      f"logged; the next step is {n}", logged=n)
            if live.dirty or live.sandbox_id is None:
                await self._replace_sandbox(live)
            started = time.time()
            try:
                res = await self.host.exec(live.sandbox_id, req)
            except BaseException:
                # The sandbox may have died mid-command with partial effects: never reuse it.
                live.dirty = True
                raise
            rec = traj.StepRecord(step=n, command=req.cmd, cwd=req.cwd, env=req.env or None,
                                  stdin_sha256=_stdin_digest(req.stdin), timeout=req.timeout,
                                  exit_code=res.exit_code, stdout=res.stdout, stderr=res.stderr,
                                  timed_out=res.timed_out, truncated=res.truncated, started_at=started,
                                  duration=res.duration)
            t0 = time.perf_counter()
            await self._write_unit(live, "step", record=rec)
            rec.checkpoint_s = time.perf_counter() - t0
            return StepResult(step=n, exit_code=res.exit_code, stdout=res.stdout, stderr=res.stderr,
                              duration=res.duration, timed_out=res.timed_out, truncated=res.truncated,
                              fs_digest=rec.fs_digest, checkpoint_s=rec.checkpoint_s)

    async def _write_unit(self, live: _Live, kind: str, record: traj.StepRecord | None = None,
                          context: bytes | None = None) -> UnitMeta:
        """Capture the fs, write parts then metadata; adopt the new state only on success."""
        assert live.sandbox_id is not None
        upper = self.host.upper_dir(live.sandbox_id)
        await self.host.freeze(live.sandbox_id)
        try:
            cap, adopt = await asyncio.to_thread(
                live.tracker.capture, upper, lambda ref: read_part(self.store, ref, live.inline))
        except BaseException:
            # Nothing was logged (e.g. the files exceed the disk quota, 413): the sandbox may
            # be ahead of the log, so the next step starts from the last unit again.
            live.dirty = True
            raise
        finally:
            await self.host.thaw(live.sandbox_id)
        parts: list[tuple[str, bytes]] = [("fs", b) for b in cap.new_parts]
        segments = list(live.segments)
        frame_fut = None
        if record is not None:
            record.fs_changed, record.fs_bytes, record.fs_digest = cap.changed, cap.layer_bytes, cap.fs_digest
            # Encoded, written and fsynced by the journal thread while the fs parts are stored.
            frame_fut = live.journal.append(record) if live.journal is not None else None
        if context is not None:
            parts.append(("context", context))
        compact = record is not None and len(segments) + 1 >= self.settings.checkpoint_full_every
        frame = b""  # this record's zstd frame, set by write()
        loop = asyncio.get_running_loop()

        def write() -> UnitMeta:
            nonlocal frame
            refs: dict[str, list[PartRef]] = {"fs": [], "trajectory": [], "context": []}
            inline: dict[str, str] = {}

            def store(name: str, data: bytes) -> None:
                if len(data) <= self.settings.checkpoint_inline_max_bytes:
                    ref = PartRef(digest="sha256:" + sha256_hex(data), size=len(data))
                    inline[ref.digest] = base64.b64encode(data).decode()
                else:
                    ref = put_part(self.store, data)
                refs[name].append(ref)
                fault_point(f"ckpt.after_part.{name}")
            for name, data in parts:
                store(name, data)
            if record is not None:
                # The journal thread encoded, wrote and fsynced the record while the fs
                # parts were stored; waiting here makes the journal cover every unit.
                frame = frame_fut.result() if frame_fut is not None else traj.encode_record(record)
                # Compaction: the whole trajectory as one segment again (frames concatenate).
                seg = live.traj_bytes + frame if compact else frame
                parts.append(("trajectory", seg))
                store("trajectory", seg)
            meta = UnitMeta(
                episode_id=live.id, seq=live.next_seq, kind=kind,  # type: ignore[arg-type]
                steps=len(live.records) + (record is not None), compat=live.view.compat,
                compat_hash=live.view.compat.hash(), spec=live.spec.model_dump(mode="json"),
                fs_chain=cap.chain, fs_manifest=cap.manifest_ref, fs_digest=cap.fs_digest,
                trajectory=([] if compact else segments) + refs["trajectory"],
                context=refs["context"][0] if refs["context"] else live.context,
                weights_ref=live.weights_ref, meta=dict(live.user_meta), epoch=live.epoch)
            meta.inline = self._carry_inline(meta, inline, live.inline)
            # Another server may have resumed the episode meanwhile: its owner record wins.
            self._fence(live, None, self.owners.current_blocking(live.id, loop))
            key = commit_unit(self.store, meta)
            keys = [*(live.unit_keys or []), (meta.seq, key)] if live.unit_keys is not None else None
            try:
                live.unit_keys = apply_retention(self.store, live.id, self.settings.checkpoint_keep, keys,
                                                 delete=self._delete_later)
            except (errors.DSecError, FaultInjected) as exc:  # retention retries at the next unit
                log.warning("episode %s: retention failed: %s", live.id, exc)
                live.unit_keys = None
            return meta

        t0 = time.perf_counter()
        try:
            meta = await asyncio.to_thread(write)
        except BaseException as exc:
            live.dirty = True
            self.counters["unit_failures"] += 1
            if isinstance(exc, errors.EpisodeFenced):
                await self._evict_stale(live)
            raise
        self.counters["units_written"] += 1
        self.counters["unit_seconds_total"] += time.perf_counter() - t0
        self.counters["bytes_checkpointed"] += sum(len(d) for _, d in parts)
        if record is not None:
            self.counters["steps_live"] += 1
        adopt()
        live.seq, live.segments, live.context, live.inline = meta.seq, meta.trajectory, meta.context, meta.inline
        live.next_seq, live.last_key = meta.seq + 1, meta.key
        if record is not None:
            live.records.append(record)
            live.traj_bytes += frame
        self._maybe_squash(live)
        return meta

    def _carry_inline(self, meta: UnitMeta, new: dict[str, str], prev: dict[str, str]) -> dict[str, str]:
        """Inline parts of the new unit: its own plus every still-referenced one of the last unit.

        Past the per-unit budget, the largest carried parts are spilled to the blob store
        (before the metadata is written, so the unit is still complete when it appears).
        """
        referenced = {p.digest for p in meta.parts()}
        out = {d: b for d, b in {**prev, **new}.items() if d in referenced}
        budget = self.settings.checkpoint_inline_budget_bytes
        for digest in sorted(out, key=lambda d: len(out[d]), reverse=True):
            if sum(len(b) for b in out.values()) <= budget:
                break
            put_part(self.store, base64.b64decode(out.pop(digest)))
        return out

    def _delete_later(self, key: str) -> None:
        def run() -> None:
            try:
                self.store.delete(key)
            except Exception as exc:  # noqa: BLE001 - retried by a later retention pass
                log.warning("deleting old checkpoint unit %s failed: %s", key, exc)
        self._deleter.submit(run)

    # --- context, explicit checkpoints, preemption -------------------------------------
    async def save_context(self, episode_id: str, context: object, epoch: int | None = None) -> CheckpointRef:
        live = self._get(episode_id)
        raw = json.dumps(context, sort_keys=True).encode()
        if len(raw) > self.settings.checkpoint_max_context_bytes:
            raise errors.PayloadTooLarge(f"context of episode {episode_id!r} is {len(raw)} bytes; the limit is "
                                         f"{self.settings.checkpoint_max_context_bytes} (checkpoint_max_context_bytes)")
        blob = zstandard.ZstdCompressor(level=self.settings.checkpoint_zstd_level).compress(raw)
        async with live.lock:
            self._fence(live, epoch)
            await self._ensure_sandbox(live)
            meta = await self._write_unit(live, "context", context=blob)
        return self._ref(meta)

    async def context(self, episode_id: str) -> object | None:
        live = self._get(episode_id)
        if live.context is None:
            return None
        raw = await asyncio.to_thread(read_part, self.store, live.context, live.inline)
        return json.loads(zstandard.ZstdDecompressor().decompress(raw))

    async def checkpoint(self, episode_id: str, weights_ref: str | None = None,
                         meta: dict | None = None, epoch: int | None = None) -> CheckpointRef:
        live = self._get(episode_id)
        async with live.lock:
            self._fence(live, epoch)
            await self._ensure_sandbox(live)
            if weights_ref is not None:
                live.weights_ref = weights_ref
            live.user_meta.update({k: v for k, v in (meta or {}).items() if not str(k).startswith("_")})
            m = await self._write_unit(live, "checkpoint")
        return self._ref(m)

    async def fork(self, episode_id: str, new_id: str, epoch: int | None = None) -> EpisodeInfo:
        """Branch an open episode: ``new_id`` starts where this one is now. A checkpoint unit
        of it is written (an owner's write: fenced by ``epoch``), committed again as unit 0
        of ``new_id`` (its parts are content-addressed: shared, not copied; garbage
        collection sees them referenced by both), and ``new_id`` is opened from it like a
        resume: its log is this episode's history, its sandbox holds these files. The two
        diverge from here."""
        check_episode_id(new_id)
        if new_id == episode_id or new_id in self._live or \
                await asyncio.to_thread(list_unit_keys, self.store, new_id):
            raise errors.Conflict("the fork's episode id exists already: fork into a new id")
        live = self._get(episode_id)
        async with live.lock:
            self._fence(live, epoch)
            await self._ensure_sandbox(live)
            meta = await self._write_unit(live, "checkpoint")
        child = meta.model_copy(update={"episode_id": new_id, "seq": 0, "epoch": 0, "created_at": time.time(),
                                        "meta": {**meta.meta, "_forked_from": episode_id}})
        await asyncio.to_thread(commit_unit, self.store, child)
        return await self.open(new_id)

    async def _ensure_sandbox(self, live: _Live) -> None:
        if live.dirty or live.sandbox_id is None:
            await self._replace_sandbox(live)

    async def checkpoint_and_stop(self, sandbox_id: str) -> CheckpointRef:
        """Preemption hook: checkpoint the episode running in ``sandbox_id`` and stop it.

        The episode stays open; its next step (or ``resume``) restores a sandbox.
        """
        live = next((lv for lv in self._live.values() if lv.sandbox_id == sandbox_id), None)
        if live is None:
            raise errors.NotFound(f"sandbox {sandbox_id!r} runs no open episode on this server")
        async with live.lock:
            if live.dirty:  # already ahead of the log: the last unit is the checkpoint
                meta = await self._last_unit(live)
            else:
                meta = await self._write_unit(live, "preempt")
            await self.sandboxes.drop(live.id, sandbox_id)
            live.sandbox_id, live.dirty = None, False
        return self._ref(meta)

    async def resume(self, episode_id: str) -> EpisodeInfo:
        """Bring a stopped (preempted) episode back into a sandbox, or open it if not open."""
        live = self._live.get(episode_id)
        if live is None:
            return await self.open(episode_id)
        async with live.lock:
            t0 = time.perf_counter()
            await self._ensure_sandbox(live)
        return self._info(live, resumed=True, restore_s=time.perf_counter() - t0)

    async def close(self, episode_id: str, epoch: int | None = None) -> None:
        """Destroy the episode's sandbox; its checkpoints stay (open resumes it).

        A stale owner's close is fenced: it must not take the new owner's sandbox away.
        """
        live = self._live.get(episode_id)
        if live is not None:
            self._fence(live, epoch)
        live = self._live.pop(episode_id, None)
        if live is not None:
            async with live.lock:
                if live.sandbox_id:
                    await self.sandboxes.drop(live.id, live.sandbox_id)
                await self._close_journal(live, remove=True)
        await self.sandboxes.reaped(episode_id)
        self.layers.sweep_soon()  # debounced: episodes close at RL rates

    async def purge(self, key_prefix: str) -> int:
        """Delete every episode whose key starts with ``key_prefix`` (a removed tenant's,
        ``dsec.state.keys.episode_key_prefix``): close the open ones, destroy sandboxes
        their markers name, delete their units, owner records and journals. Parts are
        left to ``collect_garbage`` (content-addressed; another episode may share them).
        Returns the number of episodes deleted."""
        if not key_prefix or "/" in key_prefix:
            raise errors.InvalidArgument(f"refusing to purge episodes with prefix {key_prefix!r}")
        for ep in [k for k in self._live if k.startswith(key_prefix)]:
            await self.close(ep)
        keys = await asyncio.to_thread(self.store.list, f"episodes/{key_prefix}")
        episodes = {k.split("/")[1] for k in keys}
        for key in keys:
            parts = key.split("/")
            if len(parts) == 4 and parts[2] == "sandboxes":  # a crashed server's leftover
                await self.host.destroy(parts[3])
        for key in keys:
            await asyncio.to_thread(self.store.delete, key)
        for ep in episodes:
            self._journal_path(ep).unlink(missing_ok=True)
        await self.layers.gc()
        return len(episodes)

    async def forget(self, episode_id: str) -> None:
        """Drop in-memory state only (what a server crash does); for drills and tests."""
        live = self._live.pop(episode_id, None)
        if live is not None:
            await self._close_journal(live)

    async def info(self, episode_id: str) -> EpisodeInfo:
        return self._info(self._get(episode_id))

    def export(self, episode_id: str) -> bytes:
        return self.export_from(self.store, episode_id)

    @staticmethod
    def export_from(store: BlobStore, episode_id: str) -> bytes:
        """The logged trajectory of the newest complete unit as one zstd JSONL stream."""
        for meta in complete_units(store, check_episode_id(episode_id)):
            try:
                return b"".join(read_part(store, s, meta.inline) for s in meta.trajectory)
            except errors.DSecError:
                continue
        raise errors.NotFound(f"episode {episode_id!r} has no complete checkpoint unit")

    def stats(self) -> dict[str, float]:
        """Counters for the metrics endpoint (checkpoint writes/latency, restores, replays)."""
        return {f"checkpoint_{k}": v for k, v in self.counters.items()} | {"episodes_open": len(self._live)}

    def _ref(self, meta: UnitMeta) -> CheckpointRef:
        return CheckpointRef(episode_id=meta.episode_id, seq=meta.seq, steps=meta.steps, fs_digest=meta.fs_digest)

    def _info(self, live: _Live, resumed: bool = False, restore_s: float = 0.0) -> EpisodeInfo:
        return EpisodeInfo(id=live.id, epoch=live.epoch, steps=len(live.records), seq=live.seq,
                           sandbox_id=live.sandbox_id,
                           fs_digest=live.tracker.fs_digest, has_context=live.context is not None,
                           weights_ref=live.weights_ref, resumed=resumed, restore_s=restore_s)
