/*
 * The sandbox seccomp profile, installed by dsec-init on itself (`--seccomp`, container
 * tier) before it serves anything: every process of the sandbox descends from PID 1 and
 * inherits the filter, as it inherits runc's. runc then compiles no profile per create
 * (libseccomp + its ENOSYS stub cost about a quarter of `runc run`'s CPU here).
 *
 * The decisions are those of dsec.runtime.seccomp.seccomp_profile() for x86_64, from the
 * generated header (dsec_profile.h: the allowed syscall numbers, resolved by the compiler,
 * and the argument rules):
 *   - allowed numbers: ALLOW; clone only without namespace flags; personality only with
 *     the listed values (the whole 64-bit argument, as libseccomp compares it);
 *   - clone3: ENOSYS (libc falls back to clone, whose flags seccomp can read);
 *   - a number above every number the profile names: ENOSYS (as runc's stub does), so
 *     libc's fallbacks for syscalls newer than the profile keep working. x32 numbers
 *     (bit 30 set) are among them: ENOSYS, what this kernel (no x32 ABI) answers today;
 *   - anything else: EPERM. The i386 ABI (int 0x80) is refused with EPERM (runc's
 *     filter let it through by name).
 */
#ifndef DSEC_SECCOMP_PROFILE_H
#define DSEC_SECCOMP_PROFILE_H

#define PROFILE_MAX_INSNS 1024
#define P_RET(v) BPF_STMT(BPF_RET | BPF_K, (v))
#define P_ERRNO(e) P_RET(SECCOMP_RET_ERRNO | ((e) & SECCOMP_RET_DATA))

struct profile_prog { struct sock_filter f[PROFILE_MAX_INSNS]; int n, overflow; };

static void pp_put(struct profile_prog *p, struct sock_filter insn)
{
    if (p->n >= PROFILE_MAX_INSNS) { p->overflow = 1; return; }
    p->f[p->n++] = insn;
}

static int profile_cmp(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Ranges [lo[i], hi[i]] of allowed numbers, sorted; A holds the syscall number.
   A binary tree of JGE tests; each leaf returns on its own, so no jump runs far
   (an unconditional JA, 32-bit offset, skips a left subtree of any size). */
static void pp_tree(struct profile_prog *p, const int *lo, const int *hi, int i, int j)
{
    if (j - i == 1) {
        pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, (unsigned)lo[i], 0, 2));
        pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, (unsigned)hi[i], 1, 0));
        pp_put(p, (struct sock_filter)P_RET(SECCOMP_RET_ALLOW));
        pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_DEFAULT_ERRNO));
        return;
    }
    int m = (i + j) / 2;
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, (unsigned)lo[m], 0, 1));
    int ja = p->n;
    pp_put(p, (struct sock_filter)BPF_STMT(BPF_JMP | BPF_JA, 0));
    pp_tree(p, lo, hi, i, m);
    if (ja < p->n) p->f[ja].k = (unsigned)(p->n - ja - 1);  /* over the left subtree */
    pp_tree(p, lo, hi, m, j);
}

/* Build the profile's BPF program into p; 0, or -1 when it does not fit. */
static int profile_build(struct profile_prog *p)
{
    enum { N = sizeof profile_allow / sizeof profile_allow[0] };
    static int nr[N], lo[N], hi[N];
    int nranges = 0, top = __NR_clone3;
    memcpy(nr, profile_allow, sizeof nr);
    qsort(nr, N, sizeof nr[0], profile_cmp);
    for (int i = 0; i < N; i++) {
        if (nranges && nr[i] <= hi[nranges - 1] + 1) {
            if (nr[i] > hi[nranges - 1]) hi[nranges - 1] = nr[i];
            continue;
        }
        lo[nranges] = hi[nranges] = nr[i];
        nranges++;
    }
    if (nranges && hi[nranges - 1] > top) top = hi[nranges - 1];
    if (__NR_clone > top) top = __NR_clone;
    if (__NR_personality > top) top = __NR_personality;
    p->n = p->overflow = 0;
    pp_put(p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)));
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0));
    pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_DEFAULT_ERRNO));
    pp_put(p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)));
    /* above the profile's numbers, x32 numbers (bit 30) included: ENOSYS */
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGT | BPF_K, (unsigned)top, 0, 1));
    pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_NEWER_ERRNO));
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1));
    pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_CLONE3_ERRNO));
    /* clone: allowed when (flags & namespace flags) == 0; the mask's high word is 0 */
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 4));
    pp_put(p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args)));
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, PROFILE_CLONE_NS_FLAGS, 1, 0));
    pp_put(p, (struct sock_filter)P_RET(SECCOMP_RET_ALLOW));
    pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_DEFAULT_ERRNO));
    /* personality: the 64-bit argument equals one listed value (x86_64: low word first) */
    enum { NP = sizeof profile_personality / sizeof profile_personality[0] };
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_personality, 0, 5 + NP));
    pp_put(p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args) + 4));
    pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 1 + NP));
    pp_put(p, (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args)));
    for (int k = 0; k < NP; k++)  /* a match jumps to the ALLOW after the list */
        pp_put(p, (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, profile_personality[k],
                                               (unsigned char)(NP - k), 0));
    pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_DEFAULT_ERRNO));
    pp_put(p, (struct sock_filter)P_RET(SECCOMP_RET_ALLOW));
    if (nranges) pp_tree(p, lo, hi, 0, nranges);
    else pp_put(p, (struct sock_filter)P_ERRNO(PROFILE_DEFAULT_ERRNO));
    return p->overflow ? -1 : 0;
}

/* Install the profile on this process (with no_new_privs); -1 and errno on failure. */
static int install_profile(void)
{
    static struct profile_prog prog;
    if (profile_build(&prog) < 0) { errno = E2BIG; return -1; }
    struct sock_fprog fp = { .len = (unsigned short)prog.n, .filter = prog.f };
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fp);
}

#endif
