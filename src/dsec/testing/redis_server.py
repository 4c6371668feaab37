"""A real ``redis-server`` on a free loopback port with its own temp dir (tests, benches).

Stopped by PID (never by name). ``pause``/``resume`` cut and restore it (SIGSTOP/SIGCONT)
to test "Redis lost while running" without losing its data; ``restart`` kills it and
starts it again on the same port and dir (its RDB/AOF kept when ``appendonly``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, port: int, workdir: Path, appendonly: bool = True) -> None:
        self.port, self.workdir, self.appendonly = port, workdir, appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
             "--protected-mode", "no", "--daemonize", "no", "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:] \
                    if (self.workdir / "redis.log").exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}: {log}")
            time.sleep(0.05)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def redis_server(appendonly: bool = True) -> Iterator[RedisServer]:
    """Start a redis-server on a free loopback port in a fresh temp dir; stop it by PID."""
    with tempfile.TemporaryDirectory(prefix="dsec-redis-") as d:
        srv = RedisServer(_free_port(), Path(d), appendonly)
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()
