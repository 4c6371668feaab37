"""The sandbox seccomp profile: an allow-list generated here, not copied from elsewhere.

Default action is EPERM (not KILL): a program probing an unusual syscall gets an error
it can handle instead of dying mysteriously (seed 000 §5.2 reports agents broken by
over-blocking). What real agent tools need — shells, python3, gcc, git, pip, threads,
asyncio, node — is allowed; what lets code reach the kernel's privileged surfaces
(modules, mounts, namespaces, keyrings, bpf, perf, clocks, reboot, kexec, handle-based
opens) is not. Each group below says why it is open.
"""

from __future__ import annotations

import errno
from typing import Any

# Process lifetime, threads and signals: every runtime needs these.
_PROCESS = """
exit exit_group wait4 waitid kill tgkill tkill getpid getppid gettid getpgid getpgrp setpgid
getsid setsid execve execveat fork vfork set_tid_address set_robust_list get_robust_list
rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigqueueinfo
rt_tgsigqueueinfo rt_sigsuspend sigaltstack pause alarm futex futex_waitv restart_syscall
sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_setparam
sched_getscheduler sched_setscheduler sched_get_priority_max sched_get_priority_min
sched_rr_get_interval sched_getattr sched_setattr getpriority setpriority prctl arch_prctl
rseq capget capset getrlimit setrlimit prlimit64 getrusage times uname sysinfo
getcpu membarrier pidfd_open pidfd_send_signal pidfd_getfd getrandom ioprio_get ioprio_set
"""

# Self-restriction: programs that sandbox themselves (browsers, test harnesses) can only
# narrow what they may do; with no_new_privs these never widen anything.
_SELF_RESTRICT = """
seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self
"""

# Identity: pip/apt/git drop and switch users; without CAP_SETUID these only narrow.
_IDENTITY = """
getuid geteuid getgid getegid getresuid getresgid getgroups setuid setgid setreuid setregid
setresuid setresgid setgroups setfsuid setfsgid
"""

# Memory management (mmap/mprotect are what over-blocking profiles break most often).
_MEMORY = """
brk mmap munmap mremap mprotect madvise mlock mlock2 munlock mlockall munlockall mincore
msync memfd_create pkey_alloc pkey_free pkey_mprotect get_mempolicy
"""

# Files and directories within the sandbox's own tree.
_FILES = """
read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 open openat openat2
close close_range creat lseek stat fstat lstat newfstatat statx statfs fstatfs access faccessat
faccessat2 readlink readlinkat getdents getdents64 getcwd chdir fchdir rename renameat renameat2
mkdir mkdirat rmdir link linkat unlink unlinkat symlink symlinkat chmod fchmod fchmodat chown
fchown lchown fchownat umask truncate ftruncate fallocate fsync fdatasync sync syncfs
sync_file_range utime utimes futimesat utimensat dup dup2 dup3 fcntl flock ioctl pipe pipe2
mknod mknodat sendfile copy_file_range splice tee vmsplice fadvise64 readahead
getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr setxattr lsetxattr fsetxattr
removexattr lremovexattr fremovexattr inotify_init inotify_init1 inotify_add_watch
inotify_rm_watch fanotify_mark name_to_handle_at
"""

# Event loops and timers (asyncio, node, test runners).
_EVENTS = """
select pselect6 poll ppoll epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait
epoll_pwait2 eventfd eventfd2 signalfd signalfd4 timerfd_create timerfd_settime
timerfd_gettime timer_create timer_settime timer_gettime timer_getoverrun timer_delete
clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time getitimer setitimer
io_setup io_destroy io_getevents io_submit io_cancel io_uring_setup io_uring_enter
io_uring_register
"""

# Sockets: the network namespace and host-side policy decide what is reachable;
# raw/packet sockets additionally need CAP_NET_RAW, which sandboxes do not have.
_NETWORK = """
socket socketpair connect accept accept4 bind listen getsockname getpeername sendto recvfrom
sendmsg recvmsg sendmmsg recvmmsg shutdown setsockopt getsockopt
"""

# IPC inside the sandbox's own IPC namespace (multiprocessing, postgres-style tools).
_IPC = """
shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl
mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
"""

# Debuggers and profilers inside the sandbox (gdb, strace, py-spy). The pid namespace
# limits targets to the sandbox; the init agent is non-dumpable, so it is not a target.
_DEBUG = """
ptrace process_vm_readv process_vm_writev kcmp
"""

ALLOWED_SYSCALLS: tuple[str, ...] = tuple(
    sorted(set(" ".join([_PROCESS, _SELF_RESTRICT, _IDENTITY, _MEMORY, _FILES, _EVENTS, _NETWORK, _IPC, _DEBUG]).split()))
)

# Never allowed, listed so tests can assert they stay closed.
DENIED_SYSCALLS: tuple[str, ...] = (
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "bpf",
    "perf_event_open", "add_key", "request_key", "keyctl", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "acct", "open_by_handle_at", "userfaultfd", "iopl", "ioperm",
    "quotactl", "lookup_dcookie", "syslog", "vhangup", "sethostname", "setdomainname",
    "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "mount_setattr",
)

_CLONE_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_PERSONALITY_OK = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)  # linux, UNAME26 variants, query


def seccomp_profile() -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object for x86_64 sandboxes."""
    syscalls: list[dict[str, Any]] = [
        {"names": list(ALLOWED_SYSCALLS), "action": "SCMP_ACT_ALLOW"},
        # clone is allowed only without namespace flags: no nested namespaces.
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": _CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        # clone3 passes flags in memory seccomp cannot read; ENOSYS makes libc fall back to clone.
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    syscalls += [
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]}
        for v in _PERSONALITY_OK
    ]
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno.EPERM,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": syscalls,
    }


def init_profile_header() -> str:
    """C header with the profile above for dsec-init's ``--seccomp`` (container tier).

    dsec-init (PID 1) installs the profile on itself before it serves anything, so every
    process of the sandbox inherits it, as with runc's filter, and runc does not compile
    the ~300-name profile with libseccomp on each create (about a quarter of runc's CPU
    here). Names are resolved by the C compiler (``__NR_*``); a name this architecture
    lacks is left out, as libseccomp does. Same x86_64 decisions as ``seccomp_profile``;
    the i386 ABI is refused (EPERM) and x32 numbers answer ENOSYS, instead of both being
    filtered by name (agent/seccomp_profile.h).
    """
    lines = ["/* Generated by dsec.runtime.seccomp.init_profile_header: do not edit. */",
             "static const int profile_allow[] = {"]
    for name in ALLOWED_SYSCALLS:
        lines += [f"#ifdef __NR_{name}", f"    __NR_{name},", "#endif"]
    lines += ["};",
              "static const unsigned int profile_personality[] = {"
              + ", ".join(f"{v:#x}u" for v in _PERSONALITY_OK) + "};",
              f"#define PROFILE_CLONE_NS_FLAGS {_CLONE_NAMESPACE_FLAGS:#x}u",
              f"#define PROFILE_DEFAULT_ERRNO {errno.EPERM}  /* defaultErrnoRet: EPERM */",
              f"#define PROFILE_CLONE3_ERRNO {errno.ENOSYS}",
              # Syscall numbers above the largest one the profile names answer ENOSYS, not EPERM:
              # what runc's filter does (its stub), so libc's fallbacks for syscalls newer than
              # the profile (e.g. fchmodat2 -> fchmodat) keep working.
              f"#define PROFILE_NEWER_ERRNO {errno.ENOSYS}", ""]
    return "\n".join(lines)
