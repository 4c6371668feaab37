"""Pure cache decisions: which unpacked layers to evict, which objects GC may delete,
and which of an image's layers a node misses. No I/O here (the simulator reuses these).

Eviction rule (SPEC §2): keep every layer of the ``max_images`` most recently used
images; layers only used by older images are candidates, and so is anything once the
unpacked bytes exceed ``max_bytes``. Candidates go lowest keep-score first, where
``score = uses_per_day x size``: a layer that is rarely used AND cheap to re-fetch goes
first; big, popular base layers stay. A leased layer (running or pooled sandbox, build,
checkpoint being written) is never a candidate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DAY_S = 86400.0


@dataclass(frozen=True)
class LayerStat:
    diff_id: str
    size: int                 # unpacked bytes on disk
    uses: int                 # prepares that used it
    last_used: float
    first_seen: float
    images: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ImageStat:
    id: str
    last_used: float


def keep_score(layer: LayerStat, now: float) -> float:
    age_days = max((now - layer.first_seen) / DAY_S, 1.0 / 24)
    return (layer.uses + 1) / age_days * max(layer.size, 1)


def plan_eviction(layers: Iterable[LayerStat], images: Iterable[ImageStat], leased: set[str],
                  max_images: int, max_bytes: int, now: float) -> list[str]:
    """Return diff_ids to evict, in eviction order."""
    layers = list(layers)
    recent = {i.id for i in sorted(images, key=lambda i: i.last_used, reverse=True)[:max_images]}
    total = sum(layer.size for layer in layers)
    evictable = [layer for layer in layers if layer.diff_id not in leased]
    evictable.sort(key=lambda layer: (keep_score(layer, now), layer.diff_id))
    out: list[str] = []
    for layer in evictable:
        outside_recent = not (layer.images & recent)
        if outside_recent or total > max_bytes:
            out.append(layer.diff_id)
            total -= layer.size
    return out


def gc_candidates(present: Mapping[str, float], referenced: set[str], leased: set[str],
                  unused_s: float, now: float) -> list[str]:
    """Objects (blob digests or layer diff_ids) that are unreferenced, unleased, and
    unused for ``unused_s``. ``present`` maps object -> last time it was used."""
    return sorted(o for o, last in present.items()
                  if o not in referenced and o not in leased and now - last >= unused_s)


def missing_layers(wanted: Mapping[str, int], have: set[str]) -> tuple[set[str], int]:
    """Which of an image's layers (digest -> size) a node lacks, and how many bytes."""
    miss = set(wanted) - have
    return miss, sum(wanted[d] for d in miss)


def coverage(wanted: Mapping[str, int], have: set[str]) -> float:
    """Fraction of an image's bytes already on a node (1.0 = fully cached)."""
    total = sum(wanted.values())
    if total == 0:
        return 1.0
    return 1.0 - missing_layers(wanted, have)[1] / total
