/* Kernel-surface probe run inside a sandbox by tests/integration/sandbox.
 * Each check makes one privileged (or control) syscall and prints "name RESULT", where
 * RESULT is OK or the errno name. Static, so it runs in any image on either tier. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <linux/reboot.h>
#include <net/ethernet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/klog.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void report(const char *name, long rc) {
    if (rc >= 0) printf("%s OK\n", name);
    else printf("%s %s\n", name, strerrorname_np(errno) ? strerrorname_np(errno) : "E?");
    fflush(stdout);
}

static long open_close(const char *path, int flags) {
    int fd = open(path, flags);
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

static long write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) return -1;
    long n = write(fd, data, strlen(data));
    close(fd);
    return n < 0 ? -1 : 0;
}

static long in_child(int (*fn)(void)) {
    /* Run fn in a child so a success cannot change the probe's own state. */
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) { int r = fn(); _exit(r < 0 ? errno : 0); }
    int st;
    waitpid(pid, &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
    errno = WIFEXITED(st) ? WEXITSTATUS(st) : EINTR;
    return -1;
}

static int do_unshare_user(void) { return unshare(CLONE_NEWUSER); }
static int do_unshare_ns(void) { return unshare(CLONE_NEWNS); }
static int do_unshare_net(void) { return unshare(CLONE_NEWNET); }
static int do_chroot(void) { return chroot("/tmp"); }
/* `unshare -U -r` (a user namespace mapping us to root, with every capability in it),
   then a raw or packet socket: gVisor's Sentry used to grant them (issue 18 #10). */
static int userns_socket(int domain, int type, int proto) {
    if (unshare(CLONE_NEWUSER) == 0) {
        write_file("/proc/self/setgroups", "deny");
        write_file("/proc/self/uid_map", "0 0 1");
        write_file("/proc/self/gid_map", "0 0 1");
    }
    return socket(domain, type, proto);
}
static int do_userns_raw(void) { return userns_socket(AF_INET, SOCK_RAW, IPPROTO_ICMP); }
static int do_userns_raw6(void) { return userns_socket(AF_INET6, SOCK_RAW, IPPROTO_ICMPV6); }
static int do_userns_packet(void) { return userns_socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)); }
static int do_userns_packet_dgram(void) { return userns_socket(AF_PACKET, SOCK_DGRAM, htons(ETH_P_IP)); }
static int do_setns(void) {
    int fd = open("/proc/self/ns/net", O_RDONLY);
    if (fd < 0) return -1;
    return setns(fd, CLONE_NEWNET);
}
static int do_clone_newpid(void) {
    long pid = syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) _exit(0);
    if (pid < 0) return -1;
    waitpid(pid, NULL, 0);
    return 0;
}
static int do_clone_newuser(void) {
    long pid = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) _exit(0);
    if (pid < 0) return -1;
    waitpid(pid, NULL, 0);
    return 0;
}
static int do_ptrace_child(void) {
    pid_t pid = fork();
    if (pid == 0) { ptrace(PTRACE_TRACEME, 0, 0, 0); raise(SIGSTOP); _exit(0); }
    int st;
    waitpid(pid, &st, 0);
    if (!WIFSTOPPED(st)) { errno = ECHILD; return -1; }
    long r = ptrace(PTRACE_CONT, pid, 0, 0);
    waitpid(pid, &st, 0);
    return r < 0 ? -1 : 0;
}
static int do_nothing(void) { return 0; }
static void *thread_fn(void *arg) { return arg; }

int main(void) {
    char buf[64] = {0};
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);

    /* mounts and namespaces */
    report("mount_tmpfs", mount("none", "/tmp", "tmpfs", 0, NULL));
    report("mount_cgroup", mount("cgroup", "/tmp", "cgroup", 0, "memory"));
    report("umount_proc", umount2("/proc", MNT_DETACH));
    report("unshare_user", in_child(do_unshare_user));
    report("unshare_mount", in_child(do_unshare_ns));
    report("unshare_net", in_child(do_unshare_net));
    report("clone_newpid", in_child(do_clone_newpid));
    report("clone_newuser", in_child(do_clone_newuser));
    report("setns_net", in_child(do_setns));
    report("chroot", in_child(do_chroot));
    report("pivot_root", syscall(SYS_pivot_root, "/tmp", "/tmp"));
    /* kernel modules, boot, time, logs, io ports */
    report("init_module", syscall(SYS_init_module, buf, sizeof buf, ""));
    int nullfd = open("/dev/null", O_RDONLY);
    report("finit_module", syscall(SYS_finit_module, nullfd, "", 0));
    report("delete_module", syscall(SYS_delete_module, "loop", O_NONBLOCK));
    report("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0));
    report("reboot", syscall(SYS_reboot, LINUX_REBOOT_MAGIC1, LINUX_REBOOT_MAGIC2, 0x12345678, 0));
    report("clock_settime", clock_settime(CLOCK_REALTIME, &now));
    report("swapon", swapon("/tmp/none", 0));
    report("syslog_read", klogctl(3, buf, sizeof buf));
    report("iopl", iopl(3));
    report("ioperm", ioperm(0x80, 1, 1));
    report("acct", acct(NULL));
    report("sethostname", sethostname("evil", 4));
    report("setdomainname", setdomainname("evil", 4));
    /* bpf, perf, keys, handles, userfaultfd */
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    report("bpf", syscall(SYS_bpf, BPF_MAP_CREATE, &attr, sizeof attr));
    struct perf_event_attr pa;
    memset(&pa, 0, sizeof pa);
    pa.type = PERF_TYPE_SOFTWARE;
    pa.size = sizeof pa;
    pa.config = PERF_COUNT_SW_CPU_CLOCK;
    report("perf_event_open", syscall(SYS_perf_event_open, &pa, 0, -1, -1, 0));
    report("add_key", syscall(SYS_add_key, "user", "k", "v", 1, -2));
    struct { unsigned int bytes; int type; unsigned char h[8]; } fh = {8, 1, {0}};
    report("open_by_handle_at", syscall(SYS_open_by_handle_at, AT_FDCWD, &fh, O_RDONLY));
    report("userfaultfd", syscall(SYS_userfaultfd, 0));
    /* devices */
    /* /work is the host-backed rootfs on both tiers; gVisor's /tmp is its own tmpfs. */
    report("mknod_char", mknod("/work/probe-mem", S_IFCHR | 0600, makedev(1, 1)));
    report("mknod_block", mknod("/work/probe-sda", S_IFBLK | 0600, makedev(8, 0)));
    report("mknod_char_tmp", mknod("/tmp/probe-mem", S_IFCHR | 0600, makedev(1, 1)));
    report("mknod_block_tmp", mknod("/tmp/probe-sda", S_IFBLK | 0600, makedev(8, 0)));
    report("open_made_char", open_close("/tmp/probe-mem", O_RDONLY));
    report("open_made_block", open_close("/tmp/probe-sda", O_RDONLY));
    report("open_dev_mem", open_close("/dev/mem", O_RDONLY));
    report("open_dev_kmsg", open_close("/dev/kmsg", O_RDONLY));
    /* raw network */
    report("raw_socket", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    report("packet_socket", socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)));
    report("userns_raw_socket", in_child(do_userns_raw));
    report("userns_raw6_socket", in_child(do_userns_raw6));
    report("userns_packet_socket", in_child(do_userns_packet));
    report("userns_packet_dgram_socket", in_child(do_userns_packet_dgram));
    /* /proc/sys, /sys, cgroups */
    report("write_proc_sys_hostname", write_file("/proc/sys/kernel/hostname", "evil"));
    report("write_proc_sys_vm", write_file("/proc/sys/vm/drop_caches", "3"));
    report("write_sysrq", write_file("/proc/sysrq-trigger", "h"));
    report("write_sys_class", write_file("/sys/class/net/lo/mtu", "1280"));
    report("write_sys_kernel", write_file("/sys/kernel/uevent_helper", "/evil"));
    report("write_cgroup", open_close("/sys/fs/cgroup/cgroup.procs", O_WRONLY | O_CREAT));
    /* PID 1 (the exec agent) */
    report("ptrace_attach_init", ptrace(PTRACE_ATTACH, 1, 0, 0));
    report("open_init_fd0", open_close("/proc/1/fd/0", O_RDONLY));
    report("open_init_fd3", open_close("/proc/1/fd/3", O_RDWR));
    report("open_init_environ", open_close("/proc/1/environ", O_RDONLY));
    report("open_init_mem", open_close("/proc/1/mem", O_RDONLY));
    report("open_init_root", open_close("/proc/1/root/", O_RDONLY | O_DIRECTORY));
    /* controls: what agent tools need must keep working */
    report("ctl_fork", in_child(do_nothing));
    report("ctl_tcp_socket", socket(AF_INET, SOCK_STREAM, 0));
    report("ctl_udp_socket", socket(AF_INET6, SOCK_DGRAM, 0));
    report("ctl_mkfifo", mknod("/tmp/probe-fifo", S_IFIFO | 0600, 0));
    report("ctl_ptrace_own_child", in_child(do_ptrace_child));
    pthread_t t;
    errno = pthread_create(&t, NULL, thread_fn, NULL);
    report("ctl_thread", errno ? -1 : pthread_join(t, NULL));
    report("ctl_chown", chown("/tmp/probe-fifo", 65534, 65534));
    report("clone3", syscall(SYS_clone3, NULL, 0));
    printf("no_new_privs %d\n", prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
    FILE *st = fopen("/proc/self/status", "r");
    char line[256];
    while (st && fgets(line, sizeof line, st))
        if (!strncmp(line, "CapEff:", 7) || !strncmp(line, "CapBnd:", 7) || !strncmp(line, "Seccomp:", 8)) {
            char key[32], val[64];
            if (sscanf(line, "%31[^:]: %63s", key, val) == 2) printf("%s %s\n", key, val);
        }
    return 0;
}
