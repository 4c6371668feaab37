"""CPU priority of the API server's event-loop thread.

Why: profiling ``dsec serve`` while 200 sandboxes exec showed ~40% of the loop's
samples inside ``connect()``/``send()`` to sandbox agents. Those calls are cheap; the
time is the loop thread being preempted by the task each call wakes (and then waiting
its turn behind every runnable process) — so /health and every exec waited on CPU
scheduling, not on work. One thread serves every sandbox's control path, so it gets a
higher weight than any one sandbox or batch process.

The loop's worker threads (``asyncio.to_thread``: audit flushes, SQLite, file I/O) get
the same boost: they share the GIL with the loop, and a worker that holds it while
waiting for a CPU would stall the loop just the same (priority inversion).

``SCHED_RESET_ON_FORK`` makes every process and thread created afterwards start at
nice 0 again: sandboxes, runc/runsc and worker threads never inherit the boost (which
matters for gVisor sandboxes, which run outside the sandbox cgroups).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("dsec.api")


def boost_current_thread(nice: int) -> bool:
    """Give the calling thread ``nice`` (Linux: per thread), children reset; True if applied."""
    if nice == 0:
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except (OSError, AttributeError) as e:  # not root (CAP_SYS_NICE) or not Linux: run as is
        log.warning("could not set the API event loop to nice %d (%s); it runs at normal priority", nice, e)
        return False
    return True


def boost_server_threads(loop: asyncio.AbstractEventLoop, nice: int) -> bool:
    """Boost the calling (event-loop) thread and give ``loop`` a default executor whose
    worker threads boost themselves the same way."""
    if not boost_current_thread(nice):
        return False
    workers = min(32, (os.cpu_count() or 1) + 4)  # the stdlib default
    loop.set_default_executor(ThreadPoolExecutor(workers, thread_name_prefix="dsec-api",
                                                 initializer=boost_current_thread, initargs=(nice,)))
    return True


class GcPauses:
    """Records every cyclic-GC pause (generation, seconds) of this process.

    The GC callback only appends to a bounded deque (no locks: a GC can start inside any
    code, including code holding a metrics lock); ``drain()`` hands the pauses over.
    """

    def __init__(self, maxlen: int = 100_000) -> None:
        self.pauses: deque[tuple[int, float]] = deque(maxlen=maxlen)
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def drain(self) -> list[tuple[int, float]]:
        out = []
        while self.pauses:
            out.append(self.pauses.popleft())
        return out

    def close(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)
