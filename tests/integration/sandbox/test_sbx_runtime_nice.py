"""A cold create runs ``runc run`` at ``DSEC_RUNTIME_NICE`` (its work outranks sandbox
load on the node), and no sandbox process inherits that priority: dsec-init puts PID 1
back at nice 0 before it serves anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from sbx_helpers import make, sh, start_node, stop_node

pytestmark = pytest.mark.integration


async def test_runtime_boosted_sandbox_at_nice_zero(sbx_env, tmp_path: Path) -> None:
    """runc (seen through a recording wrapper) runs at nice -7; PID 1, an exec and a
    background job in the sandbox all run at 0."""
    seen = tmp_path / "runc-nice"
    wrapper = tmp_path / "runc-wrapper"
    # field 19 of /proc/self/stat is the nice value (the comm field has no spaces here)
    wrapper.write_text(f"#!/bin/sh\ncut -d' ' -f19 /proc/$$/stat >> {seen}\nexec runc \"$@\"\n")
    wrapper.chmod(0o755)
    node = await start_node(sbx_env, tmp_path / "home", runtime_nice=-7, runc_path=str(wrapper))
    try:
        info = await make(node, "container")
        assert seen.read_text().split() == ["-7"]  # the run; destroy starts no runc
        r = await sh(node, info.id, "cut -d' ' -f19 /proc/1/stat /proc/self/stat")
        assert r.exit_code == 0 and r.stdout.split() == ["0", "0"], r
        await sh(node, info.id, "sleep 30 &")
        r = await sh(node, info.id, "for p in /proc/[0-9]*/stat; do cut -d' ' -f19 $p; done | sort -u")
        assert r.stdout.split() == ["0"], r
    finally:
        await stop_node(node)
