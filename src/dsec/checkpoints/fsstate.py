"""Per-episode filesystem checkpoint state: what changed since the last unit, and restore.

``FsTracker`` is owned by one live sandbox: it remembers the upper dir's last stat
walk, the checkpoint layer chain and the canonical manifest. ``capture`` turns the
changes since the previous capture into a new layer (or nothing), squashing the chain
into one full layer every ``full_every`` incremental ones so restore never stacks more
than that many layers.
"""

from __future__ import annotations

import json
import stat
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


def should_squash(chain: list[LayerRef], full_every: int) -> bool:
    """Pure policy: squash once the chain holds ``full_every`` layers (restore stacks them all)."""
    return len(chain) >= max(full_every, 2)


def adopt_squash(chain: list[LayerRef], inputs: list[LayerRef], full: LayerRef) -> list[LayerRef] | None:
    """Pure: ``chain`` with its prefix ``inputs`` replaced by their squash ``full``.

    None if the chain no longer starts with ``inputs`` (the episode was restored from
    another unit meanwhile): a squash of other layers must never be spliced in.
    """
    k = len(inputs)
    if k == 0 or [r.digest for r in chain[:k]] != [r.digest for r in inputs]:
        return None
    return [full, *chain[k:]]


def squash_layers(inputs: list[LayerRef], load_layer: Callable[[LayerRef], bytes],
                  in_image: Callable[[str], bool], level: int) -> tuple[bytes, LayerRef]:
    """One full layer equal to ``inputs`` stacked on the image, and its reference."""
    blob = layers.squash([load_layer(r) for r in inputs], in_image, level)
    return blob, LayerRef(digest=_digest(blob), size=len(blob), full=True, squash_of=[r.digest for r in inputs])


@dataclass
class FsTracker:
    in_image: Callable[[str], bool]
    full_every: int
    level: int = 3
    sigs: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    chain: list[LayerRef] = field(default_factory=list)
    manifest_ref: PartRef | None = None
    # Background squash (the episode engine): capture only appends layers; the owner squashes
    # a prefix of the chain off the step path and hands the result to ``offer_squash``.
    # Past ``max_chain`` layers (the background squash is lagging) capture squashes inline.
    background: bool = False
    max_chain: int = 60
    squashed: tuple[list[LayerRef], LayerRef] | None = None  # (inputs, full layer), stored, not yet adopted
    # The sandbox's disk quota: a capture whose files' apparent size exceeds it is refused
    # before any file is read (a sparse 1 GiB file in a 64 MiB sandbox must not cost 1 GiB
    # of server memory). None = unbounded (tests, tools).
    max_bytes: int | None = None

    @property
    def fs_digest(self) -> str:
        return fsdiff.manifest_digest(self.manifest)

    def offer_squash(self, inputs: list[LayerRef], full: LayerRef) -> None:
        """A durable full layer equal to ``inputs``; the next capture adopts it if it still fits."""
        self.squashed = (inputs, full)

    def _base_chain(self) -> list[LayerRef]:
        if self.squashed is not None:
            adopted = adopt_squash(self.chain, *self.squashed)
            if adopted is not None:
                return adopted
        return list(self.chain)

    def capture(self, upper: Path, load_layer: Callable[[LayerRef], bytes]) -> tuple[Capture, Callable[[], None]]:
        """Compute the capture; the returned ``commit`` callable adopts it once durable."""
        sigs = fsdiff.walk_signature(upper)
        if self.max_bytes is not None:
            size = apparent_bytes(sigs)
            if size > self.max_bytes:
                raise layers.too_large("the sandbox's filesystem", size, self.max_bytes)
        changes = fsdiff.diff_signatures(self.sigs, sigs)
        offered, base = self.squashed, self._base_chain()

        def adopt_base() -> None:
            if self.squashed is offered:  # an offer that arrived meanwhile waits for the next capture
                self.squashed = None
        if changes.empty:
            cap = Capture(False, [], base, self.manifest_ref, self.fs_digest, 0)

            def commit_empty() -> None:
                self.sigs, self.chain = sigs, base
                adopt_base()
            return cap, commit_empty
        nodes = fsdiff.build_nodes(upper, sigs, changes)
        manifest = dict(self.manifest)
        fsdiff.apply_to_manifest(manifest, nodes, self.in_image)
        layer = layers.write_layer(nodes, self.level)
        incremental = sum(1 for ref in base if not ref.full) if base else 0
        inline_squash = len(base) + 1 >= self.max_chain if self.background else incremental + 1 >= self.full_every
        if base and inline_squash:
            layer = layers.squash([load_layer(r) for r in base] + [layer], self.in_image, self.level)
            chain = [LayerRef(digest=_digest(layer), size=len(layer), full=True)]
        else:
            chain = [*base, LayerRef(digest=_digest(layer), size=len(layer), full=not base)]
        mbytes = zstandard.ZstdCompressor(level=self.level).compress(
            json.dumps(sorted(manifest.items()), separators=(",", ":")).encode())
        mref = PartRef(digest=_digest(mbytes), size=len(mbytes))
        cap = Capture(True, [layer, mbytes], chain, mref, fsdiff.manifest_digest(manifest), len(layer))

        def commit() -> None:
            self.sigs, self.manifest, self.chain, self.manifest_ref = sigs, manifest, chain, mref
            adopt_base()
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


def apparent_bytes(sigs: dict[str, tuple]) -> int:
    """Pure: the bytes a capture would read: every regular file at its full length (holes
    and hard links included: each path is read and stored on its own)."""
    return sum(sig[3] for sig in sigs.values() if stat.S_ISREG(sig[0]))


def _digest(data: bytes) -> str:
    from dsec.blobs import sha256_hex
    return "sha256:" + sha256_hex(data)


def materialize(store: BlobStore, chain: list[LayerRef], cache_dir: Path,
                inline: dict[str, str] | None = None, max_bytes: int | None = None) -> list[Path]:
    """Unpack (or reuse) every layer of ``chain``; return lower dirs top-most first.

    Each layer is read through the store (digest-verified, replica fail-over) and
    unpacked into ``cache_dir/<hex>`` via a temp dir + rename, so a cached dir is always
    complete. Any unreadable/corrupt part raises, and the caller falls back to an older
    unit: a partial chain is never mounted. ``max_bytes`` (the sandbox's disk quota)
    bounds each layer's file bytes; holes stay holes on disk.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    dirs = []
    for ref in chain:
        dest = cache_dir / ref.digest.removeprefix("sha256:")
        if not dest.is_dir():
            blob = read_part(store, ref, inline)
            try:
                layers.unpack_overlay(blob, dest, max_bytes)
            except OSError as exc:
                if dest.is_dir():  # a concurrent restore unpacked the same layer first
                    continue
                raise errors.CheckpointError(f"unpacking checkpoint layer {ref.digest} failed: {exc}") from exc
        dirs.append(dest)
    return list(reversed(dirs))
