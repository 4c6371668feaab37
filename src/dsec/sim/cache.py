"""A simulated node's unpacked-layer cache.

The eviction *decision* is the images component's pure policy
(``dsec.images.policy.plan_eviction``: keep the most recent images' layers, then evict
lowest uses-per-day x size first, never a leased layer). This class only keeps the
statistics it needs and applies the decision; swap ``evict_fn`` to try another policy.
To keep the simulator fast, eviction runs only when the cache holds
``max_images + slack`` images or exceeds its byte budget (hysteresis), not on every pull.
"""

from __future__ import annotations

from collections.abc import Callable

from dsec.images.policy import ImageStat, LayerStat, plan_eviction

EvictFn = Callable[..., list[str]]


class SimLayerCache:
    __slots__ = (
        "bytes",
        "evict_fn",
        "first",
        "floor",
        "image_last",
        "image_layers",
        "last",
        "layer_images",
        "max_bytes",
        "max_images",
        "pins",
        "sizes",
        "slack",
        "uses",
    )

    def __init__(self, max_images: int, max_bytes: int, slack: int = 4, evict_fn: EvictFn = plan_eviction):
        self.max_images, self.max_bytes, self.slack = max_images, max_bytes, slack
        self.sizes: dict[str, int] = {}
        self.uses: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.layer_images: dict[str, set[str]] = {}
        self.image_last: dict[str, float] = {}
        self.image_layers: dict[str, tuple[tuple[str, int], ...]] = {}
        self.pins: dict[str, int] = {}  # layer -> running/pooled sandboxes using it
        self.bytes = 0
        self.evict_fn = evict_fn
        # Image count after the last eviction: pinned layers can keep it above max_images,
        # and re-planning before it grows again would only find the same pins.
        self.floor = max_images

    def use(self, image: str, layers: tuple[tuple[str, int], ...], now: float) -> tuple[int, int, list[str]]:
        """A sandbox of ``image`` starts: returns (layers hit, bytes pulled, layers added)."""
        hits = pulled = 0
        added: list[str] = []
        self.image_last[image] = now
        self.image_layers[image] = layers
        sizes, uses, last, layer_images, pins = self.sizes, self.uses, self.last, self.layer_images, self.pins
        for d, sz in layers:
            if d in sizes:
                hits += 1
                uses[d] += 1
                layer_images[d].add(image)
            else:
                sizes[d] = sz
                self.first[d] = now
                uses[d] = 1
                layer_images[d] = {image}
                self.bytes += sz
                pulled += sz
                added.append(d)
            last[d] = now
            pins[d] = pins.get(d, 0) + 1
        return hits, pulled, added

    def release(self, layers: tuple[tuple[str, int], ...]) -> None:
        pins = self.pins
        for d, _ in layers:
            n = pins.get(d, 0) - 1
            if n > 0:
                pins[d] = n
            else:
                pins.pop(d, None)

    def maybe_evict(self, now: float) -> list[str]:
        if len(self.image_last) <= self.floor + self.slack and self.bytes <= self.max_bytes:
            return []
        stats = [LayerStat(d, sz, self.uses[d], self.last[d], self.first[d], frozenset(self.layer_images[d]))
                 for d, sz in self.sizes.items()]
        images = [ImageStat(i, t) for i, t in self.image_last.items()]
        gone = self.evict_fn(stats, images, set(self.pins), self.max_images, self.max_bytes, now)
        for d in gone:
            self.bytes -= self.sizes.pop(d)
            del self.uses[d], self.first[d], self.last[d]
            for img in self.layer_images.pop(d):
                self.image_last.pop(img, None)
        # An image counts as cached only while all its layers are (dropped above).
        self.floor = max(self.max_images, len(self.image_last))
        return gone

    def clear(self) -> None:
        for m in (self.sizes, self.uses, self.first, self.last, self.layer_images, self.image_last,
                  self.image_layers, self.pins):
            m.clear()
        self.bytes = 0
        self.floor = self.max_images
