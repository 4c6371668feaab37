"""A minimal episode host: overlay mounts + chroot, no container isolation.

It exists so the checkpoint engine, its crash tests and ``dsec drill`` run for real
(real overlayfs, real processes, real crashes) independently of the sandbox manager;
production episodes run on ``dsec.node`` sandboxes through the same ``EpisodeHost``
protocol. It is NOT a security boundary. Needs root (mount, chroot).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

from dsec import errors
from dsec.checkpoints.host import ImageView
from dsec.checkpoints.unit import Compat
from dsec.models import ExecRequest, ExecResult, SandboxSpec
from dsec.node import syscalls

_BASE_ENV = {"PATH": "/bin:/usr/bin:/sbin:/usr/sbin", "HOME": "/root", "LANG": "C"}


def make_busybox_rootfs(dest: Path, busybox: str = "/bin/busybox") -> Path:
    """A tiny rootfs (static busybox + applet symlinks) to serve as an image layer."""
    if (dest / "bin" / "sh").exists():
        return dest
    tmp = dest.with_name(dest.name + f".{uuid.uuid4().hex[:6]}")
    for d in ("bin", "etc", "tmp", "root", "work"):
        (tmp / d).mkdir(parents=True)
    shutil.copy2(busybox, tmp / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
    for a in applets:
        if a != "busybox" and "/" not in a:
            os.symlink("busybox", tmp / "bin" / a)
    (tmp / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    os.chmod(tmp / "tmp", 0o1777)
    try:
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _dir_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for f in sorted(filenames):
            st = os.lstat(os.path.join(dirpath, f))
            h.update(f"{os.path.relpath(dirpath, root)}/{f}:{st.st_mode}:{st.st_size}\n".encode())
    return "sha256:" + h.hexdigest()


class DirHost:
    def __init__(self, root: Path, images: dict[str, Path]) -> None:
        self.root = root
        self.images = images
        self._digests: dict[str, str] = {}
        root.mkdir(parents=True, exist_ok=True)

    async def image_view(self, spec: SandboxSpec) -> ImageView:
        img = self.images.get(spec.image)
        if img is None:
            raise errors.NotFound(f"image {spec.image!r} is not known to this host (have {sorted(self.images)})")
        if spec.image not in self._digests:
            self._digests[spec.image] = await asyncio.to_thread(_dir_digest, img)
        d = self._digests[spec.image]
        return ImageView(compat=Compat(image=spec.image, image_id=d, image_layers=[d], isolation="dir"),
                         lower_dirs=[img])

    def _dir(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    async def create(self, spec: SandboxSpec, extra_lower_dirs: list[Path], sandbox_id: str | None = None) -> str:
        view = await self.image_view(spec)
        sid = sandbox_id or "dh-" + uuid.uuid4().hex[:12]
        base = self._dir(sid)
        for d in ("upper", "work", "merged"):
            (base / d).mkdir(parents=True)
        lowers = [str(p) for p in [*extra_lower_dirs, *view.lower_dirs]]
        syscalls.mount_overlay(str(base / "merged"), lowers, str(base / "upper"), str(base / "work"))
        return sid

    def upper_dir(self, sandbox_id: str) -> Path:
        return self._dir(sandbox_id) / "upper"

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        merged = self._dir(sandbox_id) / "merged"
        self._check_alive(sandbox_id, merged)
        argv = req.argv()
        if req.cwd:
            argv = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', req.cwd, *argv]
        env = {**_BASE_ENV, **(req.env or {})}
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "chroot", str(merged), *argv, env=env, start_new_session=True,
            stdin=subprocess.PIPE if req.stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        timed_out = False
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(req.stdin.encode() if req.stdin is not None else None), req.timeout or 60)
        except TimeoutError:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = await proc.communicate()
        self._check_alive(sandbox_id, merged)  # killed mid-command: no result, the step failed
        return ExecResult(exit_code=proc.returncode if not timed_out else 124, stdout=out.decode(errors="replace"),
                          stderr=err.decode(errors="replace"), duration=time.perf_counter() - t0,
                          timed_out=timed_out)

    def _check_alive(self, sandbox_id: str, merged: Path) -> None:
        if not os.path.ismount(merged):
            raise errors.SandboxFailure(f"sandbox {sandbox_id!r} is gone (killed or its node restarted); "
                                        "reopen the episode to restore it from its last checkpoint")

    def kill(self, sandbox_id: str) -> int:
        """Fault injection: SIGKILL every process inside the sandbox and tear its root down."""
        merged = str(self._dir(sandbox_id) / "merged")
        killed = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/root") == merged:
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
            except OSError:
                continue
        try:
            syscalls.umount(merged)
        except OSError:
            pass
        return killed

    async def destroy(self, sandbox_id: str) -> None:
        base = self._dir(sandbox_id)
        if not base.exists():
            return
        for mp in syscalls.mounts_under(str(base)):
            try:
                syscalls.umount(mp)
            except OSError:
                pass
        await asyncio.to_thread(shutil.rmtree, base, True)

    async def freeze(self, sandbox_id: str) -> None:
        """Nothing to freeze: commands run to completion (or are killed) inside exec."""

    async def thaw(self, sandbox_id: str) -> None:
        """See freeze."""
