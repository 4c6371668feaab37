"""Progress reporting for long image operations: a rich bar on a terminal, plain
log lines (at most one per 10 %) otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dsec.images.store import Progress


@contextmanager
def progress_reporter(title: str, tty: bool | None = None) -> Iterator[Progress]:
    tty = sys.stderr.isatty() if tty is None else tty
    if tty:
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        bars: dict[str, int] = {}
        with RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                          transient=False) as rp:
            def advance(label: str, n: int, total: int) -> None:
                if label not in bars:
                    bars[label] = rp.add_task(f"{title}: {label}", total=total or None)
                rp.update(bars[label], advance=n)
            yield advance
        return
    done: dict[str, int] = {}
    shown: dict[str, int] = {}
    t0 = time.monotonic()

    def log(label: str, n: int, total: int) -> None:
        done[label] = done.get(label, 0) + n
        pct = int(100 * done[label] / total) if total else 0
        if pct // 10 > shown.get(label, -1):
            shown[label] = pct // 10
            print(f"{title}: {label} {done[label] >> 20} MiB / {total >> 20} MiB ({pct}%) "
                  f"{time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    yield log
