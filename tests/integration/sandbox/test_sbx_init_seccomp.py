"""The container tier's seccomp profile installed by PID 1 (dsec-init ``--seccomp``,
``DSEC_INIT_SECCOMP``, the default) decides every x86_64 syscall exactly as runc's
filter compiled from the same OCI profile did, and is on every sandbox process.

Cold creates no longer have runc compile the ~300-name profile with libseccomp (about a
quarter of ``runc run``'s CPU here, docs/speed.md). The one intended difference: the
i386 ABI (``int 0x80``) is refused (EPERM) instead of filtered by name.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sbx_helpers import make, sh, start_node, stop_node

pytestmark = pytest.mark.integration

# Raw syscalls a filter has to decide beyond the probe's list: the i386 ABI, x32, a
# number above the profile's names (fchmodat2, 452: libc falls back on ENOSYS), -1.
_ABI_PROBE = r"""
#include <errno.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>
static void show(const char *name, long rc) {
    if (rc < 0 && rc > -4096) printf("%s -%ld\n", name, -rc); else printf("%s %ld\n", name, rc < 0 ? -1 : 0L);
}
static long raw(long nr, long a0) {
    long r;
    __asm__ volatile ("syscall" : "=a"(r) : "a"(nr), "D"(a0) : "rcx", "r11", "memory");
    return r;
}
int main(void) {
    long r;
    __asm__ volatile ("int $0x80" : "=a"(r) : "a"(20L) : "memory");  /* i386 getpid */
    show("i386_getpid", r);
    show("x32_getpid", raw(39 | 0x40000000, 0));
    show("fchmodat2", raw(452, -100));
    show("minus_one", raw(-1, 0));
    show("getpid", raw(39, 0) > 0 ? 0 : -1);
    show("personality_query", raw(135, 0xffffffffL));
    show("personality_high_word", raw(135, 0x100000000L));
    return 0;
}
"""


def _build_abi_probe(dest: Path) -> bytes:
    src = dest / "abi.c"
    src.write_text(_ABI_PROBE)
    subprocess.run(["gcc", "-static", "-O1", "-o", str(dest / "abi"), str(src)], check=True, capture_output=True)
    return (dest / "abi").read_bytes()


async def _results(node, probe_binary: bytes, abi: bytes) -> tuple[dict[str, str], dict[str, str], dict]:
    info = await make(node, "container")
    try:
        config = json.loads(node.manager.paths(info.id).config.read_text())
        out = {}
        for name, binary in (("probe", probe_binary), ("abi", abi)):
            await node.write_file(info.id, f"/work/{name}", binary, 0o755)
            r = await sh(node, info.id, [f"/work/{name}"], cwd="/work")
            assert r.exit_code == 0, r
            out[name] = dict(line.split(None, 1) for line in r.stdout.splitlines())
        status = await sh(node, info.id, "grep -E '^(Seccomp|Seccomp_filters|NoNewPrivs):' /proc/self/status")
        out["probe"]["status"] = " ".join(status.stdout.split())
        return out["probe"], out["abi"], config
    finally:
        await node.destroy(info.id)


async def test_init_profile_decides_like_runcs(node, sbx_env, probe_binary, tmp_path):
    """Same probe, one sandbox made with the profile in PID 1 and one with runc's: every
    privileged-syscall result and control is equal, the process runs filtered (mode 2,
    one filter, no_new_privs), runc's config carries no seccomp then, and the raw-ABI
    corner cases are as documented (i386 EPERM instead of allowed by name)."""
    abi = _build_abi_probe(tmp_path)
    ours_probe, ours_abi, ours_cfg = await _results(node, probe_binary, abi)
    runc_node = await start_node(sbx_env, tmp_path / "runc-home", init_seccomp=False)
    try:
        runc_probe, runc_abi, runc_cfg = await _results(runc_node, probe_binary, abi)
    finally:
        await stop_node(runc_node)

    assert "seccomp" not in ours_cfg["linux"] and ours_cfg["process"]["args"][-1] == "--seccomp"
    assert "seccomp" in runc_cfg["linux"] and "--seccomp" not in runc_cfg["process"]["args"]
    assert ours_probe == runc_probe
    assert ours_probe["status"] == "NoNewPrivs: 1 Seccomp: 2 Seccomp_filters: 1", ours_probe["status"]
    assert ours_probe["mount_tmpfs"] == "EPERM" and ours_probe["clone3"] == "ENOSYS"
    for name in ("fchmodat2", "minus_one", "getpid", "personality_query", "personality_high_word"):
        assert ours_abi[name] == runc_abi[name], (name, ours_abi, runc_abi)
    assert ours_abi["fchmodat2"] == "-38" and ours_abi["getpid"] == "0"
    assert ours_abi["personality_high_word"] == "-1"  # EPERM: the 64-bit argument is compared
    assert ours_abi["x32_getpid"] == runc_abi["x32_getpid"] == "-38"  # no x32 ABI on this kernel either way
    assert ours_abi["i386_getpid"] == "-1" and runc_abi["i386_getpid"] != "-1", (ours_abi, runc_abi)
