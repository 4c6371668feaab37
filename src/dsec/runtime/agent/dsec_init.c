/*
 * dsec-init: PID 1 and in-sandbox exec agent of every DSec sandbox.
 *
 * Modes (see docs/exec-agent.md for the wire protocol):
 *   dsec-init [serve] [--fd N | --listen NAME --token-file F] [--filter]
 *                                PID-1 agent: accept()s host connections on the listening
 *                                AF_UNIX socket inherited as fd N (default 3). Without a
 *                                listening socket there it is a plain reaping init.
 *                                --filter: every command starts under run mode's seccomp
 *                                filter (the gVisor tier, where runsc applies no OCI profile
 *                                to processes it did not start itself).
 *   dsec-init relay NAME         connect to @NAME and copy stdin -> socket -> stdout (the
 *                                gVisor tier's way in: `runsc exec` of this); stdin EOF
 *                                closes the connection, which cancels a running exec.
 *   dsec-init run [--timeout-ms N] [--cwd DIR] -- argv...
 *                                one command, stdio passed through, tree-kill on timeout
 *                                (exit 124) or on SIGTERM/SIGINT/SIGHUP (exit 128+sig).
 *
 * Why a C program: it must run in images that have neither Python nor a shell, cost
 * almost nothing per exec (target ~1 ms round trip) and never grow without bound.
 * Every fd is O_CLOEXEC, memory is fixed per connection, and the process is
 * non-dumpable so sandbox code without CAP_SYS_PTRACE cannot reach its fds.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTO_VERSION 1
#define AGENT_IDENT "dsec-init 1"
#define MAX_REQUEST (1u << 20)        /* largest request frame (argv+env+paths) */
#define MAX_STRINGS 65536u            /* argc + envc */
#define MAX_PENDING 128               /* connections whose request is still arriving */
#define REQUEST_READ_MS 10000         /* a request must arrive within this */
#define CHUNK 65536                   /* output / stdin frame payload */
#define OUTBUF (4 * (CHUNK + 5))      /* per-exec output buffer (backpressure bound) */
#define INBUF (CHUNK + 5)
#define MAX_BG 1024                   /* background process table */
#define BG_ARGV_KEEP 512              /* argv bytes kept per background entry for ps */
#define LINGER_MS 2000                /* wait for host close after exit when stdin open */
#define KEEPALIVE_IDLE_MS 60000       /* a kept-alive connection with no request ends */
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* failure kinds carried in 'F' frames */
enum { F_BAD_REQUEST = 1, F_NOT_FOUND = 2, F_EXEC = 3, F_RESOURCE = 4 };

struct request {
    uint8_t op;
    uint32_t timeout_ms, argc, envc;
    uint8_t flags;
    char *cwd, **argv, **envp, *outpath;
    uint32_t pid;
    int32_t sig;
};

/* ------------------------------------------------------------------ utilities */

static void logmsg(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    int n = snprintf(buf, sizeof buf, "dsec-init[%d]: ", (int)getpid());
    va_start(ap, fmt);
    n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t r = write(2, buf, (size_t)n);
    (void)r;
}

static int64_t now_ms(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put_u32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8); p[3] = (unsigned char)v;
}

static uint32_t get_u32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* Blocking-ish full write to a socket: retries EINTR/partial writes, waits on EAGAIN. */
static int send_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) { p += n; len -= (size_t)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) {
            struct pollfd pf = { .fd = fd, .events = POLLOUT };
            if (poll(&pf, 1, REQUEST_READ_MS) <= 0) return -1;
            continue;
        }
        return -1;
    }
    return 0;
}

static int send_frame(int fd, char type, const void *payload, uint32_t len)
{
    unsigned char hdr[5];
    put_u32(hdr, len + 1);
    hdr[4] = (unsigned char)type;
    if (send_all(fd, hdr, 5) < 0) return -1;
    return len ? send_all(fd, payload, len) : 0;
}

static void send_failure(int fd, uint8_t kind, const char *fmt, ...)
{
    char buf[600];
    va_list ap;
    buf[0] = (char)kind;
    va_start(ap, fmt);
    int n = vsnprintf(buf + 1, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    send_frame(fd, 'F', buf, (uint32_t)n + 1);
}

static int status_to_code(int st)
{
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
    return 255;
}

/* At startup: drop any SIG_IGN inherited from our launcher (ignored dispositions survive
   execve and would leak into every command). Afterwards only SIGPIPE is ever changed. */
static void reset_all_dispositions(void)
{
    for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
}

/* Child side before exec: default signal state, so commands behave as under a shell. */
static void reset_signals(void)
{
    sigset_t none;
    signal(SIGPIPE, SIG_DFL);  /* handlers need no reset: execve resets caught signals */
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* Runs in the forked child; never returns. 127 = not found, 126 = cannot invoke. */
static void exec_command(char **argv, char **envp, const char *cwd, int errfd)
{
    if (cwd && *cwd && chdir(cwd) < 0) {
        dprintf(errfd, "dsec-init: cannot change directory to '%s': %s\n", cwd, strerror(errno));
        _exit(126);
    }
    const char *file = argv[0];
    if (strchr(file, '/')) {
        execve(file, argv, envp);
        int e = errno;
        dprintf(errfd, "dsec-init: cannot execute '%s': %s\n", file, strerror(e));
        _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
    }
    const char *path = NULL;
    for (char **e = envp; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) { path = *e + 5; break; }
    if (!path) path = DEFAULT_PATH;
    int denied = 0, other = 0;
    char full[PATH_MAX];
    const char *p = path;
    for (;;) {
        const char *end = strchrnul(p, ':');
        size_t dl = (size_t)(end - p);
        if (dl + strlen(file) + 2 <= sizeof full) {
            if (dl == 0) snprintf(full, sizeof full, "%s", file);
            else snprintf(full, sizeof full, "%.*s/%s", (int)dl, p, file);
            execve(full, argv, envp);
            if (errno == EACCES) denied = EACCES;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP && errno != ENAMETOOLONG) {
                other = errno;
                break;
            }
        }
        if (!*end) break;
        p = end + 1;
    }
    if (other) {
        dprintf(errfd, "dsec-init: cannot execute '%s' (%s): %s\n", file, full, strerror(other));
        _exit(126);
    }
    if (denied) {
        dprintf(errfd, "dsec-init: cannot execute '%s': %s\n", file, strerror(denied));
        _exit(126);
    }
    dprintf(errfd, "dsec-init: %s: command not found (PATH=%s)\n", file, path);
    _exit(127);
}

/* ----------------------------------------------------------------- tree kill */

/* (pid, ppid) of every process visible in /proc; returns how many were stored. */
static int scan_proc(pid_t *pids, pid_t *ppids, int max)
{
    int n = 0;
    DIR *d = opendir("/proc");
    if (!d) return 0;
    struct dirent *de;
    while (n < max && (de = readdir(d))) {
        char path[300], buf[512];
        if (de->d_name[0] < '0' || de->d_name[0] > '9') continue;
        snprintf(path, sizeof path, "/proc/%.200s/stat", de->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t r = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (r <= 0) continue;
        buf[r] = 0;
        char *rp = strrchr(buf, ')');  /* comm may contain spaces and parens */
        int ppid;
        if (rp && sscanf(rp + 1, " %*c %d", &ppid) == 1) { pids[n] = atoi(de->d_name); ppids[n++] = ppid; }
    }
    closedir(d);
    return n;
}

static pid_t scan_pids[8192], scan_ppids[8192];

/* Children of this process, from /proc/thread-self/children or a /proc scan. */
static int list_children(pid_t *out, int max)
{
    int n = 0;
    FILE *f = fopen("/proc/thread-self/children", "re");
    if (f) {
        long v;
        while (n < max && fscanf(f, "%ld", &v) == 1) out[n++] = (pid_t)v;
        fclose(f);
        return n;
    }
    int m = scan_proc(scan_pids, scan_ppids, 8192);
    pid_t self = getpid();
    for (int i = 0; i < m && n < max; i++) if (scan_ppids[i] == self) out[n++] = scan_pids[i];
    return n;
}

/*
 * Kill the command's whole tree. We are a child subreaper, so every orphan of the tree
 * reparents to us: SIGKILL the group, then keep SIGKILLing our children (each death
 * hands its own children to us) until we have none. Records the main child's status.
 */
static void kill_tree(pid_t pgid, pid_t main_child, int *main_status, int *main_done, int sigfd)
{
    pid_t kids[1024];
    /* once the main child is reaped its pid (= pgid) may be reused: from then on the
       group's survivors are reached as our reparented children only */
    if (!*main_done) kill(-pgid, SIGKILL);
    for (;;) {
        int st;
        pid_t p;
        while ((p = waitpid(-1, &st, WNOHANG)) > 0)
            if (p == main_child && !*main_done) { *main_status = st; *main_done = 1; }
        if (p < 0 && errno == ECHILD) break;
        int n = list_children(kids, 1024);
        for (int i = 0; i < n; i++) { kill(kids[i], SIGKILL); kill(-kids[i], SIGKILL); }
        if (!*main_done) kill(-pgid, SIGKILL);
        struct pollfd pf = { .fd = sigfd, .events = POLLIN };
        if (poll(&pf, 1, 5) > 0) {
            struct signalfd_siginfo si;
            while (read(sigfd, &si, sizeof si) > 0) {}
        }
    }
}

/*
 * Run mode (the gVisor tier's exec path): without PR_SET_CHILD_SUBREAPER (gVisor 2022-12
 * answers EINVAL) an orphan of the tree re-parents to PID 1, where kill_tree cannot see
 * it. So first freeze every descendant while the ppid links still lead to us: SIGSTOP
 * each one found by a /proc walk (a stopped process cannot fork any more) and rescan
 * until no new one appears, then SIGKILL them all. setsid'd daemons are caught too.
 */
static pid_t frozen[8192];
static void freeze_and_kill_descendants(void)
{
    static char mine[8192];
    int nfrozen = 0;
    pid_t self = getpid();
    for (int round = 0; round < 100; round++) {
        int m = scan_proc(scan_pids, scan_ppids, 8192), fresh = 0;
        memset(mine, 0, sizeof mine);
        for (int grew = 1; grew;) {  /* closure of the ppid links below us */
            grew = 0;
            for (int i = 0; i < m; i++) {
                if (mine[i]) continue;
                int ours = scan_ppids[i] == self;
                for (int j = 0; !ours && j < m; j++) ours = mine[j] && scan_pids[j] == scan_ppids[i];
                if (ours) { mine[i] = 1; grew = 1; }
            }
        }
        for (int i = 0; i < m; i++) {
            if (!mine[i]) continue;
            int seen = 0;
            for (int k = 0; k < nfrozen && !seen; k++) seen = frozen[k] == scan_pids[i];
            if (seen || nfrozen >= 8192) continue;
            kill(scan_pids[i], SIGSTOP);
            frozen[nfrozen++] = scan_pids[i];
            fresh = 1;
        }
        if (!fresh) break;
    }
    for (int k = 0; k < nfrozen; k++) kill(frozen[k], SIGKILL);
}

/*
 * Run mode's own syscall filter, installed in the command's process before exec (with
 * no_new_privs). On gVisor runsc applies no OCI seccomp profile to `runsc exec`
 * processes, and its Sentry lets `unshare(CLONE_NEWUSER)` hand out CAP_NET_RAW that
 * then opens raw and packet sockets. This closes that path on every tier: no new
 * namespaces (unshare, setns, clone with namespace flags; clone3 is ENOSYS so libc
 * falls back to clone), no AF_PACKET sockets, no SOCK_RAW IPv4/IPv6 sockets, no
 * non-x86_64 syscall ABI. Everything else is left to the tier's own policy.
 */
#define NS_CLONE_FLAGS 0x7E020000u  /* NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET */
#define ARG_LO(i) (offsetof(struct seccomp_data, args) + 8 * (i))  /* x86_64: low word first */
#define RET_ERRNO(e) BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (e))
#define LOAD(off) BPF_STMT(BPF_LD | BPF_W | BPF_ABS, (off))
#define IF_EQ(v, t, f) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (v), (t), (f))
static int install_run_filter(void)
{
    struct sock_filter f[] = {
        LOAD(offsetof(struct seccomp_data, arch)),
        IF_EQ(AUDIT_ARCH_X86_64, 1, 0),
        RET_ERRNO(EPERM),
        LOAD(offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1),  /* x32 ABI */
        RET_ERRNO(EPERM),
        IF_EQ(__NR_unshare, 0, 1),
        RET_ERRNO(EPERM),
        IF_EQ(__NR_setns, 0, 1),
        RET_ERRNO(EPERM),
        IF_EQ(__NR_clone3, 0, 1),
        RET_ERRNO(ENOSYS),
        IF_EQ(__NR_clone, 0, 3),
        LOAD(ARG_LO(0)),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, NS_CLONE_FLAGS, 0, 11),  /* no ns flag: allow */
        RET_ERRNO(EPERM),
        IF_EQ(__NR_socket, 0, 9),
        LOAD(ARG_LO(0)),
        IF_EQ(AF_PACKET, 0, 1),
        RET_ERRNO(EPERM),
        IF_EQ(AF_INET, 1, 0),
        IF_EQ(AF_INET6, 0, 4),
        LOAD(ARG_LO(1)),
        BPF_STMT(BPF_ALU | BPF_AND | BPF_K, 0xf),  /* the type without SOCK_NONBLOCK/CLOEXEC */
        IF_EQ(SOCK_RAW, 0, 1),
        RET_ERRNO(EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = { .len = (unsigned short)(sizeof f / sizeof f[0]), .filter = f };
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

static int make_sigfd(const int *sigs, int n)
{
    sigset_t set;
    sigemptyset(&set);
    for (int i = 0; i < n; i++) sigaddset(&set, sigs[i]);
    sigprocmask(SIG_BLOCK, &set, NULL);
    return signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
}

/*
 * Start a child that runs fn(arg) -- which must execve or _exit -- on our memory until
 * then: clone(CLONE_VM | CLONE_VFORK), what posix_spawn does. A plain fork copies the
 * address space; on gVisor's ptrace platform that is a new stub process plus a fault
 * per page either side touches afterwards, ~3x the cost of the execve itself (docs/
 * exec-agent.md, "gVisor tier"). We stay suspended until the child has exec'd or exited,
 * so it may read our data and uses a stack of its own. No CLONE_FILES/FS/SIGHAND/THREAD:
 * its fds, cwd, signal dispositions, mask, session and seccomp filter are its own. Safe
 * because no process of ours installs a signal handler that could run on that stack.
 */
static char spawn_stack[256 * 1024] __attribute__((aligned(64)));
static pid_t spawn_child(int (*fn)(void *), void *arg)
{
    return clone(fn, spawn_stack + sizeof spawn_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, arg);
}

/* ------------------------------------------------------------ exec handler */

static unsigned char outbuf[OUTBUF];
static size_t outlen;
static unsigned char inbuf[INBUF];
static size_t inlen;

static const char *parse_request(unsigned char *p, uint32_t len, struct request *rq);
static int exec_filter;   /* serve --filter: commands start under install_run_filter (gVisor tier) */
static int no_subreaper;  /* PR_SET_CHILD_SUBREAPER refused (gVisor): orphans escape to PID 1 */

/* Cancel/timeout kill of one exec's tree. Without subreaper status, orphans re-parent to
   PID 1 where kill_tree cannot see them: freeze the /proc tree below us first (run mode's
   way), so setsid daemons cannot outlive the exec on gVisor either. */
static void handler_kill(pid_t child, int *status, int *done, int sigfd)
{
    if (no_subreaper) freeze_and_kill_descendants();
    kill_tree(child, child, status, done, sigfd);
}

/* Read exactly n bytes from the non-blocking conn within timeout_ms; 0 ok, -1 EOF/error/late. */
static int conn_read_exact(int conn, unsigned char *buf, size_t n, int timeout_ms)
{
    int64_t until = now_ms(CLOCK_MONOTONIC) + timeout_ms;
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(conn, buf + got, n - got, 0);
        if (r > 0) { got += (size_t)r; continue; }
        if (r == 0) return -1;
        if (errno == EINTR) continue;
        if (errno != EAGAIN) return -1;
        int64_t left = until - now_ms(CLOCK_MONOTONIC);
        struct pollfd pf = { conn, POLLIN, 0 };
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0) return -1;
    }
    return 0;
}

/* The foreground command's side of spawn_child: stdio pipes, own session, filter, exec. */
struct fg_spawn { struct request *rq; int stdio[3]; };
static int fg_child(void *arg)
{
    struct fg_spawn *sp = arg;
    reset_signals();
    setsid();
    for (int i = 0; i < 3; i++) dup2(sp->stdio[i], i);
    if (exec_filter && install_run_filter() < 0) {  /* fail closed */
        dprintf(2, "dsec-init: cannot install the exec syscall filter: %s\n", strerror(errno));
        _exit(125);
    }
    exec_command(sp->rq->argv, sp->rq->envp, sp->rq->cwd, 2);
    return 127;  /* not reached */
}

/*
 * One foreground exec on conn. Returns 1 when the host asked for keep-alive (flags bit 1)
 * and the connection can carry the next request: the exit frame was delivered, stdin is
 * closed and nothing of this exec is left running under us, so no later output or later
 * tree-kill can ever mix with another exec's. Cancel and broken-connection paths _exit.
 */
static int handler_exec(int conn, struct request *rq, int sigfd)
{
    int po[2], pe[2], pi[2];
    outlen = 0;
    inlen = 0;
    if (pipe2(po, O_CLOEXEC) || pipe2(pe, O_CLOEXEC) || pipe2(pi, O_CLOEXEC)) {
        send_failure(conn, F_RESOURCE, "cannot create pipes: %s", strerror(errno));
        _exit(1);
    }
    struct fg_spawn fs = { rq, { pi[0], po[1], pe[1] } };
    pid_t child = spawn_child(fg_child, &fs);
    if (child < 0) {
        send_failure(conn, F_RESOURCE, "fork failed: %s", strerror(errno));
        _exit(1);
    }
    close(po[1]); close(pe[1]); close(pi[0]);
    int stdin_on = rq->flags & 1, keep = (rq->flags & 2) != 0, reuse = 0;
    int in_w = pi[1];
    if (!stdin_on) { close(in_w); in_w = -1; }
    else fcntl(in_w, F_SETFL, O_NONBLOCK);
    int pipes[2] = { po[0], pe[0] };
    long budget[2] = { -1, -1 };  /* bytes left to read after the child exited */
    for (int i = 0; i < 2; i++) fcntl(pipes[i], F_SETFL, O_NONBLOCK);

    unsigned char sp[4];
    put_u32(sp, (uint32_t)child);
    memcpy(outbuf, "\0\0\0\5S", 5);
    memcpy(outbuf + 5, sp, 4);
    outlen = 9;

    int64_t deadline = rq->timeout_ms ? now_ms(CLOCK_MONOTONIC) + rq->timeout_ms : 0;
    int done = 0, status = 0, timed_out = 0, x_queued = 0, stdin_eof = 0;
    size_t cur_off = 0;  /* bytes of the head 'I' frame already written to stdin */

    for (;;) {
        if (done && pipes[0] < 0 && pipes[1] < 0 && !x_queued) {
            if (keep) {
                /* a job the command left behind is ours (subreaper): a later exec's tree-kill
                   would reach it, so this connection ends here and the job goes to PID 1.
                   ECHILD = no child left at all; asked of wait4, not /proc (gVisor has no
                   /proc/thread-self/children: that was a /proc scan per exec there) */
                pid_t p;
                while ((p = waitpid(-1, NULL, WNOHANG | __WALL)) > 0) {}
                reuse = p < 0 && errno == ECHILD;
            }
            unsigned char x[11];
            put_u32(x, keep ? 7 : 6); x[4] = 'X';
            put_u32(x + 5, (uint32_t)status_to_code(status));
            x[9] = (unsigned char)timed_out;
            x[10] = (unsigned char)reuse;  /* only sent when the host asked for keep-alive */
            memcpy(outbuf + outlen, x, keep ? 11 : 10);  /* room: reading stops while OUTBUF is near full */
            outlen += keep ? 11 : 10;
            x_queued = 1;
        }
        if (x_queued && outlen == 0) break;

        struct pollfd pf[5];
        int np = 0, ic = -1, ip[2] = { -1, -1 }, is;
        int want_in = stdin_on && !stdin_eof && inlen < INBUF;
        /* POLLIN even without stdin: gVisor's host-backed sockets report a peer close as
           readable EOF only (no POLLRDHUP), and the close is the cancel signal */
        int watch_in = want_in || !stdin_on || stdin_eof;
        pf[np] = (struct pollfd){ conn, (short)(POLLRDHUP | (watch_in ? POLLIN : 0) | (outlen ? POLLOUT : 0)), 0 };
        ic = np++;
        for (int i = 0; i < 2; i++)
            if (pipes[i] >= 0 && OUTBUF - outlen >= CHUNK + 5 + 11) {
                pf[np] = (struct pollfd){ pipes[i], POLLIN, 0 };
                ip[i] = np++;
            }
        if (in_w >= 0 && inlen >= 5 && inbuf[4] == 'I') {
            pf[np++] = (struct pollfd){ in_w, POLLOUT, 0 };  /* wakes the stdin writer below */
        }
        pf[np] = (struct pollfd){ sigfd, POLLIN, 0 };
        is = np++;
        int tmo = -1;
        if (deadline && !done) {
            int64_t left = deadline - now_ms(CLOCK_MONOTONIC);
            tmo = left < 0 ? 0 : (int)left;
        }
        /* after exit, pipes with a finite budget are drained without waiting on poll */
        for (int i = 0; i < 2; i++) if (done && pipes[i] >= 0 && ip[i] >= 0) tmo = 0;
        int r = poll(pf, (nfds_t)np, tmo);
        if (r < 0 && errno != EINTR) _exit(1);
        if (r < 0) continue;

        if (deadline && !done && now_ms(CLOCK_MONOTONIC) >= deadline) {
            handler_kill(child, &status, &done, sigfd);
            timed_out = 1;
        }
        if (pf[ic].revents & (POLLHUP | POLLERR | POLLRDHUP)) {
            /* host went away (or cancelled): the command must not outlive its exec */
            handler_kill(child, &status, &done, sigfd);
            _exit(0);
        }
        if (pf[ic].revents & POLLOUT && outlen) {
            ssize_t n = send(conn, outbuf, outlen, MSG_NOSIGNAL);
            if (n > 0) { memmove(outbuf, outbuf + n, outlen - (size_t)n); outlen -= (size_t)n; }
            else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                handler_kill(child, &status, &done, sigfd);
                _exit(0);
            }
        }
        if (pf[ic].revents & POLLIN && want_in) {
            ssize_t n = recv(conn, inbuf + inlen, INBUF - inlen, 0);
            if (n == 0) { handler_kill(child, &status, &done, sigfd); _exit(0); }
            if (n > 0) inlen += (size_t)n;
        } else if (pf[ic].revents & POLLIN) {
            /* nothing may arrive now (no stdin, or after its 'i'): EOF = cancel, data = junk */
            unsigned char b;
            ssize_t n = recv(conn, &b, 1, MSG_PEEK);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
                handler_kill(child, &status, &done, sigfd);
                _exit(0);
            }
            if (n > 0) {
                handler_kill(child, &status, &done, sigfd);
                send_failure(conn, F_BAD_REQUEST, "unexpected data from the host during an exec");
                _exit(0);
            }
        }
        /* stdin frames: 'I' data goes to the pipe, 'i' closes it; junk ends the exec */
        while (inlen >= 5 && !stdin_eof) {
            uint32_t flen = get_u32(inbuf);
            if (flen < 1 || flen > CHUNK + 1 || (inbuf[4] != 'I' && inbuf[4] != 'i')) {
                handler_kill(child, &status, &done, sigfd);
                send_failure(conn, F_BAD_REQUEST, "bad stdin frame (type %d, length %u)", inbuf[4], flen);
                _exit(0);
            }
            if (inlen < 4 + flen) break;
            if (inbuf[4] == 'i') {
                if (in_w >= 0) { close(in_w); in_w = -1; }
                stdin_eof = 1;
            } else if (in_w >= 0) {
                size_t dlen = flen - 1;
                if (cur_off < dlen) {
                    ssize_t n = write(in_w, inbuf + 5 + cur_off, dlen - cur_off);
                    if (n > 0) cur_off += (size_t)n;
                    else if (n < 0 && errno == EAGAIN) break;
                    else if (n < 0 && errno != EINTR) { close(in_w); in_w = -1; }  /* EPIPE: discard */
                    if (in_w >= 0 && cur_off < dlen) break;
                }
            }
            cur_off = 0;
            memmove(inbuf, inbuf + 4 + flen, inlen - 4 - flen);
            inlen -= 4 + flen;
        }
        if (pf[is].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sigfd, &si, sizeof si) > 0) {}
        }
        if (!done) {
            int st;
            pid_t p;
            while ((p = waitpid(-1, &st, WNOHANG)) > 0)
                if (p == child) { status = st; done = 1; }
            if (done) {
                /* only what the command wrote before it died; lingering daemons keep running */
                for (int i = 0; i < 2; i++) {
                    int avail = 0;
                    if (pipes[i] >= 0 && ioctl(pipes[i], FIONREAD, &avail) == 0) budget[i] = avail;
                    else budget[i] = 0;
                }
            }
        } else {
            while (waitpid(-1, NULL, WNOHANG) > 0) {}
        }
        for (int i = 0; i < 2; i++) {
            if (pipes[i] < 0 || ip[i] < 0) continue;
            if (!(pf[ip[i]].revents & (POLLIN | POLLHUP)) && !done) continue;
            size_t want = CHUNK;
            if (budget[i] >= 0 && (size_t)budget[i] < want) want = (size_t)budget[i];
            ssize_t n = want ? read(pipes[i], outbuf + outlen + 5, want) : 0;
            if (n > 0) {
                put_u32(outbuf + outlen, (uint32_t)n + 1);
                outbuf[outlen + 4] = i == 0 ? 'O' : 'E';
                outlen += 5 + (size_t)n;
                if (budget[i] >= 0) budget[i] -= n;
            }
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR) ||
                (n < 0 && errno == EAGAIN && done) || budget[i] == 0) {
                close(pipes[i]);
                pipes[i] = -1;
            }
        }
    }
    if (in_w >= 0) close(in_w);
    if (reuse) {
        /* the host finishes stdin it had started ('I'... then 'i') before its next request:
           drain those frames exactly, never reading a byte of the next request */
        while (!stdin_eof && stdin_on) {
            if (inlen < 5 && conn_read_exact(conn, inbuf + inlen, 5 - inlen, LINGER_MS) < 0) _exit(0);
            if (inlen < 5) inlen = 5;
            uint32_t flen = get_u32(inbuf);
            if (flen < 1 || flen > CHUNK + 1 || (inbuf[4] != 'I' && inbuf[4] != 'i')) _exit(0);
            if (inlen < 4 + flen && conn_read_exact(conn, inbuf + inlen, 4 + flen - inlen, LINGER_MS) < 0) _exit(0);
            if (inlen > 4 + flen) _exit(0);  /* bytes past the frame: the host pipelined, not allowed */
            stdin_eof = inbuf[4] == 'i';
            inlen = 0;
        }
        if (inlen) _exit(0);  /* bytes after 'i' before our exit frame: the host pipelined */
        return 1;
    }
    /* Unread stdin on close would reset the host's read of 'X': let the host close first. */
    if (stdin_on && !stdin_eof) {
        shutdown(conn, SHUT_WR);
        int64_t until = now_ms(CLOCK_MONOTONIC) + LINGER_MS;
        for (;;) {
            int64_t left = until - now_ms(CLOCK_MONOTONIC);
            struct pollfd pf = { conn, POLLIN, 0 };
            if (left <= 0 || poll(&pf, 1, (int)left) <= 0) break;
            if (recv(conn, inbuf, INBUF, 0) <= 0) break;
        }
    }
    return 0;
}

/*
 * A connection's handler, forked from PID 1 with its first request. With keep-alive the
 * same process then serves further 'E' requests on the connection one after another
 * (saves the connect, accept and handler fork per exec); concurrency comes from more
 * connections. An idle connection ends after KEEPALIVE_IDLE_MS or when the host closes it.
 */
static void handler_main(int conn, struct request *rq)
{
    static unsigned char *reqbuf;
    if (conn > 3) close_range(3, (unsigned)conn - 1, 0);
    close_range((unsigned)conn + 1, ~0U, 0);
    if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0) no_subreaper = 1;
    signal(SIGPIPE, SIG_IGN);
    int sigs[] = { SIGCHLD };
    int sigfd = make_sigfd(sigs, 1);
    int fl = fcntl(conn, F_GETFL);
    fcntl(conn, F_SETFL, fl | O_NONBLOCK);
    if (sigfd < 0) {
        send_failure(conn, F_RESOURCE, "cannot create a signalfd: %s", strerror(errno));
        _exit(1);
    }
    while (handler_exec(conn, rq, sigfd)) {
        unsigned char hdr[5];
        if (conn_read_exact(conn, hdr, 5, KEEPALIVE_IDLE_MS) < 0) _exit(0);
        uint32_t flen = get_u32(hdr);
        if (hdr[4] != 'R' || flen < 2 || flen > MAX_REQUEST) {
            send_failure(conn, F_BAD_REQUEST, "expected a request frame of at most %u bytes", MAX_REQUEST);
            _exit(0);
        }
        free(reqbuf);
        reqbuf = malloc(flen - 1);
        if (!reqbuf) { send_failure(conn, F_RESOURCE, "out of memory"); _exit(1); }
        if (conn_read_exact(conn, reqbuf, flen - 1, REQUEST_READ_MS) < 0) _exit(0);
        static struct request next;
        const char *err = parse_request(reqbuf, flen - 1, &next);
        if (!err && next.op != 'E') err = "only exec requests can follow on a kept-alive connection";
        if (err) { send_failure(conn, F_BAD_REQUEST, "bad request: %s", err); _exit(0); }
        rq = &next;
    }
    _exit(0);
}

/* -------------------------------------------------------- background table */

struct bg {
    pid_t pid;
    int running, code;
    int64_t start_ms;
    uint16_t argv_len;
    char argv[BG_ARGV_KEEP];
};
static struct bg bgtab[MAX_BG];
static int nbg;

static struct bg *bg_find(pid_t pid)
{
    for (int i = 0; i < nbg; i++) if (bgtab[i].pid == pid) return &bgtab[i];
    return NULL;
}

static struct bg *bg_alloc(void)
{
    if (nbg < MAX_BG) return &bgtab[nbg++];
    int oldest = -1;
    for (int i = 0; i < nbg; i++)
        if (!bgtab[i].running && (oldest < 0 || bgtab[i].start_ms < bgtab[oldest].start_ms)) oldest = i;
    return oldest < 0 ? NULL : &bgtab[oldest];
}

/* Every descendant of root (by a /proc ppid walk), so a kill reaches setsid'd children. */
static int descendants(pid_t root, pid_t *out, int max)
{
    int n = scan_proc(scan_pids, scan_ppids, 8192), m = 0;
    out[m++] = root;
    for (int k = 0; k < m && m < max; k++)
        for (int i = 0; i < n && m < max; i++)
            if (scan_ppids[i] == out[k]) out[m++] = scan_pids[i];
    return m;
}

/* ---------------------------------------------------------- request parsing */

static const char *parse_request(unsigned char *p, uint32_t len, struct request *rq)
{
    static char *strs[MAX_STRINGS + 2];
    unsigned char *end = p + len;
    memset(rq, 0, sizeof *rq);
    if (len < 2) return "request too short";
    if (p[0] != PROTO_VERSION) return "unsupported protocol version";
    rq->op = p[1];
    p += 2;
    if (rq->op == 'H' || rq->op == 'P' || rq->op == 'C') return NULL;
    if (rq->op == 'K') {
        if (end - p < 8) return "kill request too short";
        rq->pid = get_u32(p);
        rq->sig = (int32_t)get_u32(p + 4);
        if (rq->sig < 0 || rq->sig >= NSIG) return "signal number out of range";
        return NULL;
    }
    if (rq->op != 'E' && rq->op != 'B') return "unknown operation";
    if (end - p < 13) return "exec request too short";
    rq->timeout_ms = get_u32(p);
    rq->argc = get_u32(p + 4);
    rq->envc = get_u32(p + 8);
    rq->flags = p[12];
    p += 13;
    if (rq->argc < 1) return "argv is empty";
    if ((uint64_t)rq->argc + rq->envc > MAX_STRINGS) return "too many argv/env strings";
    uint32_t want = 1 + rq->argc + rq->envc + (rq->op == 'B');
    uint32_t got = 0;
    /* strings are NUL-terminated back to back: cwd, argv..., env..., [outpath] */
    while (got < want) {
        unsigned char *z = memchr(p, 0, (size_t)(end - p));
        if (!z) return "truncated string list";
        strs[got++] = (char *)p;
        p = z + 1;
    }
    if (p != end) return "trailing bytes after string list";
    rq->cwd = strs[0];
    rq->argv = &strs[1];
    rq->envp = &strs[1 + rq->argc + 1];
    /* argv and envp need NULL terminators: shift env up by one slot to make room */
    memmove(&strs[rq->argc + 2], &strs[rq->argc + 1], sizeof(char *) * (rq->envc + (rq->op == 'B')));
    strs[rq->argc + 1] = NULL;
    if (rq->op == 'B') rq->outpath = strs[rq->argc + 2 + rq->envc];
    strs[rq->argc + 2 + rq->envc] = NULL;
    if (rq->argv[0][0] == 0) return "argv[0] is empty";
    for (uint32_t i = 0; i < rq->envc; i++)
        if (!strchr(rq->envp[i], '=')) return "environment entry without '='";
    return NULL;
}

/* --------------------------------------------------------------- PID-1 loop */

struct pending {
    int fd;
    unsigned char hdr[5];
    uint32_t hdr_got, len, got;
    unsigned char *buf;
    int64_t deadline;
    int authed;        /* the token frame was seen (always 1 without --token-file) */
    pid_t bg_pid;      /* background spawn awaiting its exec result */
    int errfd;         /* CLOEXEC pipe: EOF = exec succeeded, data = failure text */
};
static struct pending pend[MAX_PENDING];
static int npend;

static void pend_close(int i)
{
    close(pend[i].fd);
    if (pend[i].errfd >= 0) close(pend[i].errfd);
    free(pend[i].buf);
    pend[i] = pend[--npend];
}

static void send_ps(int fd)
{
    size_t cap = 5 + 4 + (size_t)nbg * (4 + 1 + 4 + 8 + 2 + BG_ARGV_KEEP);
    unsigned char *b = malloc(cap), *p;
    if (!b) { send_failure(fd, F_RESOURCE, "out of memory"); return; }
    p = b + 5;
    put_u32(p, (uint32_t)nbg); p += 4;
    for (int i = 0; i < nbg; i++) {
        struct bg *e = &bgtab[i];
        put_u32(p, (uint32_t)e->pid); p[4] = (unsigned char)e->running;
        put_u32(p + 5, (uint32_t)e->code);
        put_u32(p + 9, (uint32_t)((uint64_t)e->start_ms >> 32));
        put_u32(p + 13, (uint32_t)e->start_ms);
        p[17] = (unsigned char)(e->argv_len >> 8); p[18] = (unsigned char)e->argv_len;
        memcpy(p + 19, e->argv, e->argv_len);
        p += 19 + e->argv_len;
    }
    put_u32(b, (uint32_t)(p - b - 4));
    b[4] = 'L';
    send_all(fd, b, (size_t)(p - b));
    free(b);
}

/* A background command's side of spawn_child: failures before and during execve go to
   the CLOEXEC error pipe errfd (EOF = success). */
struct bg_spawn { struct request *rq; int errfd; };
static int bg_child(void *arg)
{
    struct bg_spawn *bs = arg;
    struct request *rq = bs->rq;
    reset_signals();
    setsid();
    int nul = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (nul >= 0) dup2(nul, 0); else close(0);
    if (rq->cwd[0] && chdir(rq->cwd) < 0) {
        dprintf(bs->errfd, "dsec-init: cannot change directory to '%s': %s\n", rq->cwd, strerror(errno));
        _exit(126);
    }
    const char *op = rq->outpath[0] ? rq->outpath : "/dev/null";
    int out = open(op, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (out < 0) {
        dprintf(bs->errfd, "dsec-init: cannot open output file '%s': %s\n", op, strerror(errno));
        _exit(126);
    }
    dup2(out, 1);
    dup2(out, 2);
    if (exec_filter && install_run_filter() < 0) {  /* fail closed */
        dprintf(bs->errfd, "dsec-init: cannot install the exec syscall filter: %s\n", strerror(errno));
        _exit(125);
    }
    exec_command(rq->argv, rq->envp, NULL, bs->errfd);
    return 127;  /* not reached */
}

/* Returns 1 when the pending entry stays open (background spawn in flight). */
static int dispatch(int i)
{
    struct pending *pd = &pend[i];
    struct request rq;
    if (pd->hdr[4] != 'R') { send_failure(pd->fd, F_BAD_REQUEST, "expected a request frame"); return 0; }
    const char *err = parse_request(pd->buf, pd->len, &rq);
    if (err) { send_failure(pd->fd, F_BAD_REQUEST, "bad request: %s", err); return 0; }
    if (rq.op == 'H') {
        char b[64];
        b[0] = PROTO_VERSION;
        int n = snprintf(b + 1, sizeof b - 1, "%s", AGENT_IDENT);
        send_frame(pd->fd, 'H', b, (uint32_t)n + 1);
        return 0;
    }
    if (rq.op == 'C') {
        /* Forget the background table (recycling a sandbox for another tenant: its `ps`
           must not list the previous tenant's commands). The host killed them first. */
        unsigned char b[4];
        put_u32(b, (uint32_t)nbg);
        nbg = 0;
        send_frame(pd->fd, 'C', b, 4);
        return 0;
    }
    if (rq.op == 'K') {
        struct bg *e = bg_find((pid_t)rq.pid);
        if (!e || rq.pid <= 1) {
            send_failure(pd->fd, F_NOT_FOUND, "no background process with pid %u", rq.pid);
            return 0;
        }
        if (e->running) {
            static pid_t tree[4096];
            int n = descendants(e->pid, tree, 4096);
            kill(-e->pid, rq.sig);
            for (int k = 0; k < n; k++) kill(tree[k], rq.sig);
        }
        send_frame(pd->fd, 'K', NULL, 0);
        return 0;
    }
    if (rq.op == 'E' || rq.op == 'P') {
        pid_t h = fork();
        if (h < 0) { send_failure(pd->fd, F_RESOURCE, "fork failed: %s", strerror(errno)); return 0; }
        if (h == 0) {
            if (rq.op == 'E') handler_main(pd->fd, &rq);
            if (pd->fd > 3) close_range(3, (unsigned)pd->fd - 1, 0);
            close_range((unsigned)pd->fd + 1, ~0U, 0);
            fcntl(pd->fd, F_SETFL, fcntl(pd->fd, F_GETFL) & ~O_NONBLOCK);
            send_ps(pd->fd);
            _exit(0);
        }
        return 0;
    }
    /* 'B': PID 1 forks it so the table sees its exit status */
    struct bg *e = bg_alloc();
    if (!e) { send_failure(pd->fd, F_RESOURCE, "too many background processes (%d running)", MAX_BG); return 0; }
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) < 0) { send_failure(pd->fd, F_RESOURCE, "pipe: %s", strerror(errno)); return 0; }
    struct bg_spawn bs = { &rq, ep[1] };
    pid_t c = spawn_child(bg_child, &bs);
    if (c < 0) {
        close(ep[0]); close(ep[1]);
        send_failure(pd->fd, F_RESOURCE, "fork failed: %s", strerror(errno));
        return 0;
    }
    close(ep[1]);
    fcntl(ep[0], F_SETFL, O_NONBLOCK);
    memset(e, 0, sizeof *e);
    e->pid = c;
    e->running = 1;
    e->start_ms = now_ms(CLOCK_REALTIME);
    size_t off = 0;
    for (uint32_t k = 0; k < rq.argc; k++) {
        size_t l = strlen(rq.argv[k]) + 1;
        if (off + l > BG_ARGV_KEEP) break;
        memcpy(e->argv + off, rq.argv[k], l);
        off += l;
    }
    e->argv_len = (uint16_t)off;
    pd->bg_pid = c;
    pd->errfd = ep[0];
    pd->deadline = now_ms(CLOCK_MONOTONIC) + REQUEST_READ_MS;
    return 1;
}

/* serve --token-file: connections must open with an 'A' frame carrying this token. */
static unsigned char token[64];
static size_t token_len;

static int read_token(const char *path)
{
    /* read once, then empty the file: only PID 1 ever knows it (no sandbox code ran yet) */
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, token, sizeof token);
    int ok = n >= 16 && ftruncate(fd, 0) == 0;
    close(fd);
    if (!ok) return -1;
    token_len = (size_t)n;
    return 0;
}

static int token_ok(const unsigned char *p, uint32_t len)
{
    unsigned char diff = (unsigned char)(len != token_len);
    for (size_t i = 0; i < token_len; i++) diff |= (unsigned char)((i < len ? p[i] : 0) ^ token[i]);
    return diff == 0;
}

/* Read what has arrived of a pending request; dispatch it once complete. */
static void pend_read(int i)
{
    struct pending *pd = &pend[i];
    for (;;) {
        ssize_t n;
        if (pd->hdr_got < 5) {
            n = recv(pd->fd, pd->hdr + pd->hdr_got, 5 - pd->hdr_got, 0);
            if (n > 0) {
                pd->hdr_got += (uint32_t)n;
                if (pd->hdr_got == 5) {
                    uint32_t flen = get_u32(pd->hdr);
                    if (flen < 2 || flen > MAX_REQUEST) {
                        send_failure(pd->fd, F_BAD_REQUEST, "request frame of %u bytes (limit %u)", flen, MAX_REQUEST);
                        pend_close(i);
                        return;
                    }
                    pd->len = flen - 1;
                    pd->buf = malloc(pd->len);
                    if (!pd->buf) { send_failure(pd->fd, F_RESOURCE, "out of memory"); pend_close(i); return; }
                }
                continue;
            }
        } else {
            n = recv(pd->fd, pd->buf + pd->got, pd->len - pd->got, 0);
            if (n > 0) pd->got += (uint32_t)n;
        }
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) { pend_close(i); return; }
        if (n < 0 && errno == EAGAIN) return;
        if (pd->hdr_got == 5 && pd->got == pd->len) {
            if (!pd->authed) {  /* the first frame must be the token; anything else: silence */
                if (pd->hdr[4] != 'A' || !token_ok(pd->buf, pd->len)) { pend_close(i); return; }
                pd->authed = 1;
                free(pd->buf);
                pd->buf = NULL;
                pd->hdr_got = pd->got = pd->len = 0;
                continue;
            }
            if (!dispatch(i)) pend_close(i);
            return;
        }
    }
}

/* The exec result of a background spawn: EOF on the CLOEXEC pipe means execve worked. */
static void pend_bg_result(int i, int expired)
{
    struct pending *pd = &pend[i];
    char msg[512];
    ssize_t n = expired ? -1 : read(pd->errfd, msg, sizeof msg - 1);
    if (n < 0 && errno == EAGAIN && !expired) return;
    if (n > 0) {
        while (n > 0 && msg[n - 1] == '\n') n--;
        msg[n] = 0;
        struct bg *e = bg_find(pd->bg_pid);
        if (e) *e = bgtab[--nbg];  /* never started: not a background process */
        send_failure(pd->fd, F_EXEC, "%s", msg);
    } else {
        unsigned char b[4];
        put_u32(b, (uint32_t)pd->bg_pid);
        send_frame(pd->fd, 'S', b, 4);
    }
    pend_close(i);
}

static void reap_all(void)
{
    int st;
    pid_t p;
    while ((p = waitpid(-1, &st, WNOHANG)) > 0) {
        struct bg *e = bg_find(p);
        if (e && e->running) { e->running = 0; e->code = status_to_code(st); }
    }
}

static int is_listening(int fd)
{
    int v = 0;
    socklen_t l = sizeof v;
    return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &l) == 0 && v;
}

static void serve(int lfd, int listening)
{
    /* non-dumpable: without CAP_SYS_PTRACE nobody can ptrace us or open /proc/1/fd entries */
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    int sigs[] = { SIGCHLD };
    int sigfd = make_sigfd(sigs, 1);
    if (sigfd < 0) { logmsg("signalfd: %s", strerror(errno)); _exit(1); }
    if (lfd < 0 || (!listening && !is_listening(lfd))) {  /* gVisor lacks SO_ACCEPTCONN on host sockets */
        logmsg("fd %d is not a listening socket: running as a plain init (no exec agent)", lfd);
        lfd = -1;
    } else {
        fcntl(lfd, F_SETFD, FD_CLOEXEC);
        fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK);
    }
    struct pollfd pf[MAX_PENDING + 2];
    for (;;) {
        int np = 0, il = -1;
        if (lfd >= 0 && npend < MAX_PENDING) { pf[np] = (struct pollfd){ lfd, POLLIN, 0 }; il = np++; }
        pf[np++] = (struct pollfd){ sigfd, POLLIN, 0 };
        int base = np;
        int64_t now = now_ms(CLOCK_MONOTONIC), next = -1;
        for (int i = 0; i < npend; i++) {
            pf[np++] = (struct pollfd){ pend[i].errfd >= 0 ? pend[i].errfd : pend[i].fd, POLLIN, 0 };
            if (next < 0 || pend[i].deadline < next) next = pend[i].deadline;
        }
        int tmo = next < 0 ? -1 : (next > now ? (int)(next - now) : 0);
        int r = poll(pf, (nfds_t)np, tmo);
        if (r < 0) continue;
        if (pf[base - 1].revents) {
            struct signalfd_siginfo si;
            while (read(sigfd, &si, sizeof si) > 0) {}
            reap_all();
        }
        now = now_ms(CLOCK_MONOTONIC);
        for (int i = npend - 1; i >= 0; i--) {
            int expired = pend[i].deadline <= now;
            if (pend[i].errfd >= 0) {
                if (pf[base + i].revents || expired) pend_bg_result(i, expired && !pf[base + i].revents);
            } else if (pf[base + i].revents) {
                pend_read(i);
            } else if (expired) {
                send_failure(pend[i].fd, F_BAD_REQUEST, "request not received within %d ms", REQUEST_READ_MS);
                pend_close(i);
            }
        }
        if (il >= 0 && pf[il].revents) {
            while (npend < MAX_PENDING) {
                int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (c < 0) break;
                pend[npend] = (struct pending){ .fd = c, .errfd = -1, .authed = token_len == 0,
                                                .deadline = now_ms(CLOCK_MONOTONIC) + REQUEST_READ_MS };
                npend++;
                pend_read(npend - 1);  /* the request usually is already there */
            }
        }
    }
}

/* ---------------------------------------------------------------- run mode */

/* run mode's command side of spawn_child: own session, the filter always, exec. */
struct run_spawn { char **argv; const char *cwd; };
static int run_child(void *arg)
{
    extern char **environ;
    struct run_spawn *rs = arg;
    reset_signals();
    setsid();
    if (install_run_filter() < 0) {  /* fail closed: never run the command unfiltered */
        dprintf(2, "dsec-init: cannot install the exec syscall filter: %s\n", strerror(errno));
        _exit(125);
    }
    exec_command(rs->argv, environ, rs->cwd, 2);
    return 127;  /* not reached */
}

static int run_main(int argc, char **argv)
{
    long timeout_ms = 0;
    const char *cwd = NULL;
    int i = 0;
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) { i++; break; }
        if (strcmp(argv[i], "--timeout-ms") == 0 && i + 1 < argc) {
            char *end;
            timeout_ms = strtol(argv[++i], &end, 10);
            if (*end || timeout_ms < 0) { logmsg("run: bad --timeout-ms '%s'", argv[i]); return 125; }
        } else if (strcmp(argv[i], "--cwd") == 0 && i + 1 < argc) {
            cwd = argv[++i];
        } else {
            logmsg("run: unknown option '%s'; usage: run [--timeout-ms N] [--cwd DIR] -- argv...", argv[i]);
            return 125;
        }
    }
    if (i >= argc) { logmsg("run: no command given"); return 125; }
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    int sigs[] = { SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT };
    int sigfd = make_sigfd(sigs, 5);
    if (sigfd < 0) { logmsg("signalfd: %s", strerror(errno)); return 125; }
    struct run_spawn rs = { argv + i, cwd };
    pid_t child = spawn_child(run_child, &rs);
    if (child < 0) { logmsg("fork: %s", strerror(errno)); return 125; }
    int64_t deadline = timeout_ms ? now_ms(CLOCK_MONOTONIC) + timeout_ms : 0;
    int status = 0, done = 0;
    for (;;) {
        int tmo = -1;
        if (deadline) {
            int64_t left = deadline - now_ms(CLOCK_MONOTONIC);
            tmo = left < 0 ? 0 : (int)left;
        }
        struct pollfd pf = { sigfd, POLLIN, 0 };
        int r = poll(&pf, 1, tmo);
        if (r < 0) continue;
        struct signalfd_siginfo si;
        while (read(sigfd, &si, sizeof si) == (ssize_t)sizeof si) {
            if (si.ssi_signo != SIGCHLD) {
                /* the caller cancelled us: the command tree goes with us */
                freeze_and_kill_descendants();
                kill_tree(child, child, &status, &done, sigfd);
                return 128 + (int)si.ssi_signo;
            }
        }
        pid_t p;
        int st;
        while ((p = waitpid(-1, &st, WNOHANG)) > 0)
            if (p == child) return status_to_code(st);
        if (deadline && now_ms(CLOCK_MONOTONIC) >= deadline) {
            freeze_and_kill_descendants();
            kill_tree(child, child, &status, &done, sigfd);
            dprintf(2, "\ndsec-init: timeout: command exceeded %ld ms; process tree killed\n", timeout_ms);
            return 124;
        }
    }
}

/*
 * serve --listen NAME --token-file F (gVisor tier): runsc cannot hand us a listening fd
 * and a host UDS would change how every socket in the sandbox's files behaves
 * (--host-uds), so PID 1 listens on the abstract name @NAME inside the sandbox, taken
 * before any sandbox code runs (nobody else can bind it later). The node reaches it
 * through `runsc exec` of `dsec-init relay NAME`, one relay per kept-alive connection,
 * and opens each connection with an 'A' frame carrying the token PID 1 read (and
 * emptied) from F at start: sandbox code can connect too, but gets nothing.
 * Returns the listening fd, or -1 (plain init) when that fails.
 */
static socklen_t abstract_addr(struct sockaddr_un *a, const char *name)
{
    size_t n = strlen(name);
    if (n + 1 > sizeof a->sun_path) n = sizeof a->sun_path - 1;
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    memcpy(a->sun_path + 1, name, n);  /* leading NUL: the abstract namespace */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static int listen_at(const char *name)
{
    struct sockaddr_un a;
    socklen_t alen = abstract_addr(&a, name);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const char *step = fd < 0 ? "socket" : bind(fd, (struct sockaddr *)&a, alen) < 0 ? "bind"
                     : listen(fd, 4096) < 0 ? "listen" : NULL;
    if (step) {
        logmsg("cannot listen on @%s (%s): %s", name, step, strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

/* relay NAME: copy stdin -> @NAME and @NAME -> stdout until either side ends. */
static int relay_main(int argc, char **argv)
{
    if (argc < 1) { logmsg("relay: no socket name"); return 125; }
    prctl(PR_SET_DUMPABLE, 0);
    signal(SIGPIPE, SIG_IGN);
    struct sockaddr_un a;
    socklen_t alen = abstract_addr(&a, argv[0]);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    /* right after `runsc run` PID 1 may not listen yet: retry for up to 2 s */
    for (int tries = 0; s >= 0 && connect(s, (struct sockaddr *)&a, alen) < 0; tries++) {
        if ((errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN) || tries >= 400) {
            logmsg("relay: cannot connect to @%s: %s", argv[0], strerror(errno));
            return 125;
        }
        usleep(5000);
    }
    if (s < 0) { logmsg("relay: socket: %s", strerror(errno)); return 125; }
    static unsigned char buf[CHUNK];
    for (;;) {
        struct pollfd pf[2] = { { 0, POLLIN, 0 }, { s, POLLIN, 0 } };
        if (poll(pf, 2, -1) < 0) { if (errno == EINTR) continue; return 1; }
        for (int i = 0; i < 2; i++) {
            if (!pf[i].revents) continue;
            int from = i == 0 ? 0 : s, to = i == 0 ? s : 1;
            ssize_t n = read(from, buf, sizeof buf);
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            if (n <= 0) return 0;  /* either side ended: closing s cancels a running exec */
            for (ssize_t off = 0; off < n;) {  /* stdout may be a pipe: write, not send */
                ssize_t w = write(to, buf + off, (size_t)(n - off));
                if (w < 0 && errno == EINTR) continue;
                if (w <= 0) return 0;
                off += w;
            }
        }
    }
}

int main(int argc, char **argv)
{
    /* fds 0-2 must be taken so that no connection or pipe ever lands on them */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0) {
            int p[2];
            if (pipe(p) == 0 && p[1] > 2) close(p[1]);
        }
    reset_all_dispositions();
    if (argc >= 2 && strcmp(argv[1], "run") == 0) return run_main(argc - 2, argv + 2);
    if (argc >= 2 && strcmp(argv[1], "relay") == 0) return relay_main(argc - 2, argv + 2);
    int fd = 3;
    const char *listen_name = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "serve") == 0) continue;
        if (strcmp(argv[i], "--fd") == 0 && i + 1 < argc) { fd = atoi(argv[++i]); continue; }
        if (strcmp(argv[i], "--filter") == 0) { exec_filter = 1; continue; }
        if (strcmp(argv[i], "--listen") == 0 && i + 1 < argc) { listen_name = argv[++i]; continue; }
        if (strcmp(argv[i], "--token-file") == 0 && i + 1 < argc) {
            if (read_token(argv[++i]) < 0) {  /* fail closed: no agent rather than an open one */
                logmsg("cannot read the token file %s: %s", argv[i], strerror(errno));
                listen_name = NULL;
                fd = -1;
            }
            continue;
        }
        if (strcmp(argv[i], "--version") == 0) { printf("%s protocol %d\n", AGENT_IDENT, PROTO_VERSION); return 0; }
        logmsg("unknown argument '%s'; usage: dsec-init [serve] [--fd N | --listen NAME --token-file F] [--filter] | relay NAME | run [--timeout-ms N] [--cwd DIR] -- argv...", argv[i]);
        return 2;
    }
    if (listen_name && fd >= 0) fd = listen_at(listen_name);
    serve(fd, listen_name != NULL);
    return 0;
}
