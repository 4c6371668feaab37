"""dsec-init as PID 1: reaps zombies, ignores signals from inside, leaks no fds and keeps
its control endpoint out of reach of sandbox code without CAP_SYS_PTRACE."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from agent_helpers import ENV, sh

from dsec.runtime.agent.local import start_local_agent
from dsec.runtime.agent_client import agent_exec, agent_ping

pytestmark = pytest.mark.integration

DROP_CAPS = ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--"]


async def test_agent_is_pid1_and_reaps_orphaned_zombies(sock: Path) -> None:
    """Orphans that exit after their exec ended are reaped by PID 1: no zombies pile up."""
    r = await sh(sock, "cat /proc/1/stat")
    assert r.stdout.startswith(b"1 (dsec-init")
    r = await sh(sock, "for i in 1 2 3 4 5 6 7 8 9 10; do (sleep 0.2 &) ; done; echo started")
    assert r.stdout == b"started\n"
    await asyncio.sleep(0.6)
    for _ in range(50):  # a starved box may run a 0.2 s sleep late: a zombie that stays is the fault
        r = await sh(sock, 'grep -l "^State:.*Z" /proc/[0-9]*/status; true')
        if r.stdout == b"":
            break
        await asyncio.sleep(0.1)
    assert r.stdout == b"", f"zombies left: {r.stdout!r}"


@pytest.mark.parametrize("sig", ["TERM", "INT", "HUP", "USR1", "KILL", "CHLD", "PIPE"])
async def test_signals_from_inside_do_not_kill_pid1(sock: Path, sig: str) -> None:
    """Sandbox root can send any signal to PID 1 and the agent keeps serving."""
    r = await sh(sock, f"kill -{sig} 1; echo sent")
    assert r.stdout == b"sent\n"
    await asyncio.sleep(0.05)
    assert await agent_ping(sock, 2.0)
    assert (await sh(sock, "echo ok")).stdout == b"ok\n"


PROBE = ("for f in /proc/1/fd/*; do readlink -v $f >/dev/null || echo DENIED-fd; done; "
         "cat /proc/1/environ >/dev/null || echo DENIED-environ; "
         "head -c1 /proc/1/mem >/dev/null 2>&1; ls /proc/1/root/ >/dev/null || echo DENIED-root")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
async def test_proc1_fds_unreachable_without_cap_sys_ptrace(sock: Path) -> None:
    """Non-dumpable PID 1: root without CAP_SYS_PTRACE cannot follow /proc/1/fd/* (the host
    socket and connections), nor read PID 1's environ or enter its root. (fd numbers stay listable:
    the dir is root-owned 0500 and the sandbox runs as root; that reveals nothing.)"""
    control = await agent_exec(sock, ["/bin/sh", "-c", PROBE], env=ENV, cwd="/", timeout=10, max_output=4096)
    assert control.stdout == b"", control  # with CAP_SYS_PTRACE all of it works: the probe can fail
    r = await agent_exec(sock, [*DROP_CAPS, "/bin/sh", "-c", PROBE], env=ENV, cwd="/", timeout=10,
                         max_output=4096)
    lines = r.stdout.decode().split()
    assert lines.count("DENIED-fd") >= 3 and set(lines) == {"DENIED-fd", "DENIED-environ", "DENIED-root"}, r


async def test_commands_inherit_no_agent_fds(sock: Path) -> None:
    """A command sees only its stdio: the listening socket and connections are never inherited."""
    r = await sh(sock, "ls /proc/self/fd")
    assert sorted(int(x) for x in r.stdout.split()) == [0, 1, 2, 3]  # 3 = ls's own directory fd
    r = await sh(sock, "readlink /proc/self/fd/0 /proc/self/fd/1 /proc/self/fd/2")
    assert all(line.startswith(b"pipe:") for line in r.stdout.split()), r.stdout


def test_without_socket_it_runs_as_plain_init(agent_binary: Path, tmp_path: Path) -> None:
    """Started without a listening socket (e.g. under runsc), dsec-init stays up as a reaping init."""
    import select
    import subprocess

    said = b"not a listening socket: running as a plain init"
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
                             str(agent_binary), "--fd", "3"], stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = b""
    try:
        end = time.monotonic() + 10  # read until it said so (a starved box starts it late), then kill
        while said not in err and time.monotonic() < end:
            if select.select([proc.stderr], [], [], 0.1)[0]:
                chunk = os.read(proc.stderr.fileno(), 4096)
                if not chunk:
                    break
                err += chunk
        time.sleep(0.3)
        assert proc.poll() is None  # and it stays up
    finally:
        proc.send_signal(signal.SIGKILL)
        err += proc.communicate(timeout=10)[1]
    assert said in err


def test_agent_survives_host_reconnects_after_client_restart(agent_binary: Path, tmp_path: Path) -> None:
    """The socket path persists, so a restarted host process reconnects to the same PID 1."""
    agent = start_local_agent(agent_binary, tmp_path / "a.sock", pid_namespace=True)
    try:
        for _ in range(3):  # each asyncio.run is a fresh host event loop, as after a restart
            deadline = time.monotonic() + 10
            while not asyncio.run(agent_ping(agent.sock_path, 1.0)):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = asyncio.run(sh(agent.sock_path, "echo $$"))
            assert r.exit_code == 0
    finally:
        agent.stop()
