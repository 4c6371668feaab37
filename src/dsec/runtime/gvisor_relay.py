"""The gVisor tier's way to its sandbox's exec agent: one ``runsc exec`` of
``dsec-init relay NAME`` per connection.

runsc cannot pass a listening socket to the sandbox's init (no ``--preserve-fds``), and
``--host-uds=create`` would turn every socket a sandbox binds on its files into a host
socket it can no longer stat or unlink. So PID 1 listens on an abstract socket inside
the sandbox; the relay copies its stdio, a socketpair to us, to that socket. Sandbox
code can reach that socket too, so every connection opens with an ``A`` frame carrying
a per-sandbox token: PID 1 read it from a bind-mounted file and emptied that file before
any sandbox code ran; the node keeps its copy in the host-only bundle dir. Starting a
relay costs a ``runsc exec`` (tens of ms), so relays are kept alive and reused like the
container tier's connections (``dsec.runtime.agent_client``): closing our end ends the
relay, which closes its connection, which cancels a running exec inside.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from pathlib import Path

from dsec.runtime.agent.protocol import frame
from dsec.runtime.oci import AGENT_PATH_IN_SANDBOX
from dsec.runtime.oci_runtime import OciRuntime, _wait_pid

AGENT_NAME = "dsec-agent"  # abstract socket name PID 1 listens on (serve --listen)
TOKEN_IN_SANDBOX = "/.dsec/token"  # bind of the token file, emptied by PID 1 at start

_reapers: set[asyncio.Future[int]] = set()  # every relay's runsc exec is waited for


def serve_args() -> list[str]:
    """PID 1's argv on the gVisor tier: the agent with its exec filter, listening on @AGENT_NAME."""
    return [AGENT_PATH_IN_SANDBOX, "serve", "--filter", "--listen", AGENT_NAME, "--token-file", TOKEN_IN_SANDBOX]


def write_token(bundle_dir: Path) -> tuple[Path, dict[str, object]]:
    """A fresh token: kept host-only in ``agent.key``, handed to PID 1 through ``agent.token``
    (returned with its OCI mount)."""
    token = secrets.token_bytes(32)
    key, handed = bundle_dir / "agent.key", bundle_dir / "agent.token"
    for path in (key, handed):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
    return handed, {"destination": TOKEN_IN_SANDBOX, "type": "bind", "source": str(handed),
                    "options": ["bind", "rw", "nosuid", "nodev", "noexec"]}


def read_token(bundle_dir: Path) -> bytes | None:
    try:
        return (bundle_dir / "agent.key").read_bytes()
    except OSError:
        return None


def relay_key(sandbox_id: str) -> Path:
    """The ``sock_path`` a gVisor sandbox's execs use (a key, not a file)."""
    return Path(f"gvisor-relay:{sandbox_id}")


async def open_relay(rt: OciRuntime, sandbox_id: str, log_path: Path, token: bytes,
                     ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to the sandbox's agent through a fresh relay, token frame already sent."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = rt.exec_argv(sandbox_id, [AGENT_PATH_IN_SANDBOX, "relay", AGENT_NAME], {}, "/")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=[  # noqa: ASYNC221 - spawn, no wait
            (os.POSIX_SPAWN_DUP2, theirs.fileno(), 0), (os.POSIX_SPAWN_DUP2, theirs.fileno(), 1),
            (os.POSIX_SPAWN_DUP2, log_fd, 2)])
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
        os.close(log_fd)
    reaper = asyncio.ensure_future(_wait_pid(pid))
    _reapers.add(reaper)
    reaper.add_done_callback(_reapers.discard)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    writer.write(frame(b"A", token))
    return reader, writer
