"""Drivers for OCI runtimes: runc (container tier) and runsc (gVisor tier).

The runtime is started with ``posix_spawn`` so the agent's listening socket lands on
fd 3 (``--preserve-fds 1``) without a fork-unsafe ``preexec_fn`` in our threaded
server. Destroy avoids ``runc delete -f`` (which polls ~100 ms for the process to die):
we SIGKILL the sandbox's init by PID — the kernel then kills its whole pid namespace —
wait on a pidfd, then ``delete`` the already-dead container.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
from dataclasses import dataclass, field
from pathlib import Path

from dsec.errors import SandboxFailure


@dataclass
class RuntimeResult:
    returncode: int
    output: str


async def _wait_pid(pid: int) -> int:
    """Wait for a child spawned by us without a child watcher (pidfd + waitpid)."""
    pidfd = os.pidfd_open(pid)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


async def spawn(argv: list[str], log_path: Path, fds: dict[int, int] | None = None) -> RuntimeResult:
    """Run ``argv`` with stdout/stderr to ``log_path`` and ``fds`` (child_fd -> our_fd) placed."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        actions: list[tuple[int, int, int]] = [
            (os.POSIX_SPAWN_DUP2, null_fd, 0), (os.POSIX_SPAWN_DUP2, log_fd, 1), (os.POSIX_SPAWN_DUP2, log_fd, 2)]
        actions += [(os.POSIX_SPAWN_DUP2, ours, child) for child, ours in (fds or {}).items()]
        try:
            pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=actions)
        except FileNotFoundError:
            raise SandboxFailure(f"{argv[0]} not found: run scripts/setup.sh to install it") from None
    finally:
        os.close(log_fd)
        os.close(null_fd)
    rc = await _wait_pid(pid)
    return RuntimeResult(rc, "")


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()[-limit:]
    except OSError:
        return ""
    return data.decode(errors="replace").strip()


def _runc_error(log_path: Path) -> str:
    """runc logs JSON lines with --log-format json; pull out the messages."""
    msgs = []
    for line in _tail(log_path, 4000).splitlines():
        try:
            msgs.append(json.loads(line).get("msg", line))
        except ValueError:
            msgs.append(line)
    return "; ".join(msgs[-3:])


@dataclass
class OciRuntime:
    """One OCI runtime binary with its own state root (so ``list`` shows only ours)."""

    binary: str
    state_root: Path
    extra_global_args: list[str] = field(default_factory=list)
    name: str = "runc"
    # Nice of ``run`` (through nice(1)): a cold create's runtime work outranks sandbox
    # load on the node; dsec-init puts PID 1 back at 0 before any sandbox code runs.
    run_nice: int = 0

    def _base(self) -> list[str]:
        return [self.binary, "--root", str(self.state_root), *self.extra_global_args]

    async def run(self, sandbox_id: str, bundle: Path, listen_fd: int | None, log_path: Path,
                  run_global_args: tuple[str, ...] = (), netstack_netns: str | None = None) -> int:
        """Create and start the container detached; return the host PID of its init.

        With ``listen_fd`` the exec agent's listening socket is handed to the sandbox's
        init as fd 3 (runc only: runsc has no --preserve-fds and uses ``runsc exec``).
        ``netstack_netns``: runsc ``--network=sandbox`` over that netns (see
        :func:`runsc_netstack_wrapper`).
        """
        self.state_root.mkdir(parents=True, exist_ok=True)
        pid_file = bundle / "init.pid"
        fds = ["--preserve-fds", "1"] if listen_fd is not None else []
        wrap = runsc_netstack_wrapper(netstack_netns) if netstack_netns else []
        nice = ["nice", "-n", str(self.run_nice)] if self.run_nice else []
        argv = [*nice, *wrap, *self._base(), *run_global_args, "run", "--detach", *fds, "--pid-file", str(pid_file),
                "--bundle", str(bundle), sandbox_id]
        res = await spawn(argv, log_path, {3: listen_fd} if listen_fd is not None else None)
        if res.returncode != 0:
            raise SandboxFailure(f"{self.name} failed to start sandbox {sandbox_id}: "
                                 f"{_runc_error(log_path) or 'exit ' + str(res.returncode)}",
                                 sandbox_id=sandbox_id)
        return int(pid_file.read_text().strip())

    async def delete(self, sandbox_id: str, log_path: Path) -> None:
        """Remove a stopped container's runtime state and cgroups (force if still alive).

        runsc's ``delete`` waits ~2 s on a sandbox we already killed; its state is two
        files, so once the processes are gone (the caller killed its cgroup) we drop them.
        """
        if self.name == "runsc":
            for p in self.state_root.glob(f"*_sandbox:{sandbox_id}.*"):
                p.unlink(missing_ok=True)
            return
        await spawn([*self._base(), "delete", "--force", sandbox_id], log_path)

    def remove_state(self, sandbox_id: str) -> None:
        """Drop the runtime's record of a container whose processes are all dead.

        Equivalent to ``delete`` once the caller has killed the container and removed
        its cgroups, without the ~15 ms of starting the runtime binary.
        """
        if self.name == "runsc":
            for p in self.state_root.glob(f"*_sandbox:{sandbox_id}.*"):
                p.unlink(missing_ok=True)
            return
        state = self.state_root / sandbox_id
        if state.is_dir():
            for child in state.iterdir():
                child.unlink(missing_ok=True)
            state.rmdir()

    def has_state(self, sandbox_id: str) -> bool:
        return sandbox_id in self.list_ids()

    def list_ids(self) -> list[str]:
        """Containers with runtime state: runc keeps a dir per id, runsc keeps
        ``<sandbox>_sandbox:<container>.state`` files."""
        if not self.state_root.is_dir():
            return []
        ids = set()
        for p in self.state_root.iterdir():
            if p.is_dir():
                ids.add(p.name)
            elif p.name.endswith(".state") and "_sandbox:" in p.name:
                ids.add(p.name.removesuffix(".state").split("_sandbox:", 1)[1])
        return sorted(ids)

    def exec_argv(self, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str,
                  extra: list[str] | None = None) -> list[str]:
        """argv that runs a command through the runtime's own exec (gVisor path / fallback);
        ``extra``: more ``exec`` options (e.g. runsc's ``--internal-pid-file``)."""
        args = [*self._base(), "exec", "--cwd", cwd, *(extra or [])]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        return [*args, sandbox_id, *argv]

    def kill_argv(self, sandbox_id: str, pid: int, sig: str) -> list[str]:
        """argv that signals one process of the sandbox by its sandbox-internal PID (runsc)."""
        return [*self._base(), "kill", "--pid", str(pid), sandbox_id, sig]


# Debian's runsc 2022-12 decides "root network namespace" by whether
# /proc/sys/net/core/rmem_default exists (runsc/sandbox/network.go, isRootNS), checked
# after joining the sandbox's netns. Since Linux 6.x that sysctl exists in every netns, so
# --network=sandbox always fails with "cannot run with network enabled in root network
# namespace". The wrapper hides that sysctl directory from runsc only: a private (slave)
# mount namespace in which an empty tmpfs covers the *slot netns's* /proc/sys/net/core
# (mounted by a process inside that netns: /proc/sys/net dentries are per netns). runsc
# itself stays in the node's netns, so its control socket (abstract, netns-scoped) is
# reachable by later `runsc exec`; the sandbox joins the slot via the spec's netns path.
_HIDE_SYSCTL = ('nsenter --net="$0" mount -t tmpfs -o size=4k,mode=555,ro dsec-netstack /proc/sys/net/core'
                ' && exec "$@"')


def runsc_netstack_wrapper(netns_path: str) -> list[str]:
    """argv prefix that lets this runsc build its netstack from ``netns_path``."""
    return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", _HIDE_SYSCTL, netns_path]


def make_runtime(isolation: str, runc_path: str, runsc_path: str, platform: str, state_base: Path,
                 runsc_debug_dir: Path | None = None, run_nice: int = 0) -> OciRuntime:
    """``run_nice`` applies to the container tier only: there PID 1 (dsec-init) resets its
    nice to 0 before any sandbox code runs; gVisor's Sentry would keep it."""
    if isolation == "container":
        return OciRuntime(runc_path, state_base / "runc", ["--log-format", "json"], name="runc", run_nice=run_nice)
    if isolation == "gvisor":
        # --ignore-cgroups: runsc cannot drive hybrid cgroups here; limits are applied from
        # the host (see dsec.node.cgroups). file-access=shared: host-side file API writes
        # must be visible inside without gVisor's exclusive dentry cache.
        return OciRuntime(runsc_path, state_base / "runsc",
                          ["--ignore-cgroups", f"--platform={platform}", "--file-access=shared",
                           "--overlay2=none",
                           *([f"--debug-log={runsc_debug_dir}/", "--debug"] if runsc_debug_dir else [])],
                          name="runsc")
    raise ValueError(f"unknown isolation {isolation!r}")


def kill_pid(pid: int) -> bool:
    """SIGKILL a sandbox init; return False when it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def wait_gone(pid: int, timeout: float) -> bool:
    """Block until ``pid`` (not necessarily our child) exits; True when it did."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        # poll, not select: a server holding 1,000 sandboxes has fds above FD_SETSIZE (1024),
        # and select() refuses those ("filedescriptor out of range"): every teardown failed.
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(max(0.0, timeout) * 1000))
    finally:
        os.close(pidfd)


def pid_alive(pid: int | None, start_marker: str | None = None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
