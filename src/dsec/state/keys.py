"""Composite keys of tenant-scoped data: one place, unambiguous by construction. Pure.

Every key that combines a tenant with a user-chosen id is built here (issue 18 #1/#7):

* The tenant part is the tenant's immutable internal id (``TenantRecord.uid``), never its
  name: a tenant deleted and re-created under the same name gets a new uid, so nothing
  keyed by the old one (checkpoints, episodes, idempotency keys, audit ownership) is
  reachable by the new one.
* A uid has a fixed shape (``T`` + 24 hex digits: no separator character, and an
  uppercase letter no tenant name may contain, so it can never equal a legacy
  name-keyed owner either). Joining it to a user id is therefore unambiguous: the split
  point is fixed, whatever the user id contains.
* User-chosen parts are validated against a pattern without ``/`` (one blob-store path
  segment) before being joined.
"""

from __future__ import annotations

import re
import secrets

from dsec import errors

TENANT_UID_RE = re.compile(r"^T[0-9a-f]{24}$")
_UID_LEN = 25
_EPISODE_SEP = "--"
# The public episode id (the API's path pattern): one path segment, alphanumeric first.
EPISODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
CHECKPOINT_HEX_RE = re.compile(r"^[0-9a-f]{24}$")


def new_tenant_uid() -> str:
    """A fresh immutable tenant id (96 random bits): assigned once, when the tenant is created."""
    return "T" + secrets.token_hex(12)


def check_tenant_uid(uid: str) -> str:
    if not isinstance(uid, str) or not TENANT_UID_RE.match(uid):
        raise errors.InvalidArgument(f"invalid tenant uid {uid!r}: expected 'T' + 24 hex digits")
    return uid


def episode_key(tenant_uid: str, episode_id: str) -> str:
    """The engine's storage key of a tenant's episode: ``<uid>--<episode id>``.

    The uid has a fixed length and no ``-``, so ``split_episode_key`` recovers both parts
    exactly: no (tenant, id) pair can produce another pair's key (tenant ``epi`` asking
    for ``x--e1`` gets ``<uid of epi>--x--e1``, never tenant ``epi--x``'s ``e1``).
    """
    check_tenant_uid(tenant_uid)
    if not isinstance(episode_id, str) or not EPISODE_ID_RE.match(episode_id):
        raise errors.InvalidArgument(f"invalid episode id {episode_id!r}: use 1-96 chars of [A-Za-z0-9._-], "
                                     "starting alphanumeric", field="episode_id")
    return f"{tenant_uid}{_EPISODE_SEP}{episode_id}"


def split_episode_key(key: str) -> tuple[str, str]:
    """(tenant uid, episode id) of an ``episode_key``; ValueError for anything else."""
    uid, sep, episode_id = key[:_UID_LEN], key[_UID_LEN:_UID_LEN + 2], key[_UID_LEN + 2:]
    if not TENANT_UID_RE.match(uid) or sep != _EPISODE_SEP or not EPISODE_ID_RE.match(episode_id):
        raise ValueError(f"{key!r} is not a tenant episode key")
    return uid, episode_id


def episode_key_prefix(tenant_uid: str) -> str:
    """Every episode key of the tenant starts with this (and no other tenant's does)."""
    return check_tenant_uid(tenant_uid) + _EPISODE_SEP


def sandbox_checkpoint_episode(tenant_key: str, checkpoint_hex: str) -> str:
    """Pseudo-episode holding a plain-sandbox checkpoint: ``sbckpt.<tenant key>.<hex>``.

    ``tenant_key`` is a uid (API) or the scheduler's tenant name (preemption): neither may
    contain a dot, and the hex part is fixed-length, so the key splits one way only.
    """
    if not tenant_key or "." in tenant_key or "/" in tenant_key or not re.match(r"^[A-Za-z0-9_-]+$", tenant_key):
        raise errors.InvalidArgument(f"invalid tenant key {tenant_key!r} for a checkpoint")
    if not CHECKPOINT_HEX_RE.match(checkpoint_hex):
        raise errors.InvalidArgument(f"invalid checkpoint id suffix {checkpoint_hex!r}")
    return f"sbckpt.{tenant_key}.{checkpoint_hex}"


def sandbox_checkpoint_prefix(tenant_key: str) -> str:
    """Store prefix of every checkpoint of ``tenant_key`` (the trailing dot keeps ``a`` from matching ``ab``)."""
    return f"episodes/sbckpt.{tenant_key}."
