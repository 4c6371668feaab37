"""The kernel surface a sandbox can reach, probed from inside on both tiers.

A static C probe (sbx_probe.c) makes each privileged syscall once and reports OK or the
errno; every test below asserts one family stays closed (and a few controls that agent
tools need stay open, so a probe that always fails cannot pass). The container tier's
denials come from seccomp (default EPERM), the capability set and read-only/masked
paths; the gVisor tier's from its Sentry, which implements some of these in its own
user-space kernel (noted per test) without reaching the host's.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest
from sbx_helpers import Neighbour, count_procs, make, sh

from dsec.errors import SandboxFailure
from dsec.models import ExecRequest
from dsec.runtime.oci import SANDBOX_CAPABILITIES

pytestmark = pytest.mark.integration

_CACHE: dict[str, dict[str, str]] = {}

# Linux capability numbers (include/uapi/linux/capability.h).
_CAP_NUM = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4,
            "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
            "CAP_NET_RAW": 13, "CAP_SYS_MODULE": 16, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19,
            "CAP_SYS_ADMIN": 21, "CAP_MKNOD": 27}


@pytest.fixture
async def probe(node, tier, probe_binary) -> dict[str, str]:
    """Probe results for this tier (one sandbox and one exec per tier per session)."""
    if tier not in _CACHE:
        info = await make(node, tier)
        await node.write_file(info.id, "/work/probe", probe_binary, 0o755)
        r = await sh(node, info.id, ["/work/probe"], cwd="/work")
        assert r.exit_code == 0, r
        _CACHE[tier] = dict(line.split(None, 1) for line in r.stdout.splitlines())
        await node.destroy(info.id)
    return _CACHE[tier]


def _closed(results: dict[str, str], names: list[str], tier: str, seccomp_eperm: bool = False) -> None:
    opened = {n: results[n] for n in names if results[n] == "OK"}
    assert not opened, f"{tier}: privileged operations succeeded: {opened}"
    if seccomp_eperm and tier == "container":
        other = {n: results[n] for n in names if results[n] != "EPERM"}
        assert not other, f"seccomp/caps should answer EPERM (not kill, not ENOSYS): {other}"


async def test_mount_and_namespace_escapes_denied(probe, tier):
    """mount (tmpfs, cgroup), umount of /proc, pivot_root, chroot, setns, and new pid/net
    namespaces are refused. On runc, unshare/clone of *any* namespace (user, mount too)
    is EPERM from seccomp. gVisor emulates user and mount namespaces inside its Sentry
    (no host namespace is created), so only those two are allowed there."""
    names = ["mount_tmpfs", "mount_cgroup", "umount_proc", "unshare_net", "clone_newpid", "setns_net",
             "chroot", "pivot_root"]
    if tier == "container":
        names += ["unshare_user", "unshare_mount", "clone_newuser"]
    _closed(probe, names, tier, seccomp_eperm=True)


async def test_kernel_modules_boot_clock_and_privileged_syscalls_denied(probe, tier):
    """init_module/finit_module/delete_module (insmod/rmmod), kexec, reboot, clock_settime,
    swapon, iopl/ioperm, acct, sethostname/setdomainname, bpf, perf_event_open, keyrings,
    open_by_handle_at and userfaultfd all fail: seccomp EPERM on runc, the Sentry on gVisor."""
    names = ["init_module", "finit_module", "delete_module", "kexec_load", "reboot", "clock_settime", "swapon",
             "iopl", "ioperm", "acct", "sethostname", "setdomainname", "bpf", "perf_event_open", "add_key",
             "open_by_handle_at", "userfaultfd"]
    if tier == "container":
        names.append("syslog_read")  # gVisor serves a synthetic dmesg of its own
    _closed(probe, names, tier, seccomp_eperm=True)


async def test_raw_and_packet_sockets_denied(probe, tier):
    """No CAP_NET_RAW: raw IP and AF_PACKET sockets fail (no spoofing, no sniffing),
    while ordinary TCP/UDP sockets work."""
    _closed(probe, ["raw_socket", "packet_socket"], tier, seccomp_eperm=True)
    assert probe["ctl_tcp_socket"] == probe["ctl_udp_socket"] == "OK"


async def test_raw_and_packet_sockets_denied_after_unshare_user(probe, tier):
    """Issue 18 #10: `unshare -U -r` (a user namespace where we are root with every
    capability) must not open raw IPv4/IPv6 or AF_PACKET sockets. gVisor's Sentry used to
    grant them; now `dsec-init run` installs a filter (no new namespaces, no raw/packet
    sockets) before every exec, so both steps fail with EPERM on both tiers."""
    _closed(probe, ["userns_raw_socket", "userns_raw6_socket", "userns_packet_socket",
                    "userns_packet_dgram_socket"], tier, seccomp_eperm=True)
    assert probe["userns_raw_socket"] == "EPERM", probe["userns_raw_socket"]
    assert probe["ctl_tcp_socket"] == probe["ctl_udp_socket"] == "OK"


async def test_unshare_user_denied_by_shell_tool(node, tier):
    """The same through the shell tool an agent would use: busybox `unshare -U -r` fails,
    so nothing runs with a user namespace's capabilities."""
    info = await make(node, tier)
    r = await sh(node, info.id, "unshare -U -r id -u; echo rc=$?")
    assert "rc=0" not in r.stdout and "Operation not permitted" in r.stderr, r


async def test_proc_sys_sys_and_cgroup_writes_denied(probe, tier):
    """/proc/sys (hostname, vm.drop_caches), /proc/sysrq-trigger, /sys (class, kernel) and
    the cgroup tree cannot be written: read-only or masked, whatever the caps say."""
    _closed(probe, ["write_proc_sys_hostname", "write_proc_sys_vm", "write_sysrq", "write_sys_class",
                    "write_sys_kernel", "write_cgroup"], tier)


async def test_init_agent_cannot_be_traced_or_inspected(probe, tier):
    """PID 1 (the exec agent) cannot be ptraced, and its memory, root and agent socket
    fd cannot be opened through /proc/1 (no CAP_SYS_PTRACE; the agent is non-dumpable).
    gVisor does not apply the dumpable rule to /proc/1/fd/0 and /proc/1/environ; there
    PID 1 holds no control socket (exec goes through runsc), so nothing leaks."""
    names = ["ptrace_attach_init", "open_init_fd3", "open_init_mem", "open_init_root"]
    if tier == "container":
        names += ["open_init_fd0", "open_init_environ"]
    _closed(probe, names, tier)
    assert probe["ctl_ptrace_own_child"] == "OK", "debuggers on the sandbox's own processes must work"


async def test_device_nodes_cannot_be_made_or_opened(probe, tier):
    """No CAP_MKNOD: device nodes cannot be created in the (host-backed) rootfs; /dev/mem
    and /dev/kmsg do not exist. gVisor lets mknod succeed in its own in-memory /tmp, but
    such a node opens nothing. FIFOs (no privilege needed) still work."""
    _closed(probe, ["mknod_char", "mknod_block", "open_dev_mem", "open_dev_kmsg", "open_made_char",
                    "open_made_block"], tier)
    if tier == "container":
        _closed(probe, ["mknod_char_tmp", "mknod_block_tmp"], tier)
    assert probe["ctl_mkfifo"] == "OK"


async def test_capabilities_no_new_privs_and_seccomp(probe, tier):
    """The process runs with exactly the documented capability set (effective and
    bounding), no_new_privs=1 (setuid binaries cannot gain privilege), and on runc in
    seccomp filter mode; dropped caps include SYS_ADMIN, NET_RAW, SYS_PTRACE, MKNOD."""
    want = sum(1 << _CAP_NUM[c] for c in SANDBOX_CAPABILITIES)
    assert int(probe["CapEff"], 16) == want and int(probe["CapBnd"], 16) == want, probe
    for dropped in ("CAP_SYS_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE", "CAP_MKNOD", "CAP_SYS_MODULE",
                    "CAP_DAC_READ_SEARCH", "CAP_SYS_CHROOT", "CAP_SETPCAP"):
        assert not want & (1 << _CAP_NUM[dropped]), dropped
    assert probe["no_new_privs"] == "1"
    if tier == "container":
        assert probe["Seccomp"] == "2"


async def test_agent_tool_syscalls_still_work(probe, tier):
    """Over-blocking breaks agents: fork, threads, sockets, FIFOs, chown, and ptrace of
    one's own child must work; clone3 answers ENOSYS so libc falls back to clone."""
    for ctl in ("ctl_fork", "ctl_thread", "ctl_tcp_socket", "ctl_udp_socket", "ctl_mkfifo", "ctl_chown",
                "ctl_ptrace_own_child"):
        assert probe[ctl] == "OK", (ctl, probe[ctl])
    assert probe["clone3"] == "ENOSYS"


async def test_hostname_change_refused(node, tier):
    """The sandbox's hostname (its id, in its own UTS namespace) cannot be changed from
    inside, and the host's hostname is never affected."""
    host_before = socket.gethostname()
    info = await make(node, tier)
    r = await sh(node, info.id, "hostname evil; echo rc=$?; hostname")
    assert r.stdout == f"rc=1\n{info.id}\n", r
    assert socket.gethostname() == host_before


async def test_only_allowed_devices_exist(node, tier):
    """/dev holds only null, zero, full, random, urandom, tty, the pts/ptmx pair, shm,
    mqueue and the fd/std* links; writing to /dev/null and reading /dev/urandom work.
    gVisor adds its own /dev/fuse (served by the Sentry; mounting needs CAP_SYS_ADMIN)."""
    info = await make(node, tier)
    r = await sh(node, info.id, "ls /dev; echo x > /dev/null && head -c 4 /dev/urandom | wc -c")
    *names, count = r.stdout.split()
    allowed = {"null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "shm", "mqueue", "fd",
               "stdin", "stdout", "stderr", "console", "net"}
    if tier == "gvisor":
        allowed.add("fuse")
    assert set(names) <= allowed, sorted(set(names) - allowed)
    assert {"null", "zero", "urandom"} <= set(names)
    assert count == "4", r


async def test_host_files_unreachable(node, tier, tmp_path):
    """A secret file on the host (under /tmp and under the sandbox's own host dir) is not
    readable from inside by any path: direct, via /proc/*/root, /proc/*/cwd, `..` chains,
    or a search of the whole sandbox filesystem for its content."""
    secret = os.urandom(12).hex()
    name = f"dsec-secret-{secret[:8]}"
    host_file = f"/tmp/{name}"
    Path(host_file).write_text(secret)
    info = await make(node, tier)
    beside = node.manager.paths(info.id).base / name  # next to the sandbox's rootfs
    beside.write_text(secret)
    try:
        script = (f"for p in /tmp/{name} /../../../../tmp/{name} /work/../../../tmp/{name} "
                  f"/proc/[0-9]*/root/tmp/{name} /proc/[0-9]*/cwd/../../../tmp/{name} /../{name} "
                  f"/proc/[0-9]*/root/../{name}; do cat $p 2>/dev/null; done; "
                  "find / -path /proc -prune -o -path /sys -prune -o -type f -print 2>/dev/null"
                  f" | xargs grep -l {secret} 2>/dev/null; echo done")
        r = await sh(node, info.id, script, timeout=60)
        assert secret not in r.stdout and r.stdout.endswith("done\n"), r
    finally:
        os.unlink(host_file)


async def test_other_sandboxes_processes_invisible(node, tier):
    """Each sandbox has its own pid namespace: a neighbour's processes are not visible
    (so not signalable or traceable), and `kill -9` of every visible pid leaves it alone."""
    nb = await Neighbour.make(node, tier)
    if tier == "container":
        await node.exec(nb.id, ExecRequest(cmd=["sleep", "777"], background=True))
    else:
        await sh(node, nb.id, "sleep 777 </dev/null >/dev/null 2>&1 &")  # no background API on gVisor
    info = await make(node, tier)
    with contextlib.suppress(SandboxFailure):  # killing its own handler may break the stream
        await sh(node, info.id, "ps -o args | grep -c 'sleep 777'; for p in /proc/[0-9]*; do "
                                "kill -9 ${p#/proc/} 2>/dev/null; done", timeout=10)
    assert await count_procs(node, nb.id, "^sleep 777", 1) == 1
    await nb.assert_healthy()
