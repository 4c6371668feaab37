"""Child process for the crash/reconcile test: a node manager that creates and destroys
sandboxes forever, printing what it is about to do, until the test SIGKILLs it.

usage: python sbx_crashy.py HOME RUN_DIR IMAGES_HOME SEED [ISOLATION]
(ISOLATION given: only create sandboxes of that tier, never destroy)
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

from sbx_helpers import GVISOR_PIDS, SMALL, TIERS, SharedEnv, node_settings, start_node

from dsec.images import ImageStore
from dsec.models import SandboxSpec
from dsec.ids import new_sandbox_id


def say(*words: object) -> None:
    # One write per line: a SIGKILL lands between lines, never inside one.
    os.write(1, (" ".join(map(str, words)) + "\n").encode())


async def main() -> None:
    home, run_dir, images_home, seed = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    only = sys.argv[5] if len(sys.argv) > 5 else None
    store = ImageStore(images_home / "images", node_settings(images_home, images_home / "run"))
    node = await start_node(SharedEnv(images_home, store, images_home / "bin"), home, run_dir)
    say("started", *sorted(node.manager.live))
    while True:
        live = sorted(node.manager.live)
        if live and not only and (len(live) >= 4 or rng.random() < 0.35):
            sid = rng.choice(live)
            say("destroying", sid)
            await node.destroy(sid)
            say("destroyed", sid)
        else:
            sid = new_sandbox_id()
            tier = only or ("gvisor" if rng.random() < 0.25 and "gvisor" in node.manager.isolations else TIERS[0])
            say("creating", sid, tier)
            info = await node.manager.create(make_spec(tier), sandbox_id=sid)
            say("created", sid, info.pid)


def make_spec(tier: str) -> SandboxSpec:
    """The same shape as sbx_helpers.make()."""
    shape = {**SMALL, **({"pids": GVISOR_PIDS} if tier == "gvisor" else {})}
    return SandboxSpec(image="busybox", isolation=tier, **shape)  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main())
