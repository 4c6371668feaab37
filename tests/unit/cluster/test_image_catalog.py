"""The cluster's image catalog as the API's pre-queue image check: a known image costs a
dict lookup, an image no node holds is looked up (in a worker thread) and then cached,
and one nobody has is NotFound naming it, before the request reaches the scheduler."""

from __future__ import annotations

import pytest

from dsec.cluster.serve import ImageCatalog
from dsec.config import load_settings
from dsec.errors import NotFound
from dsec.node.api import ImageLayers, LayerIndex


async def test_prefetch_known_cached_and_unknown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cat = ImageCatalog(load_settings(home=tmp_path))
    cat.add(LayerIndex(node_id="n0", images=[ImageLayers(image_id="sha256:i1", names=["busybox:latest"],
                                                         layers=[("sha256:l1", 10)])]))
    await cat.prefetch("busybox")  # known: nothing to look up
    calls: list[str] = []
    real = ImageCatalog.__call__

    def spy(self: ImageCatalog, ref: str):  # type: ignore[no-untyped-def]
        calls.append(ref)
        return real(self, ref)

    ImageCatalog.__call__ = spy  # type: ignore[method-assign]
    try:
        await cat.prefetch("busybox:latest")
        assert calls == []
        with pytest.raises(NotFound, match="nowhere"):
            await cat.prefetch("nowhere:1")
        assert calls == ["nowhere:1"]
    finally:
        ImageCatalog.__call__ = real  # type: ignore[method-assign]
