"""RUN steps in a real DSec sandbox (runc + seccomp + cgroups + dropped capabilities)
through the node's ``LocalNodeAgent``/``SandboxManager``: the stronger build backend.

The build gets its own node home (``<images>/node-build``) and a short run dir, so its
start-up reconcile can never adopt or clean the sandboxes of a server running on the
same DSEC_HOME. The sandbox's overlay = base image + the layers built so far passed as
``extra_lower_dirs``; after the command, its upper dir (on the sandbox's tmpfs) is
copied out with ``cp -a`` (keeps overlay whiteouts and the opaque xattr) before the
sandbox is destroyed, and the builder commits the copy.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dsec.config import Settings
from dsec.errors import BuildFailed
from dsec.images.build.runner import RunResult


class ManagerRunner:
    def __init__(self, settings: Settings, store: Any) -> None:
        self.store = store
        self.home = Path(store.root) / "node-build"
        self.base_settings = settings

    def run(self, lower_dirs: list[Path], argv: list[str], *, env: list[str], workdir: str, network: bool,
            timeout_s: float, scratch: Path, base_ref: str = "", extra_lower_dirs: list[Path] | None = None
            ) -> RunResult:
        return asyncio.run(self._run(argv, env, workdir, network, timeout_s, scratch, base_ref,
                                     extra_lower_dirs or []))

    async def _run(self, argv: list[str], env: list[str], workdir: str, network: bool, timeout_s: float,
                   scratch: Path, base_ref: str, extra: list[Path]) -> RunResult:
        from dsec.models import ExecRequest, SandboxSpec
        from dsec.node.agent import LocalNodeAgent
        from dsec.runtime.oci import AGENT_PATH_IN_SANDBOX

        # A short, per-run run dir (unix socket paths are limited to 108 bytes), removed after.
        run_dir = Path(tempfile.mkdtemp(prefix="dsec-build-", dir="/run"))
        settings = self.base_settings.model_copy(update={"home": self.home, "run_dir": run_dir})
        agent = LocalNodeAgent(settings, images=self.store)
        try:
            await agent.start()
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        sid = None
        try:
            envd = dict(e.split("=", 1) for e in env if "=" in e)
            spec = SandboxSpec(image=base_ref, network=["0.0.0.0/0"] if network else None,
                               timeout=timeout_s + 60, labels={"dsec.build": "1"})
            info = await agent.create(spec, extra_lower_dirs=extra)
            sid = info.id
            res = await agent.exec(sid, ExecRequest(cmd=argv, timeout=timeout_s, cwd=workdir or "/", env=envd))
            dest = scratch / "upper"
            cp = await asyncio.create_subprocess_exec("cp", "-a", str(agent.manager.upper_dir(sid)), str(dest),
                                                      stderr=asyncio.subprocess.PIPE)
            _, cp_err = await cp.communicate()
            if cp.returncode != 0:
                raise BuildFailed(f"copying the build sandbox's upper dir failed: {cp_err.decode().strip()}")
            # The runtime's own mount target for the exec agent is not part of the image.
            top = AGENT_PATH_IN_SANDBOX.strip("/").split("/", 1)[0]
            if top and (dest / top).exists():
                shutil.rmtree(dest / top) if (dest / top).is_dir() else (dest / top).unlink()
            return RunResult(res.exit_code, res.stdout + res.stderr, dest, res.timed_out)
        finally:
            try:
                if sid is not None:
                    await agent.destroy(sid)
            finally:
                await agent.close()
                shutil.rmtree(run_dir, ignore_errors=True)
