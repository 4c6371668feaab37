"""End-to-end helpers: a real ``dsec serve`` process (real LocalNodeAgent, runc, overlayfs)
on a free loopback port with its own DSEC_HOME."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.api.launch import reap_home

__all__ = ["DSEC", "Server", "ensure_images", "reap_home", "running_server", "start_server"]

DSEC = str(Path(sys.executable).parent / "dsec")


@dataclass
class Server:
    home: Path
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    log: Path

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
        env["DSEC_HOME"] = str(self.home)
        return env

    def cli(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([DSEC, *args], env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"dsec {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def kill_all(self) -> None:
        """Kill every sandbox of the local tenant (teardown: a failed test must not leak)."""
        import httpx

        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.token}"}, timeout=60) as c:
            for sb in c.get("/v1/sandboxes").json():
                c.delete(f"/v1/sandboxes/{sb['id']}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def ensure_images(home: Path, only: list[str]) -> None:
    from dsec.config import Settings
    from dsec.images import ImageStore
    from dsec.images.stock import ensure_stock

    settings = Settings(home=home)
    ensure_stock(ImageStore(home / "images", settings), only=only, log=lambda _: None)


def start_server(home: Path, extra_env: dict[str, str] | None = None, timeout: float = 120) -> Server:
    from dsec.api.launch import start_serve

    sp = start_serve(home, extra_env, log_name=f"serve-{time.time_ns()}.log", timeout=timeout)
    return Server(home=sp.home, proc=sp.proc, url=sp.url, token=sp.token, log=sp.log)


@contextlib.contextmanager
def running_server(factory: Any, name: str, extra_env: dict[str, str] | None = None,
                   images: list[str] | None = None) -> Iterator[Server]:
    """A module's own server (``images``, default busybox, imported into a fresh home); on the
    way out every sandbox is killed, the server stopped, and what it left behind (pool members) reaped."""
    home = factory.mktemp(name)
    ensure_images(home, images or ["busybox"])
    srv = start_server(home, extra_env)
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
        srv.stop()
        reap_home(home)
