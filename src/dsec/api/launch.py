"""Start a ``dsec serve`` child process on a free loopback port and wait until it is up
(demo, benchmarks and end-to-end tests all need one)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsec.config import Settings
from dsec.errors import DSecError


@dataclass
class ServeProcess:
    home: Path
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    log: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Graceful stop of the process we started (by PID); SIGKILL if it overstays."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def start_serve(home: Path, extra_env: dict[str, str] | None = None, *, log_name: str = "serve.log",
                timeout: float = 120, log_level: str = "warning") -> ServeProcess:
    """``dsec serve --host 127.0.0.1 --port 0`` with ``DSEC_HOME=home``; returns once its
    server.json names this very process (so a stale file from an old run is never trusted)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
    env.update({"DSEC_HOME": str(home), **(extra_env or {})})
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.json").unlink(missing_ok=True)
    log = home / log_name
    with open(log, "ab") as fh:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "dsec"), "serve", "--host", "127.0.0.1",
                                 "--port", "0", "--log-level", log_level],
                                env=env, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            # Its last lines say why (e.g. the pre-flight checks: what failed and the fix).
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-12:])
            raise DSecError(f"`dsec serve` exited with {proc.returncode} (log: {log}):\n{tail}")
        try:
            info = json.loads((home / "server.json").read_text())
            if info.get("pid") == proc.pid:
                return ServeProcess(home, proc, info["url"], (home / "token").read_text().strip(), log)
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise DSecError(f"`dsec serve` did not come up within {timeout:g}s; see {log}")
        time.sleep(0.05)


def reap_home(home: Path, settings: Settings | None = None) -> None:
    """After the server stopped: adopt and destroy whatever sandboxes remain under ``home``
    (e.g. warm-pool members no tenant can see), so nothing leaves a mount or process behind
    (and a later rmtree of ``home`` does not trip over one). ``settings`` defaults to
    ``Settings(home=home)``."""
    # Imported here: the node layer is heavy and launching a server does not need it.
    from dsec.node.agent import LocalNodeAgent

    async def reap() -> None:
        node = LocalNodeAgent(settings if settings is not None else Settings(home=home))
        await node.start()
        try:
            for info in await node.list():
                await node.destroy(info.id)
        finally:
            await node.close()

    asyncio.run(reap())
