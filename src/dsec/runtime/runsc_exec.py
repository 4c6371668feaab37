"""One command on the gVisor tier: ``runsc exec`` of ``dsec-init run``, streamed.

``runsc exec`` is only a client: killing it (or its caller going away) leaves the
command running inside the sandbox, and runsc does not forward signals to it. So the
exec asks runsc for the command's sandbox-internal PID (``--internal-pid-file``) and,
whenever it ends early — the caller closed the stream, the task was cancelled, or the
host-side deadline passed — sends SIGTERM to that PID with ``runsc kill --pid``. The
in-sandbox ``dsec-init run`` then freezes and kills the command's whole tree (setsid'd
daemons too) and exits, which ends ``runsc exec``. Every ``runsc`` process started here
is waited for (no zombies), also when the caller is cancelled mid-cleanup.

The exec ends when the process exits, not when its pipes close: background jobs the
command left (``server &``) inherit stdout/stderr and keep them open for as long as they
run. After the exit we take what is already in the pipes (``drain_s``) and stop reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from dsec.runtime.agent.protocol import timeout_to_ms
from dsec.runtime.oci import AGENT_PATH_IN_SANDBOX
from dsec.runtime.oci_runtime import OciRuntime, _wait_pid, spawn

log = logging.getLogger(__name__)

STOP_WAIT_S = 5.0  # after SIGTERM via runsc kill: the tree is killed in milliseconds
PID_FILE_WAIT_S = 2.0  # runsc exec writes the internal pid right after starting the command
TIMEOUT_MARK = b"dsec-init: timeout"


@dataclass
class RunscExit:
    """How the command ended."""

    code: int
    timed_out: bool  # dsec-init's own timeout, or the host deadline (then ``lost``)
    lost: bool  # the host deadline passed: the command was stopped from the host


def run_argv(timeout: float, cwd: str, argv: list[str]) -> list[str]:
    """``dsec-init run`` inside the sandbox. The timeout is rounded UP to whole ms and is
    never 0 (which would mean "no timeout"): 0.0009 s is 1 ms, as on the container tier."""
    return [AGENT_PATH_IN_SANDBOX, "run", "--timeout-ms", str(timeout_to_ms(timeout)), "--cwd", cwd, "--", *argv]


async def runsc_exec_stream(rt: OciRuntime, sandbox_id: str, argv: list[str], env: dict[str, str], cwd: str,
                            timeout: float, stdin: bytes, grace_s: float, drain_s: float,
                            work_dir: Path) -> AsyncIterator[tuple[str, bytes] | RunscExit]:
    """Yield ("stdout"|"stderr", chunk) while the command runs, then one RunscExit.

    ``work_dir``: a host dir of this sandbox for the pid file and runsc's log. Leaving the
    generator early (aclose, cancellation) kills the command's tree inside the sandbox.
    """
    pid_file = work_dir / f"exec-{uuid.uuid4().hex[:12]}.pid"
    full = rt.exec_argv(sandbox_id, run_argv(timeout, cwd, argv), env, "/",
                        extra=["--internal-pid-file", str(pid_file)])
    loop = asyncio.get_running_loop()
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.posix_spawnp(full[0], full, os.environ, file_actions=[  # noqa: ASYNC221 - spawn, no wait
            (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except BaseException:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    exited = asyncio.ensure_future(_wait_pid(pid))  # reaps runsc exec whatever happens below
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=8)  # backpressure on the pipes
    transports: list[asyncio.BaseTransport] = []
    pumps: list[asyncio.Task[None]] = []
    finished = False
    try:
        for kind, fd in (("stdout", out_r), ("stderr", err_r)):
            reader = asyncio.StreamReader()
            tr, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r),  # type: ignore[misc]
                                                 os.fdopen(fd, "rb", buffering=0))
            transports.append(tr)

            async def pump(r: asyncio.StreamReader = reader, k: str = kind) -> None:
                while chunk := await r.read(65536):
                    await queue.put((k, chunk))

            pumps.append(asyncio.create_task(pump()))
        wtr, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(in_w, "wb", buffering=0))
        transports.append(wtr)
        if stdin:
            wtr.write(stdin)  # buffered by the loop; a command that never reads just drops it
        wtr.write_eof()  # type: ignore[attr-defined]

        deadline = loop.time() + timeout + grace_s
        err_tail, lost = b"", False
        while not exited.done():
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, exited}, timeout=max(0.0, deadline - loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                if not done:  # host deadline: dsec-init did not end it in time
                    lost = True
                    await _stop(rt, sandbox_id, pid, exited, pid_file, work_dir)
                continue
            kind, chunk = get.result()
            if kind == "stderr":
                err_tail = (err_tail + chunk)[-256:]
            yield kind, chunk
        drain_until = loop.time() + drain_s
        while True:  # what the pipes still hold, for at most drain_s
            if queue.empty():
                pending = [p for p in pumps if not p.done()]
                if not pending or loop.time() >= drain_until:
                    break
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, *pending}, timeout=max(0.0, drain_until - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                kind, chunk = get.result()
            else:
                kind, chunk = queue.get_nowait()
            if kind == "stderr":
                err_tail = (err_tail + chunk)[-256:]
            yield kind, chunk
        code = exited.result()
        finished = True
        yield RunscExit(code=code, timed_out=lost or (code == 124 and TIMEOUT_MARK in err_tail), lost=lost)
    finally:
        for t in pumps:
            t.cancel()
        for tr in transports:
            tr.close()
        if not exited.done() or not finished:
            # Shielded: a second cancellation must not leave the command or a zombie behind.
            cleanup = asyncio.ensure_future(_stop(rt, sandbox_id, pid, exited, pid_file, work_dir))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(cleanup)
        pid_file.unlink(missing_ok=True)


async def _stop(rt: OciRuntime, sandbox_id: str, pid: int, exited: asyncio.Future[int], pid_file: Path,
                work_dir: Path) -> None:
    """End a running exec: SIGTERM its dsec-init inside the sandbox (which kills the
    command's tree), then make sure ``runsc exec`` is gone and reaped."""
    loop = asyncio.get_running_loop()
    until = loop.time() + PID_FILE_WAIT_S
    inner = _read_pid(pid_file)
    while inner is None and not exited.done() and loop.time() < until:
        await asyncio.sleep(0.02)
        inner = _read_pid(pid_file)
    if inner is not None and not exited.done():
        res = await spawn(rt.kill_argv(sandbox_id, inner, "TERM"), work_dir / "runtime.log")
        if res.returncode != 0:
            log.warning("runsc kill --pid %d of sandbox %s failed (exit %d)", inner, sandbox_id, res.returncode)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(exited), STOP_WAIT_S)
    if not exited.done():
        if inner is None:
            log.warning("exec in sandbox %s: no internal pid from runsc; only runsc exec is killed", sandbox_id)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await exited  # reaped


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
