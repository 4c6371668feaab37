"""Run dsec-init outside an OCI runtime: as a plain child, or as PID 1 of a fresh pid
namespace via ``unshare`` (root). Used by the agent's tests and its benchmark, and handy
for debugging the agent without runc. The sandbox runtime passes the socket itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dsec.config import get_settings


def listen_socket(sock_path: Path) -> socket.socket:
    """A listening AF_UNIX socket at sock_path (replacing a stale one), owner-only."""
    sock_path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    os.chmod(sock_path, 0o600)
    sock.listen(get_settings().agent_listen_backlog)
    return sock


@dataclass
class LocalAgent:
    proc: subprocess.Popen[bytes]
    sock_path: Path

    def stop(self) -> None:
        """Kill the agent (and with --kill-child its whole pid namespace)."""
        if self.proc.poll() is None:
            # unshare --kill-child sets PDEATHSIG, so its death kills PID 1 and the namespace
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.sock_path.unlink(missing_ok=True)


def start_local_agent(binary: Path, sock_path: Path, *, pid_namespace: bool) -> LocalAgent:
    """Start binary serving on a new socket at sock_path. With pid_namespace it is PID 1
    of a new pid+mount namespace with its own /proc (needs root); unshare's
    --kill-child takes the namespace down when unshare is killed."""
    sock = listen_socket(sock_path)
    try:
        fd = sock.fileno()
        cmd = [str(binary), "serve", "--fd", str(fd)]
        if pid_namespace:
            cmd = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc", *cmd]
        proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL)
    finally:
        sock.close()  # the agent holds the only listening copy now
    return LocalAgent(proc, sock_path)
