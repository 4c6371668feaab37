"""Reading OCI image layouts / docker-save archives and writing OCI image layouts.

Readers produce a neutral ``ImagePlan`` per image (config bytes, layers with where to
read them and which digests they must have); the store ingests and verifies it. Only
what a plan names is read, so an archive is never extracted to disk wholesale.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from dsec.errors import ImageError, InvalidArgument, NotFound
from dsec.images import media
from dsec.images.fsutil import check_digest, digest_of


@dataclass
class LayerPlan:
    path: str                 # member path inside the archive/layout
    digest: str | None        # expected blob digest (None: docker-save, computed on ingest)
    diff_id: str              # expected uncompressed digest (from the config)
    media_type: str | None    # None: sniff compression from magic bytes (docker-save)
    size: int


@dataclass
class ImagePlan:
    names: list[str]
    config: bytes
    config_digest: str
    manifest: bytes | None    # original manifest bytes (kept so export is byte-identical)
    layers: list[LayerPlan] = field(default_factory=list)


class Source:
    """Random access to files of a layout directory or an (uncompressed) tar."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            return
        if not path.exists():
            raise NotFound(f"image archive {path} does not exist")
        try:
            self._tar = tarfile.open(path, "r:*")  # noqa: SIM115 - kept open for random access, see close()
            for m in self._tar.getmembers():
                self._members[os.path.normpath(m.name).lstrip("/")] = m
        except (tarfile.TarError, EOFError, OSError) as exc:
            if self._tar is not None:
                self._tar.close()
            raise ImageError(f"image archive {path}: not a readable tar or layout directory ({exc})") from exc

    def exists(self, rel: str) -> bool:
        if self._tar is None:
            return (self.path / rel).is_file()
        return os.path.normpath(rel) in self._members

    def size(self, rel: str) -> int:
        if self._tar is None:
            return (self.path / rel).stat().st_size
        return self._members[os.path.normpath(rel)].size

    def open(self, rel: str) -> BinaryIO:
        norm = os.path.normpath(rel)
        if norm.startswith("..") or os.path.isabs(norm):
            raise ImageError(f"image archive {self.path}: reference {rel!r} points outside the archive")
        if self._tar is None:
            p = self.path / norm
            if not p.is_file():
                raise ImageError(f"image archive {self.path}: missing blob {rel}")
            return open(p, "rb")
        m = self._members.get(norm)
        if m is None or not m.isfile():
            raise ImageError(f"image archive {self.path}: missing blob {rel}")
        fh = self._tar.extractfile(m)
        assert fh is not None
        return fh  # type: ignore[return-value]

    def read_json(self, rel: str, limit: int = 64 << 20) -> tuple[bytes, object]:
        if not self.exists(rel):
            raise ImageError(f"image archive {self.path}: missing {rel}")
        if self.size(rel) > limit:
            raise ImageError(f"image archive {self.path}: {rel} is implausibly large")
        with self.open(rel) as fh:
            raw = fh.read()
        try:
            return raw, json.loads(raw)
        except ValueError as exc:
            raise ImageError(f"image archive {self.path}: {rel} is not valid JSON ({exc})") from exc

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


def _blob_path(digest: str, what: str) -> str:
    check_digest(digest, what)
    return "blobs/sha256/" + digest.split(":", 1)[1]


def _diff_ids(config: object, what: str) -> list[str]:
    try:
        ids = config["rootfs"]["diff_ids"]  # type: ignore[index]
        return [check_digest(str(d), what) for d in ids]
    except (KeyError, TypeError) as exc:
        raise ImageError(f"{what}: image config has no rootfs.diff_ids") from exc


def plan_oci(src: Source, default_name: str) -> list[ImagePlan]:
    _, index = src.read_json("index.json")
    plans: list[ImagePlan] = []

    def walk(desc: dict, ref: str | None) -> None:  # type: ignore[type-arg]
        mt = desc.get("mediaType")
        digest = check_digest(str(desc.get("digest", "")), f"{src.path}: descriptor")
        ref = (desc.get("annotations") or {}).get(media.REF_ANNOTATION, ref)
        raw, doc = src.read_json(_blob_path(digest, "manifest"))
        if digest_of(raw) != digest:
            raise ImageError(f"image archive {src.path}: manifest {digest} content does not match its digest")
        mt = mt or doc.get("mediaType")  # type: ignore[union-attr]
        if mt in media.INDEX_TYPES:
            for sub in doc.get("manifests", []):  # type: ignore[union-attr]
                plat = sub.get("platform") or {}
                if plat.get("architecture", "amd64") == "amd64" and plat.get("os", "linux") == "linux":
                    walk(sub, ref)
                    return
            raise ImageError(f"image archive {src.path}: index {digest} has no linux/amd64 manifest")
        if mt not in media.MANIFEST_TYPES:
            raise ImageError(f"image archive {src.path}: unknown manifest media type {mt!r}", media_type=mt)
        plans.append(_plan_from_manifest(src, raw, doc, ref, default_name))  # type: ignore[arg-type]

    for desc in index.get("manifests", []) if isinstance(index, dict) else []:
        walk(desc, None)
    if not plans:
        raise ImageError(f"image archive {src.path}: index.json lists no image manifests")
    return plans


def _plan_from_manifest(src: Source, raw: bytes, doc: dict, ref: str | None, default_name: str) -> ImagePlan:  # type: ignore[type-arg]
    what = f"image archive {src.path}"
    cdesc = doc.get("config") or {}
    if cdesc.get("mediaType") not in media.CONFIG_TYPES:
        raise ImageError(f"{what}: unknown config media type {cdesc.get('mediaType')!r}")
    cdigest = check_digest(str(cdesc.get("digest", "")), f"{what}: config")
    craw, config = src.read_json(_blob_path(cdigest, "config"))
    if digest_of(craw) != cdigest:
        raise ImageError(f"{what}: config blob {cdigest} content does not match its digest")
    diff_ids = _diff_ids(config, what)
    ldescs = doc.get("layers") or []
    if len(ldescs) != len(diff_ids):
        raise ImageError(f"{what}: manifest has {len(ldescs)} layers but config lists {len(diff_ids)} diff_ids")
    layers = []
    for i, (ld, diff_id) in enumerate(zip(ldescs, diff_ids)):
        mt = str(ld.get("mediaType"))
        media.layer_compression(mt, f"{what}: layer {i}")
        dg = check_digest(str(ld.get("digest", "")), f"{what}: layer {i}")
        path = _blob_path(dg, "layer")
        if not src.exists(path):
            raise ImageError(f"{what}: layer {i} blob {dg} is missing from the archive")
        layers.append(LayerPlan(path, dg, diff_id, mt, int(ld.get("size", 0))))
    names = [normalize_name(ref if ref and (":" in ref or "/" in ref) else f"{default_name}:{ref or 'latest'}")]
    return ImagePlan(names, craw, cdigest, raw, layers)


def plan_docker(src: Source) -> list[ImagePlan]:
    what = f"docker archive {src.path}"
    _, entries = src.read_json("manifest.json")
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{what}: manifest.json lists no images")
    plans = []
    for e in entries:
        craw, config = src.read_json(str(e.get("Config")))
        cdigest = digest_of(craw)
        diff_ids = _diff_ids(config, what)
        paths = [str(p) for p in e.get("Layers") or []]
        if len(paths) != len(diff_ids):
            raise ImageError(f"{what}: {len(paths)} layer files but config lists {len(diff_ids)} diff_ids")
        layers = []
        for p, d in zip(paths, diff_ids):
            if not src.exists(p):
                raise ImageError(f"{what}: layer file {p} is missing from the archive")
            layers.append(LayerPlan(p, None, d, None, src.size(p)))
        names = [normalize_name(t) for t in e.get("RepoTags") or []]
        plans.append(ImagePlan(names, craw, cdigest, None, layers))
    return plans


def plan_archive(path: Path) -> tuple[Source, list[ImagePlan]]:
    src = Source(path)
    try:
        default = path.name.split(".")[0] or "image"
        if src.exists(media.OCI_LAYOUT) and src.exists("index.json"):
            return src, plan_oci(src, default)
        if src.exists("manifest.json"):
            return src, plan_docker(src)
        raise ImageError(f"image archive {path}: neither an OCI layout (oci-layout + index.json) nor a "
                         "docker-save archive (manifest.json)")
    except BaseException:
        src.close()
        raise


def normalize_name(ref: str) -> str:
    """'busybox' -> 'busybox:latest'; drop a docker.io/library/ prefix."""
    ref = ref.strip()
    if not ref or any(c.isspace() for c in ref) or ref.startswith("sha256:"):
        raise InvalidArgument(f"invalid image name {ref!r}: expected NAME[:TAG]")
    for pre in ("docker.io/library/", "localhost/"):
        ref = ref.removeprefix(pre)
    last = ref.rsplit("/", 1)[-1]
    return ref if ":" in last else f"{ref}:latest"


# --- export -------------------------------------------------------------------------

def write_layout(dest: Path, blobs: dict[str, Path], manifest_digest: str, manifest_size: int,
                 manifest_type: str, tags: list[str]) -> None:
    """Write an OCI image layout directory holding one image under the given tags."""
    from dsec.images.fsutil import atomic_write

    (dest / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    for digest, src in blobs.items():
        target = dest / "blobs" / "sha256" / digest.split(":", 1)[1]
        if target.exists() and digest_of_file_size(target) == src.stat().st_size:
            continue
        tmp = target.with_name(target.name + ".tmp")
        try:
            os.link(src, tmp)
        except OSError:
            import shutil
            shutil.copyfile(src, tmp)
        os.replace(tmp, target)
    atomic_write(dest / media.OCI_LAYOUT, json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
    descs = [{"mediaType": manifest_type, "digest": manifest_digest, "size": manifest_size,
              "annotations": {media.REF_ANNOTATION: t}} for t in tags]
    index_path = dest / "index.json"
    existing = []
    if index_path.exists():
        existing = [d for d in json.loads(index_path.read_text()).get("manifests", [])
                    if (d.get("annotations") or {}).get(media.REF_ANNOTATION) not in tags]
    index = {"schemaVersion": 2, "mediaType": media.MT_OCI_INDEX, "manifests": existing + descs}
    atomic_write(index_path, json.dumps(index, indent=2).encode())


def digest_of_file_size(p: Path) -> int:
    return p.stat().st_size
