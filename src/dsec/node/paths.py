"""Where a sandbox's resources live; every path is derived from the sandbox id alone."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxPaths:
    base: Path       # HOME/sandboxes/<id>: bundle dir (config.json, logs)
    run: Path        # RUN/s: short host-only dir for agent sockets (108-byte sun_path limit)
    sandbox_id: str

    @functools.cached_property
    def bundle(self) -> Path:
        return self.base

    @functools.cached_property
    def scratch(self) -> Path:
        """tmpfs sized to the disk quota; holds the overlay upper and work dirs."""
        return self.base / "scratch"

    @functools.cached_property
    def rootfs(self) -> Path:
        return self.base / "rootfs"

    @functools.cached_property
    def upper(self) -> Path:
        return self.scratch / "upper"

    @functools.cached_property
    def config(self) -> Path:
        return self.base / "config.json"

    @functools.cached_property
    def log(self) -> Path:
        return self.base / "runtime.log"

    @functools.cached_property
    def socket(self) -> Path:
        return self.run / f"{self.sandbox_id}.sock"


# Cached (ids are unique and paths derive from them alone): the hot paths (exec, claim,
# recycle) ask for a sandbox's paths several times per call, and each join costs a few us.
@functools.lru_cache(maxsize=4096)
def sandbox_paths(home: Path, run_dir: Path, sandbox_id: str) -> SandboxPaths:
    return SandboxPaths(home / "sandboxes" / sandbox_id, run_dir / "s", sandbox_id)
