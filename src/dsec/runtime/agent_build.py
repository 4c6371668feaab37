"""Build the dsec-init binary (PID 1 + exec agent of every sandbox) from its C source.

The binary is static (it runs in images without a libc) and content-addressed: its
file name carries the sha256 of the source and the compiler flags, so a changed source
never reuses a stale binary and concurrent builders agree on the result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsec.durable import fsync_dir
from dsec.errors import SandboxFailure

SOURCE = Path(__file__).parent / "agent" / "dsec_init.c"
# Included by SOURCE: the hand-written profile installer, and the header generated from
# dsec.runtime.seccomp (the allowed syscalls), which is written next to the build.
PROFILE_INSTALLER = Path(__file__).parent / "agent" / "seccomp_profile.h"
GENERATED_HEADER = "dsec_profile.h"
CFLAGS: tuple[str, ...] = ("-static", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-s")
COMPILER = "gcc"
BUILD_TIMEOUT_S = 300.0  # a cold gcc on a loaded 2-core machine; normal is ~1 s


def binary_name(source: bytes, flags: tuple[str, ...] = CFLAGS) -> str:
    """Content-addressed file name of the binary built from source with flags."""
    digest = hashlib.sha256(source + b"\0" + "\0".join(flags).encode()).hexdigest()
    return f"dsec-init-{digest[:24]}"


def _explain_failure(stderr: str) -> str:
    if "cannot find -lc" in stderr or "cannot find -lgcc" in stderr:
        return ("static C library missing (need libc.a: install Debian package libc6-dev; "
                "scripts/setup.sh does)")
    return "compiler error"


def _build_inputs() -> tuple[bytes, bytes]:
    """(what the binary name hashes, the generated header): the source, the profile
    installer and the generated profile, so a changed seccomp profile is a new binary."""
    from dsec.runtime.seccomp import init_profile_header

    header = init_profile_header().encode()
    installer = PROFILE_INSTALLER.read_bytes() if PROFILE_INSTALLER.exists() else b""
    return SOURCE.read_bytes() + b"\0" + installer + b"\0" + header, header


def ensure_agent_binary(dest_dir: Path) -> Path:
    """Path of the built dsec-init under dest_dir; compiles it (temp + rename) if missing."""
    source, header = _build_inputs()
    dest = dest_dir / binary_name(source)
    if dest.exists():
        return dest
    compiler = shutil.which(COMPILER)
    if compiler is None:
        raise SandboxFailure(f"cannot build the sandbox init {dest.name}: {COMPILER} not found on PATH; "
                             "install gcc and libc6-dev (scripts/setup.sh does)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with tempfile.TemporaryDirectory(prefix="dsec-init-build-") as inc:
            (Path(inc) / GENERATED_HEADER).write_bytes(header)
            proc = subprocess.run([compiler, *CFLAGS, "-I", inc, "-I", str(PROFILE_INSTALLER.parent), "-o", str(tmp),
                                   str(SOURCE)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise SandboxFailure(f"cannot build the sandbox init from {SOURCE}: {_explain_failure(proc.stderr)}:"
                                 f"\n{proc.stderr.strip()[-2000:]}")
        tmp.chmod(0o755)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
        fsync_dir(dest_dir)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
