"""OCI/Docker media types and layer (de)compression."""

from __future__ import annotations

import gzip
from typing import BinaryIO

import zstandard

from dsec.errors import ImageError

OCI_LAYOUT = "oci-layout"
MT_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MT_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"

MT_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
MT_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MT_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
MT_DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
MT_DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"

INDEX_TYPES = {MT_OCI_INDEX, MT_DOCKER_LIST}
MANIFEST_TYPES = {MT_OCI_MANIFEST, MT_DOCKER_MANIFEST}
CONFIG_TYPES = {MT_OCI_CONFIG, MT_DOCKER_CONFIG}

# media type -> compression ("tar" | "gzip" | "zstd")
LAYER_TYPES = {
    MT_LAYER_TAR: "tar",
    MT_DOCKER_LAYER_TAR: "tar",
    MT_LAYER_GZIP: "gzip",
    MT_DOCKER_LAYER_GZIP: "gzip",
    MT_LAYER_ZSTD: "zstd",
}
COMPRESSION_MT = {"tar": MT_LAYER_TAR, "gzip": MT_LAYER_GZIP, "zstd": MT_LAYER_ZSTD}

REF_ANNOTATION = "org.opencontainers.image.ref.name"


def layer_compression(media_type: str, what: str) -> str:
    try:
        return LAYER_TYPES[media_type]
    except KeyError:
        raise ImageError(f"{what}: unknown layer media type {media_type!r}; supported: "
                         f"{', '.join(sorted(LAYER_TYPES))}", media_type=media_type) from None


def sniff_compression(head: bytes) -> str:
    """Compression from magic bytes (docker-save archives do not carry media types)."""
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    return "tar"


def decompressing_reader(raw: BinaryIO, compression: str) -> BinaryIO:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[return-value]
    return raw


class _ZstdSink:
    """zstd stream writer that never closes the underlying sink."""

    def __init__(self, raw: BinaryIO, level: int, threads: int = 0) -> None:
        # threads >= 1 compresses in zstd's own worker threads (GIL-free, overlapping our
        # Python work); the output is deterministic for a fixed thread setting.
        self._w = zstandard.ZstdCompressor(level=level, write_checksum=True, threads=threads).stream_writer(
            raw, closefd=False)

    def write(self, data: bytes) -> int:
        return self._w.write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._w.flush(zstandard.FLUSH_FRAME)
        self._w.close()


class _GzipSink:
    def __init__(self, raw: BinaryIO, level: int) -> None:
        # mtime=0 and no filename: no timestamp in the gzip header (deterministic digests).
        self._w = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="", compresslevel=level)

    def write(self, data: bytes) -> int:
        return self._w.write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._w.close()


class _PlainSink:
    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw

    def write(self, data: bytes) -> int:
        return self._raw.write(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def compressing_writer(raw: BinaryIO, compression: str, level: int = 3,
                       threads: int = 0) -> _ZstdSink | _GzipSink | _PlainSink:
    if compression == "zstd":
        return _ZstdSink(raw, level, threads)
    if compression == "gzip":
        return _GzipSink(raw, min(max(level, 1), 9))
    if compression == "tar":
        return _PlainSink(raw)
    raise ImageError(f"unknown layer compression {compression!r}; use zstd, gzip or tar")
