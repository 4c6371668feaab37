"""Background squash of an episode's checkpoint layer chain into one full layer.

The job reads the layers already stored (or inline in the last unit), squashes them
(overlay semantics, in memory) and stores the result content-addressed, so an identical
squash is not copied twice; the tracker's next capture references it in place of the
layers it replaced (``FsTracker.offer_squash``). Until then units keep the incremental
chain, so a crash at any point loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dsec.blobs import BlobStore
from dsec.checkpoints.fsstate import FsTracker, should_squash, squash_layers
from dsec.checkpoints.unit import put_part, read_part
from dsec.config import Settings
from dsec.testing.faults import fault_point

log = logging.getLogger(__name__)


class BackgroundSquasher:
    def __init__(self, store: BlobStore, settings: Settings, counters: dict[str, float]) -> None:
        self.store, self.settings, self.counters = store, settings, counters
        # One thread: squashes compete with steps for the CPU, never with each other.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-squash")

    def maybe_start(self, episode_id: str, tracker: FsTracker, inline: dict[str, str],
                    finished: Callable[[], None]) -> asyncio.Future | None:
        """Start a squash of ``tracker``'s chain if one is due; None if not.

        ``finished`` runs (on the event loop) when the job ends, success or not.
        """
        if not should_squash(tracker.chain, self.settings.checkpoint_full_every):
            return None
        inputs, inline, level = list(tracker.chain), dict(inline), self.settings.checkpoint_zstd_level

        def job() -> tuple:
            t0 = time.perf_counter()
            blob, full = squash_layers(inputs, lambda r: read_part(self.store, r, inline), tracker.in_image, level)
            put_part(self.store, blob)
            fault_point("ckpt.squash.after_put")
            return full, time.perf_counter() - t0

        fut = asyncio.get_running_loop().run_in_executor(self._pool, job)

        def done(f: asyncio.Future) -> None:
            finished()
            if f.cancelled() or f.exception() is not None:
                self.counters["squash_failures"] += 1
                log.warning("episode %s: background squash failed (retried later): %s", episode_id,
                            None if f.cancelled() else f.exception())
                return
            full, secs = f.result()
            tracker.offer_squash(inputs, full)
            self.counters["squashes"] += 1
            self.counters["squash_seconds_total"] += secs
        fut.add_done_callback(done)
        return fut
