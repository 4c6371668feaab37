"""Build OCI layouts and docker-save archives from raw tar entries.

Used by tests (crafted, even malicious, archives) and benchmarks. Everything written
here is a real archive that other tools (skopeo, umoci) can read.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from dsec.images import media
from dsec.images.fsutil import digest_of


@dataclass
class Entry:
    name: str
    data: bytes = b""
    type: bytes = tarfile.REGTYPE
    mode: int = 0o644
    linkname: str = ""
    devmajor: int = 0
    devminor: int = 0
    uid: int = 0
    gid: int = 0


def layer_tar(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.type, ti.mode, ti.linkname = e.type, e.mode, e.linkname
            ti.devmajor, ti.devminor, ti.uid, ti.gid = e.devmajor, e.devminor, e.uid, e.gid
            ti.size = len(e.data) if e.type == tarfile.REGTYPE else 0
            tf.addfile(ti, io.BytesIO(e.data) if ti.size else None)
    return buf.getvalue()


def compress(raw: bytes, compression: str) -> bytes:
    if compression == "gzip":
        return gzip.compress(raw, mtime=0)
    if compression == "zstd":
        return zstandard.ZstdCompressor().compress(raw)
    return raw


@dataclass
class CraftedImage:
    layers: list[bytes]                      # uncompressed layer tars
    compression: str = "zstd"
    tag: str = "latest"
    media_type: str | None = None            # override the layer media type
    env: list[str] = field(default_factory=lambda: ["PATH=/bin"])


def write_oci_layout(dest: Path, img: CraftedImage) -> dict[str, str]:
    """Write an OCI layout dir; returns {'manifest': digest, 'config': digest, 'layer0': ...}."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    out: dict[str, str] = {}

    def put(data: bytes) -> str:
        d = digest_of(data)
        (blobs / d[7:]).write_bytes(data)
        return d

    descs = []
    for i, raw in enumerate(img.layers):
        blob = compress(raw, img.compression)
        d = put(blob)
        out[f"layer{i}"] = d
        descs.append({"mediaType": img.media_type or media.COMPRESSION_MT[img.compression], "digest": d,
                      "size": len(blob)})
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": img.env},
                      "rootfs": {"type": "layers", "diff_ids": [digest_of(r) for r in img.layers]}}).encode()
    out["config"] = put(cfg)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": media.MT_OCI_MANIFEST,
                           "config": {"mediaType": media.MT_OCI_CONFIG, "digest": out["config"], "size": len(cfg)},
                           "layers": descs}).encode()
    out["manifest"] = put(manifest)
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": media.MT_OCI_MANIFEST, "digest": out["manifest"], "size": len(manifest),
         "annotations": {media.REF_ANNOTATION: img.tag}}]}))
    return out


def tar_dir(src: Path, dest: Path) -> None:
    """Pack a layout directory into a tar archive (OCI layout tar)."""
    with tarfile.open(dest, "w") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(src)), recursive=False)
