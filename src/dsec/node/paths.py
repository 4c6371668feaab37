"""Where a sandbox's resources live; every path is derived from the sandbox id alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxPaths:
    base: Path       # HOME/sandboxes/<id>: bundle dir (config.json, logs)
    run: Path        # RUN/s: short host-only dir for agent sockets (108-byte sun_path limit)
    sandbox_id: str

    @property
    def bundle(self) -> Path:
        return self.base

    @property
    def scratch(self) -> Path:
        """tmpfs sized to the disk quota; holds the overlay upper and work dirs."""
        return self.base / "scratch"

    @property
    def rootfs(self) -> Path:
        return self.base / "rootfs"

    @property
    def upper(self) -> Path:
        return self.scratch / "upper"

    @property
    def config(self) -> Path:
        return self.base / "config.json"

    @property
    def log(self) -> Path:
        return self.base / "runtime.log"

    @property
    def socket(self) -> Path:
        return self.run / f"{self.sandbox_id}.sock"


def sandbox_paths(home: Path, run_dir: Path, sandbox_id: str) -> SandboxPaths:
    return SandboxPaths(home / "sandboxes" / sandbox_id, run_dir / "s", sandbox_id)
