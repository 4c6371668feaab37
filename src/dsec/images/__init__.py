"""Node-local images: content store, OCI import/export, safe layer unpack, snapshotter
(layers -> overlay mounts), builder, stock images, cache policy and GC.

Library use, independent of the server::

    store = ImageStore(settings.home / "images", settings)
    snap = Snapshotter(store)
    m = snap.prepare("sandbox-1", "busybox", scratch)   # lease + verified lower dirs
    snap.mount(m, rootfs); ...; snap.release("sandbox-1")
"""

from dsec.images.policy import coverage, missing_layers, plan_eviction
from dsec.images.snapshot import OverlayMounts, Snapshotter
from dsec.images.store import GcReport, ImageStore

__all__ = [
    "GcReport",
    "ImageStore",
    "OverlayMounts",
    "Snapshotter",
    "coverage",
    "missing_layers",
    "open_store",
    "plan_eviction",
]


def open_store(settings: "object | None" = None) -> ImageStore:
    """The node's image store under ``settings.home / 'images'``."""
    from dsec.config import Settings, get_settings

    s = settings if isinstance(settings, Settings) else get_settings()
    return ImageStore(s.home / "images", s)
