"""A deterministic scripted agent for crash tests; also runnable as a child process.

    python ckpt_agent.py WORKDIR EPISODE N_STEPS   # runs until done or a fault kills it
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from dsec.blobs import LocalBlobStore, ReplicatedBlobStore
from dsec.checkpoints.dirhost import DirHost, make_busybox_rootfs
from dsec.checkpoints.engine import EpisodeEngine
from dsec.config import load_settings
from dsec.models import ExecRequest, SandboxSpec


def command(i: int) -> str:
    if i % 3 == 2:
        return "wc -l < /work/log"                                   # reads only: no fs change
    return f"echo {i} >> /work/log && yes {i}-data | head -c {3000 * (i + 1)} > /work/f{i % 4} " \
           f"&& rm -f /work/f{(i + 2) % 4} && wc -l < /work/log"


def make_engine(work: Path, roots: list[Path] | None = None, **settings) -> EpisodeEngine:
    img = make_busybox_rootfs(work / "img")
    s = load_settings(home=work / "home", checkpoint_keep=settings.pop("keep", 3),
                      checkpoint_full_every=settings.pop("full_every", 4), **settings)
    roots = roots or [work / "r1", work / "r2"]
    store = ReplicatedBlobStore([LocalBlobStore(r) for r in roots])
    return EpisodeEngine(s, store, DirHost(work / "sbx", {"bb": img}))


async def run_agent(engine: EpisodeEngine, ep: str, n: int) -> list:
    """The agent loop: always starts at step 0 (resume fast-forwards the logged prefix)."""
    await engine.open(ep, SandboxSpec(image="bb"))
    out = []
    for i in range(n):
        r = await engine.step(ep, i, ExecRequest(cmd=command(i)))
        out.append(r)
        if i == 3:
            await engine.save_context(ep, {"messages": [f"m{j}" for j in range(i + 1)]})
    return out


if __name__ == "__main__":
    work, ep, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    asyncio.run(run_agent(make_engine(work), ep, n))
