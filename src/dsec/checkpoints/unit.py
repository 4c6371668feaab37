"""Checkpoint units: parts first, metadata last; readers trust only complete units.

Protocol (each arrow is a durable, atomic BlobStore put; every replica for a
replicated store):

    parts (fs layer, manifest, context, trajectory segment) -> metadata

Parts are content-addressed blobs. The metadata object names every part with its
digest and size, the schema version and a compatibility hash (image digest, image
layer digests, isolation tier), and its key embeds its own sha256:
``episodes/<id>/units/<seq:010d>-<sha256>.json``. A unit without metadata does not
exist for readers; a unit whose metadata or any part fails its digest is skipped and
the previous complete unit is used. Named fault points sit between every write.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field, PrivateAttr

from dsec import errors
from dsec.blobs import BlobStore, cas_key, get_blob, put_blob, sha256_hex
from dsec.testing.faults import fault_point

log = logging.getLogger(__name__)

UNIT_SCHEMA_VERSION = 1
_UNIT_RE = re.compile(r"/units/(\d{10})-([0-9a-f]{64})\.json$")
_EP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_episode_id(episode_id: str) -> str:
    if not isinstance(episode_id, str) or not _EP_RE.match(episode_id):
        raise errors.InvalidArgument(
            f"invalid episode id {episode_id!r}: use 1-128 chars of [A-Za-z0-9._-], starting alphanumeric")
    return episode_id


class PartRef(BaseModel):
    digest: str
    size: int


class LayerRef(PartRef):
    full: bool = Field(False, description="A squash of everything before it (chain restarts here)")
    squash_of: list[str] = Field(default_factory=list, description="Digests of the layers this full layer "
                                 "replaced (background squash), for audit and re-verification")


class Compat(BaseModel):
    """What a unit's filesystem layers were taken on top of; restore must match it."""

    image: str
    image_id: str | None = None
    image_layers: list[str] = Field(default_factory=list)
    isolation: str = "container"

    def hash(self) -> str:
        return "sha256:" + sha256_hex(self.model_dump_json().encode())


class UnitMeta(BaseModel):
    schema_version: int = UNIT_SCHEMA_VERSION
    episode_id: str
    seq: int = Field(..., ge=0)
    kind: Literal["step", "context", "checkpoint", "preempt", "open"] = "step"
    steps: int = Field(..., ge=0, description="Trajectory length covered by this unit")
    created_at: float = Field(default_factory=time.time)
    compat: Compat
    compat_hash: str
    spec: dict = Field(default_factory=dict, description="SandboxSpec to recreate the sandbox")
    fs_chain: list[LayerRef] = Field(default_factory=list, description="Diff layers, base first")
    fs_manifest: PartRef | None = None
    fs_digest: str = ""
    trajectory: list[PartRef] = Field(default_factory=list, description="Segments in order")
    context: PartRef | None = None
    weights_ref: str | None = None
    meta: dict = Field(default_factory=dict)
    epoch: int = Field(0, ge=0, description="Owner epoch of the writer (fencing: see checkpoints.fencing)")
    inline: dict[str, str] = Field(
        default_factory=dict, description="Small parts embedded here (digest -> base64): one write "
        "instead of two. A unit carries every inline part it references, so retention never loses one")
    _key: str = PrivateAttr("")  # the store key it was read from / written to

    @property
    def key(self) -> str:
        return self._key

    def parts(self) -> list[PartRef]:
        out: list[PartRef] = [*self.fs_chain, *self.trajectory]
        out += [p for p in (self.fs_manifest, self.context) if p is not None]
        return out


def units_prefix(episode_id: str) -> str:
    return f"episodes/{check_episode_id(episode_id)}/units/"


def put_part(store: BlobStore, data: bytes) -> PartRef:
    return PartRef(digest=put_blob(store, data), size=len(data))


def commit_unit(store: BlobStore, meta: UnitMeta) -> str:
    """Write the metadata object (the commit point). Parts must already be stored."""
    if meta.compat_hash != meta.compat.hash():
        raise errors.CheckpointError(f"unit {meta.seq} of {meta.episode_id}: compat hash mismatch")
    fault_point("ckpt.after_parts")
    body = meta.model_dump_json().encode()
    key = f"{units_prefix(meta.episode_id)}{meta.seq:010d}-{sha256_hex(body)}.json"
    store.put(key, body)
    meta._key = key
    fault_point("ckpt.after_meta")
    return key


def list_unit_keys(store: BlobStore, episode_id: str) -> list[tuple[int, str]]:
    """(seq, key) of every metadata object of the episode, newest first."""
    out = []
    for key in store.list(units_prefix(episode_id)):
        m = _UNIT_RE.search(key)
        if m:
            out.append((int(m.group(1)), key))
    return sorted(out, reverse=True)


def load_meta(store: BlobStore, key: str) -> UnitMeta | None:
    """Parse a metadata object; None (logged) if it is corrupt, foreign or unreadable."""
    m = _UNIT_RE.search(key)
    try:
        body = store.get(key)
    except errors.DSecError as exc:
        log.warning("checkpoint metadata %s unreadable: %s", key, exc)
        return None
    if not m or sha256_hex(body) != m.group(2):
        log.warning("checkpoint metadata %s is corrupt (digest mismatch)", key)
        return None
    try:
        meta = UnitMeta.model_validate_json(body)
    except ValueError as exc:
        log.warning("checkpoint metadata %s does not parse: %s", key, exc)
        return None
    if meta.schema_version > UNIT_SCHEMA_VERSION or meta.compat_hash != meta.compat.hash() \
            or meta.seq != int(m.group(1)):
        log.warning("checkpoint metadata %s is inconsistent or from a newer schema", key)
        return None
    meta._key = key
    return meta


def parts_present(store: BlobStore, meta: UnitMeta) -> bool:
    """Cheap check: every part exists on some replica (no content read).

    Sizes and digests are verified when the parts are read for a restore (which fails
    over between replicas and falls back to an older unit if no good copy exists).
    """
    for p in meta.parts():
        if p.digest in meta.inline:
            continue
        try:
            store.stat(cas_key(p.digest))
        except errors.DSecError:
            return False
    return True


def read_part(store: BlobStore, ref: PartRef, inline: dict[str, str] | None = None) -> bytes:
    if inline and ref.digest in inline:
        data = base64.b64decode(inline[ref.digest])
        if "sha256:" + sha256_hex(data) != ref.digest:
            raise errors.DigestMismatch(f"inline part {ref.digest} is corrupt")
    else:
        data = get_blob(store, ref.digest)  # verifies the digest (and fails over replicas)
    if len(data) != ref.size:
        raise errors.DigestMismatch(f"part {ref.digest} has {len(data)} bytes, expected {ref.size}")
    return data


def complete_units(store: BlobStore, episode_id: str) -> list[UnitMeta]:
    """Units whose metadata is valid and whose parts all exist, newest first."""
    out = []
    for _, key in list_unit_keys(store, episode_id):
        meta = load_meta(store, key)
        if meta is not None and parts_present(store, meta):
            out.append(meta)
    return out


def episode_ids(store: BlobStore) -> list[str]:
    return sorted({k.split("/")[1] for k in store.list("episodes/") if k.count("/") >= 3})


# --- retention and GC ---------------------------------------------------------------------

def units_to_drop(seqs_newest_first: list[int], keep: int) -> list[int]:
    """Pure retention policy: keep the ``keep`` newest units, drop the rest."""
    return seqs_newest_first[max(keep, 1):]


def apply_retention(store: BlobStore, episode_id: str, keep: int,
                    keys: list[tuple[int, str]] | None = None,
                    delete: Callable[[str], None] | None = None) -> list[tuple[int, str]]:
    """Delete all but the ``keep`` newest units; return the survivors (newest first).

    ``keys`` (the caller's own list of the episode's units) saves listing the store;
    ``delete`` lets the caller defer the deletions off its hot path.
    """
    keys = sorted(keys, reverse=True) if keys is not None else list_unit_keys(store, episode_id)
    drop = set(units_to_drop([s for s, _ in keys], keep))
    for seq, key in keys:
        if seq in drop:
            fault_point("ckpt.mid_retention")
            (delete or store.delete)(key)
    return [(seq, key) for seq, key in keys if seq not in drop]


def collect_garbage(store: BlobStore, grace_s: float, now: float | None = None) -> int:
    """Delete CAS blobs no unit of any episode references and older than ``grace_s``.

    The grace period protects the parts of a unit that is being written right now (its
    metadata, which would reference them, does not exist yet).
    """
    now = time.time() if now is None else now
    referenced: set[str] = set()
    for ep in episode_ids(store):
        for _, key in list_unit_keys(store, ep):
            meta = load_meta(store, key)
            if meta is not None:
                referenced.update(cas_key(p.digest) for p in meta.parts() if p.digest not in meta.inline)
    n = 0
    for key in store.list("cas/"):
        if key in referenced:
            continue
        try:
            if now - store.stat(key).mtime < grace_s:
                continue
        except errors.NotFound:
            continue
        store.delete(key)
        n += 1
    return n


def canonical_json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
