"""Foreground exec through dsec-init (PID 1 in its own pid namespace) and the asyncio client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from pathlib import Path

import pytest
from agent_helpers import ENV, sh, wait_dead

from dsec.errors import InvalidArgument, SandboxFailure
from dsec.runtime.agent_client import ExecOutcome, agent_exec, agent_exec_stream, agent_ping

pytestmark = pytest.mark.integration


async def test_stdout_stderr_and_exit_code(sock: Path) -> None:
    """Both streams come back separately and the exit code is propagated."""
    r = await sh(sock, "printf out; printf err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (7, b"out", b"err", False, False)
    assert r.pid is not None and r.pid > 1


async def test_killed_by_signal_is_128_plus_signo(sock: Path) -> None:
    """A command killed by a signal reports 128+signal, not a timeout."""
    r = await sh(sock, "kill -9 $$")
    assert (r.exit_code, r.timed_out) == (137, False)


async def test_env_is_exactly_the_given_env_and_cwd_is_applied(sock: Path) -> None:
    """The command sees exactly the env it was given (nothing leaks from PID 1) and runs in cwd."""
    env = {"A": "1", "B": "x=y", "PATH": ENV["PATH"]}
    r = await agent_exec(sock, ["env"], env=env, cwd="/tmp", timeout=10, max_output=4096)
    assert sorted(r.stdout.decode().splitlines()) == ["A=1", "B=x=y", f"PATH={ENV['PATH']}"]
    r = await agent_exec(sock, ["/bin/pwd"], env=env, cwd="/tmp", timeout=10, max_output=4096)
    assert r.stdout == b"/tmp\n"


async def test_stdin_round_trip(sock: Path) -> None:
    """stdin bytes reach the command intact, larger than any pipe or frame buffer."""
    data = os.urandom(3 * 1024 * 1024 + 17)
    r = await agent_exec(sock, ["cat"], env=ENV, cwd="/", timeout=30, stdin=data, max_output=len(data))
    assert r.exit_code == 0 and r.stdout == data


async def test_command_ignoring_most_of_stdin_does_not_hang(sock: Path) -> None:
    """A command that exits before reading its stdin ends the exec normally."""
    r = await agent_exec(sock, ["head", "-c", "5"], env=ENV, cwd="/", timeout=30, stdin=b"z" * (8 << 20),
                         max_output=100)
    assert (r.exit_code, r.stdout) == (0, b"zzzzz")


async def test_without_stdin_the_command_reads_eof(sock: Path) -> None:
    """No stdin means immediate EOF, never a command blocked on input."""
    r = await agent_exec(sock, ["cat"], env=ENV, cwd="/", timeout=10, max_output=100)
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"", False)


async def test_50mb_stream_with_bounded_agent_memory(sock: Path) -> None:
    """50 MB stream arrives complete; the agent's handler never buffers more than a few MB."""
    total = 50 * 1024 * 1024
    got, outcome, err = 0, None, b""
    script = f"head -c {total} /dev/zero; grep VmHWM /proc/$PPID/status >&2"
    async with contextlib.aclosing(agent_exec_stream(sock, ["/bin/sh", "-c", script], env=ENV, cwd="/",
                                                     timeout=60)) as stream:
        async for item in stream:
            if isinstance(item, ExecOutcome):
                outcome = item
            elif item[0] == "stdout":
                got += len(item[1])
            else:
                err += item[1]
    assert outcome is not None and outcome.exit_code == 0
    assert got == total
    hwm_kb = int(re.search(rb"VmHWM:\s+(\d+)", err).group(1))  # type: ignore[union-attr]
    assert hwm_kb < 8 * 1024, f"handler peak RSS {hwm_kb} kB for a 50 MB stream"


async def test_output_beyond_max_output_is_truncated_and_drained(sock: Path) -> None:
    """Only max_output bytes per stream are kept; the command still runs to completion."""
    r = await sh(sock, "head -c 1000000 /dev/zero; echo done >&2", max_output=1000)
    assert (r.exit_code, len(r.stdout), r.stderr, r.truncated) == (0, 1000, b"done\n", True)


async def test_200_concurrent_execs(sock: Path) -> None:
    """Hundreds of simultaneous execs each get their own, correct result."""
    results = await asyncio.gather(*(sh(sock, 'echo "$1"', str(i)) for i in range(200)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(200)]
    assert {r.exit_code for r in results} == {0}


async def test_missing_binary_is_127_with_message(sock: Path) -> None:
    """exec of a missing program is exit 127 with a clear stderr line, not a hang or crash."""
    r = await agent_exec(sock, ["no-such-program-x"], env=ENV, cwd="/", timeout=10, max_output=1000)
    assert r.exit_code == 127 and b"no-such-program-x: command not found" in r.stderr
    r = await agent_exec(sock, ["/nope/prog"], env=ENV, cwd="/", timeout=10, max_output=1000)
    assert r.exit_code == 127 and b"No such file or directory" in r.stderr


async def test_not_executable_and_bad_cwd_are_126(sock: Path, tmp_path: Path) -> None:
    """A non-executable file, a file that is no program and a missing cwd are exit 126 with the reason."""
    plain = tmp_path / "data.txt"
    plain.write_text("not a program\n")
    plain.chmod(0o644)
    r = await agent_exec(sock, [str(plain)], env=ENV, cwd="/", timeout=10, max_output=1000)
    assert r.exit_code == 126 and b"Permission denied" in r.stderr
    plain.chmod(0o755)
    r = await agent_exec(sock, [str(plain)], env=ENV, cwd="/", timeout=10, max_output=1000)
    assert r.exit_code == 126 and b"Exec format error" in r.stderr
    r = await agent_exec(sock, ["true"], env=ENV, cwd="/no/such/dir", timeout=10, max_output=1000)
    assert r.exit_code == 126 and b"cannot change directory to '/no/such/dir'" in r.stderr


async def test_bad_requests_are_refused_before_or_by_the_agent(sock: Path) -> None:
    """Invalid argv/env never reach execve; the agent answers malformed frames with 'F'."""
    with pytest.raises(InvalidArgument, match="NUL"):
        await agent_exec(sock, ["echo", "a\0b"], env=ENV, cwd="/", timeout=5, max_output=10)
    with pytest.raises(InvalidArgument, match="limit"):
        await agent_exec(sock, ["echo", "x" * (2 << 20)], env=ENV, cwd="/", timeout=5, max_output=10)
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(b"\x00\x00\x00\x03R\x01Q")  # unknown op
    kind_and_msg = await reader.read(1000)
    writer.close()
    assert kind_and_msg[4:5] == b"F" and b"unknown operation" in kind_and_msg
    assert await agent_ping(sock, 2.0)


async def test_unreachable_agent_raises_sandbox_failure_naming_the_socket(tmp_path: Path) -> None:
    """A dead agent is a SandboxFailure naming its socket; ping just says False."""
    missing = tmp_path / "gone.sock"
    with pytest.raises(SandboxFailure, match=str(missing)):
        await agent_exec(missing, ["true"], env=ENV, cwd="/", timeout=5, max_output=10)
    assert not await agent_ping(missing, 1.0)


async def test_slow_host_reader_gets_backpressure_not_buffering(sock: Path) -> None:
    """A host that stops reading stalls the command (pipe full) instead of growing the agent;
    closing the connection then kills it."""
    from dsec.runtime.agent import protocol as proto

    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(proto.encode_exec(["/bin/sh", "-c", "head -c 1000000000 /dev/zero"], ENV, "/", 60))
    length, kind = proto.parse_header(await reader.readexactly(5))
    assert kind == b"S"
    pid = proto.decode_pid(await reader.readexactly(length))  # pid of sh; head is its child
    await asyncio.sleep(0.5)  # read nothing while the command could produce ~GBs
    probe = (f'h=$(cut -d" " -f4 /proc/{pid}/stat); grep VmRSS /proc/$h/status; '
             f'cat /proc/{pid}/task/{pid}/children')
    r = await sh(sock, probe)
    rss_kb = int(re.search(rb"VmRSS:\s+(\d+)", r.stdout).group(1))  # type: ignore[union-attr]
    head_pid = int(r.stdout.split()[-1])
    assert rss_kb < 8 * 1024, r.stdout
    state = (await sh(sock, f"cut -d' ' -f3 /proc/{head_pid}/stat")).stdout
    assert state == b"S\n"  # blocked writing to the full pipe, not running
    writer.close()
    assert await wait_dead(sock, [pid, head_pid]) == []
