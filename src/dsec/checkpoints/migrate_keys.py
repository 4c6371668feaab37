"""Move blob-store data written under tenant NAMES to tenant UIDs (issue 18 #7 upgrade).

Before uids, episodes were stored as ``episodes/<name>--<id>/...`` and sandbox
checkpoints as ``episodes/sbckpt.<name>.<hex>/...``. When ``SqliteStateStore`` gives a
pre-uid tenant its uid it sets ``legacy_keys``; at the next server start this module
rewrites that tenant's units under the uid keys (``dsec.state.keys``) and clears the flag.

Only keys that can be attributed to exactly one name move:

* ``sbckpt.<name>.<hex>``: names have no dot, so the name is exact.
* ``<name>--<id>`` only when neither the name nor the id contains ``--``. Then the split
  is unique among all possible names, and no other tenant could have written the key.
  Anything else (``epi--x--e1`` could be tenant ``epi``'s ``x--e1`` or tenant ``epi--x``'s
  ``e1``: the collision of issue 18 #1) stays where it is. No tenant can reach it, and an
  operator can read it with ``dsec episode show``.

Unit metadata is re-committed under the new episode key (its key embeds its own digest);
parts are content-addressed and shared, so they are not copied. The new unit is written
before the old one is deleted: a crash mid-way leaves both, and the next start finishes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dsec import errors
from dsec.blobs import BlobStore
from dsec.checkpoints.unit import commit_unit, load_meta
from dsec.state.keys import CHECKPOINT_HEX_RE, EPISODE_ID_RE, episode_key, sandbox_checkpoint_episode
from dsec.state.sqlite import SqliteDB

log = logging.getLogger(__name__)
_BASES = "sandbox-checkpoints/bases/"


def legacy_target(episode: str, name: str, uid: str) -> str | None:
    """Pure: the uid key a legacy ``episode`` of tenant ``name`` moves to, or None (not
    this tenant's, or not attributable to one name)."""
    ck_prefix = f"sbckpt.{name}."
    if episode.startswith(ck_prefix):
        hexid = episode[len(ck_prefix):]
        return sandbox_checkpoint_episode(uid, hexid) if CHECKPOINT_HEX_RE.match(hexid) else None
    if "--" in name or not episode.startswith(name + "--"):
        return None
    episode_id = episode[len(name) + 2:]
    if "--" in episode_id or not EPISODE_ID_RE.match(episode_id):
        return None
    return episode_key(uid, episode_id)


def _move(store: BlobStore, old: str, new: str, keys: list[str], tenant_meta: str | None) -> None:
    base = f"episodes/{old}/"
    for key in keys:
        rest = key[len(base):]
        if rest.startswith("units/"):
            meta = load_meta(store, key)
            if meta is None:
                continue  # corrupt: readers skip it anyway; it is deleted with the rest
            meta.episode_id = new
            if tenant_meta is not None:
                meta.meta["tenant"] = tenant_meta
            commit_unit(store, meta)
        else:  # owner record, sandbox markers
            store.put(f"episodes/{new}/{rest}", store.get(key))
    for key in keys:
        store.delete(key)


def migrate_legacy_keys(state: SqliteDB, store: BlobStore, journal_dir: Path | None = None) -> int:
    """Move every flagged tenant's episodes and checkpoints to its uid keys; returns how
    many episodes/checkpoints moved. Idempotent; a no-op once no tenant is flagged.

    Only an SQLite store can hold pre-uid tenants (a Redis store is new with schema 2),
    and this runs once at start before serving: the synchronous core is used."""
    legacy = [t for t in state.list_tenants() if t.legacy_keys and t.uid]
    if not legacy:
        return 0
    grouped: dict[str, list[str]] = {}
    for key in store.list("episodes/"):
        parts = key.split("/")
        if len(parts) >= 3:
            grouped.setdefault(parts[1], []).append(key)
    moved = 0
    for t in legacy:
        for episode, keys in sorted(grouped.items()):
            new = legacy_target(episode, t.name, t.uid)
            if new is None:
                if episode.startswith((t.name + "--", f"sbckpt.{t.name}.")):
                    log.warning("episode %s of tenant %s is not attributable to one tenant (issue 18 #1); "
                                "left under its old key", episode, t.name)
                continue
            is_ckpt = episode.startswith("sbckpt.")
            _move(store, episode, new, keys, t.uid if is_ckpt else None)
            if journal_dir is not None and not is_ckpt:
                old_j, new_j = journal_dir / f"{episode}.jsonl.zst", journal_dir / f"{new}.jsonl.zst"
                if old_j.exists():
                    old_j.rename(new_j)
            moved += 1
        for key in store.list(_BASES):  # restored sandboxes' base records name the tenant
            try:
                ref = json.loads(store.get(key))
            except (errors.DSecError, ValueError):
                continue
            if ref.get("tenant") == t.name:
                store.put(key, json.dumps({**ref, "tenant": t.uid}).encode())
        t.legacy_keys = False
        state.put_tenant(t)
        log.info("tenant %s: moved its episodes and checkpoints to uid keys", t.name)
    return moved
