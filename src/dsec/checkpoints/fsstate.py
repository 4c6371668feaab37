"""Per-episode filesystem checkpoint state: what changed since the last unit, and restore.

``FsTracker`` is owned by one live sandbox: it remembers the upper dir's last stat
walk, the checkpoint layer chain and the canonical manifest. ``capture`` turns the
changes since the previous capture into a new layer (or nothing), squashing the chain
into one full layer every ``full_every`` incremental ones so restore never stacks more
than that many layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from dsec import errors
from dsec.blobs import BlobStore
from dsec.checkpoints import fsdiff, layers
from dsec.checkpoints.unit import LayerRef, PartRef, read_part


@dataclass
class Capture:
    changed: bool
    new_parts: list[bytes]          # blobs to store before the metadata (layer, manifest)
    chain: list[LayerRef]
    manifest_ref: PartRef | None
    fs_digest: str
    layer_bytes: int


@dataclass
class FsTracker:
    in_image: Callable[[str], bool]
    full_every: int
    level: int = 3
    sigs: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    chain: list[LayerRef] = field(default_factory=list)
    manifest_ref: PartRef | None = None

    @property
    def fs_digest(self) -> str:
        return fsdiff.manifest_digest(self.manifest)

    def capture(self, upper: Path, load_layer: Callable[[LayerRef], bytes]) -> tuple[Capture, Callable[[], None]]:
        """Compute the capture; the returned ``commit`` callable adopts it once durable."""
        sigs = fsdiff.walk_signature(upper)
        changes = fsdiff.diff_signatures(self.sigs, sigs)
        if changes.empty:
            cap = Capture(False, [], list(self.chain), self.manifest_ref, self.fs_digest, 0)
            return cap, lambda: setattr(self, "sigs", sigs)
        nodes = fsdiff.build_nodes(upper, sigs, changes)
        manifest = dict(self.manifest)
        fsdiff.apply_to_manifest(manifest, nodes, self.in_image)
        layer = layers.write_layer(nodes, self.level)
        incremental = sum(1 for ref in self.chain if not ref.full) if self.chain else 0
        if self.chain and incremental + 1 >= self.full_every:
            layer = layers.squash([load_layer(r) for r in self.chain] + [layer], self.in_image, self.level)
            chain = [LayerRef(digest=_digest(layer), size=len(layer), full=True)]
        else:
            chain = [*self.chain, LayerRef(digest=_digest(layer), size=len(layer), full=not self.chain)]
        mbytes = zstandard.ZstdCompressor(level=self.level).compress(
            json.dumps(sorted(manifest.items()), separators=(",", ":")).encode())
        mref = PartRef(digest=_digest(mbytes), size=len(mbytes))
        cap = Capture(True, [layer, mbytes], chain, mref, fsdiff.manifest_digest(manifest), len(layer))

        def commit() -> None:
            self.sigs, self.manifest, self.chain, self.manifest_ref = sigs, manifest, chain, mref
        return cap, commit

    @classmethod
    def restored(cls, store: BlobStore, chain: list[LayerRef], manifest_ref: PartRef | None,
                 in_image: Callable[[str], bool], full_every: int, level: int,
                 inline: dict[str, str] | None = None) -> FsTracker:
        manifest: dict = {}
        if manifest_ref is not None:
            raw = zstandard.ZstdDecompressor().decompress(read_part(store, manifest_ref, inline))
            manifest = {k: v for k, v in json.loads(raw)}
        return cls(in_image=in_image, full_every=full_every, level=level, manifest=manifest,
                   chain=list(chain), manifest_ref=manifest_ref)


def _digest(data: bytes) -> str:
    from dsec.blobs import sha256_hex
    return "sha256:" + sha256_hex(data)


def materialize(store: BlobStore, chain: list[LayerRef], cache_dir: Path,
                inline: dict[str, str] | None = None) -> list[Path]:
    """Unpack (or reuse) every layer of ``chain``; return lower dirs top-most first.

    Each layer is read through the store (digest-verified, replica fail-over) and
    unpacked into ``cache_dir/<hex>`` via a temp dir + rename, so a cached dir is always
    complete. Any unreadable/corrupt part raises, and the caller falls back to an older
    unit: a partial chain is never mounted.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    dirs = []
    for ref in chain:
        dest = cache_dir / ref.digest.removeprefix("sha256:")
        if not dest.is_dir():
            blob = read_part(store, ref, inline)
            try:
                layers.unpack_overlay(blob, dest)
            except OSError as exc:
                if dest.is_dir():  # a concurrent restore unpacked the same layer first
                    continue
                raise errors.CheckpointError(f"unpacking checkpoint layer {ref.digest} failed: {exc}") from exc
        dirs.append(dest)
    return list(reversed(dirs))
