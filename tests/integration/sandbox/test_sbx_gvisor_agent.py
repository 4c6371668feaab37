"""gVisor execs go through the sandbox's dsec-init agent like the container tier (issue 15),
reached through `runsc exec` relays that are kept alive and reused. The agent's socket is
inside the sandbox, so these tests check sandbox code cannot use it, that agent-started
commands carry dsec-init's syscall filter, and that one relay serves many execs."""

from __future__ import annotations

import pytest
from sbx_helpers import make, sh

from dsec.models import ExecRequest
from dsec.runtime.agent.protocol import encode_exec, frame

pytestmark = [pytest.mark.integration, pytest.mark.gvisor]


async def test_sandbox_code_cannot_use_the_agent(node):
    """PID 1 listens on an abstract socket inside the sandbox, which sandbox code can reach.
    Every connection must open with the per-sandbox token, which PID 1 read and emptied
    before any sandbox code ran: sandbox code running the very same relay gets its
    connection closed without an answer, so it cannot start processes outside its exec's
    tree (or ask for anything else)."""
    info = await make(node, "gvisor")
    r = await sh(node, info.id, "wc -c < /.dsec/token")
    assert r.stdout.strip() == "0", r
    ping = "printf '\\000\\000\\000\\003R\\001H'"
    r = await sh(node, info.id, f"{ping} | /.dsec/init relay dsec-agent | wc -c")
    assert (r.exit_code, r.stdout.strip()) == (0, "0"), r
    # an exec request behind a wrong token: the relay serves execs itself only once PID 1
    # accepted the token, so this one runs nothing and answers nothing either
    forged = frame(b"A", b"\0" * 32) + encode_exec(["/bin/touch", "/tmp/forged"], {}, "/", None, keep_alive=True)
    await node.write_file(info.id, "/tmp/forged.req", forged)
    r = await sh(node, info.id, "/.dsec/init relay dsec-agent < /tmp/forged.req | wc -c; ls /tmp/forged")
    assert r.stdout.startswith("0\n") and "No such file" in r.stderr, r
    assert (await sh(node, info.id, "echo real")).stdout == "real\n"


async def test_agent_commands_run_under_the_exec_filter(node):
    """A command started by the agent on gVisor gets no new namespaces (runsc applies no
    OCI seccomp profile inside; dsec-init serve --filter does)."""
    info = await make(node, "gvisor")
    r = await sh(node, info.id, "unshare -U true; echo rc=$?")
    assert "rc=0" not in r.stdout, r
    r = await sh(node, info.id, "grep Seccomp: /proc/self/status || echo none")
    assert r.exit_code == 0


async def test_background_and_ps_on_gvisor(node):
    """Background processes (PID 1's table) work on gVisor now that the agent is reachable."""
    info = await make(node, "gvisor")
    r = await node.exec(info.id, ExecRequest(cmd="sleep 300", background=True))
    assert r.pid and r.pid > 1
    procs = {p.pid: p for p in await node.processes(info.id)}
    assert procs[r.pid].running
    await node.kill_process(info.id, r.pid, 9)


async def test_one_relay_serves_many_execs(node):
    """Sequential execs reuse one kept-alive relay: the command's parent (its handler in
    the agent) stays the same, so `runsc exec` is paid once, not per exec."""
    info = await make(node, "gvisor")
    ppids = [(await sh(node, info.id, "read -r _ _ _ p _ < /proc/$$/stat; echo $p")).stdout for _ in range(4)]
    assert len(set(ppids)) == 1, ppids


async def test_exec_is_served_by_the_relay_itself(node):
    """An exec's handler is the `runsc exec`'d relay, not a process PID 1 forked behind it:
    each frame skips a hop through a second sandbox process (on gVisor's ptrace platform a
    wake-up plus a read and a write each way, ~1.5 ms of a ~10 ms exec)."""
    info = await make(node, "gvisor")
    r = await sh(node, info.id, "read -r _ _ _ p _ < /proc/$PPID/stat; echo $p; tr '\\0' ' ' < /proc/$PPID/cmdline")
    ppid, cmdline = r.stdout.splitlines()
    assert cmdline.strip() == "/.dsec/init relay dsec-agent" and ppid != "1", r


async def test_sandbox_code_cannot_write_host_files_through_proc_fd(node):
    """gVisor does not apply the dumpable rule to /proc/N/fd: sandbox code could open PID 1's
    and the relays' host-backed stdio there, log files on the host that no disk quota
    covers. After start-up they point at /dev/null, so no host file is writable that way."""
    info = await make(node, "gvisor")
    r = await sh(node, info.id, "for f in /proc/[0-9]*/fd/*; do case $(readlink $f) in host:*) "
                                "echo x 2>/dev/null >> $f && echo WROTE $f;; esac; done; echo done")
    assert r.stdout.endswith("done\n") and "WROTE" not in r.stdout, r
