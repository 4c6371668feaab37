"""Every shell and Python block of README.md and docs/*.md runs against a real server
(or is marked ``<!-- not-run: reason -->``): a README example that breaks fails CI."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_blocks import PLACEHOLDERS, ROOT, Block, all_blocks, doc_files

BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.kind in ("shell", "python") and b.not_run is None]
BLOCK_TIMEOUT_S = 180


def test_every_block_declares_its_language_and_why_it_does_not_run() -> None:
    """An untagged fence would escape the doc test: each names a language; a not-run
    marker carries a reason and sits on a shell/Python block."""
    untagged = [b.id for b in BLOCKS if not b.lang]
    assert not untagged, f"give these blocks a language (bash, python, or text for listings): {untagged}"
    bad = [b.id for b in BLOCKS if b.not_run is not None and (not b.not_run or b.kind == "other")]
    assert not bad, f"not-run markers need a reason and belong on bash/python blocks: {bad}"
    assert len(RUNNABLE) >= 10 and {f.name for f in doc_files()} >= {"README.md", "api.md", "security.md"}


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run executes exactly the README's test command (scripts/test.sh)."""
    ci = (ROOT / ".ci/run").read_text()
    first = next(b for b in BLOCKS if b.path.name == "README.md" and b.kind == "shell")
    assert "exec scripts/test.sh" in ci and "scripts/test.sh" in first.code
    assert "sudo" not in first.code  # works in a root shell with no sudo installed


def _substitute(block: Block, code: str, sandbox_id: str | None, web: object) -> str:
    if sandbox_id is not None:
        code = code.replace("SB_ID", sandbox_id)
    return code.replace("10.0.0.5:8080", f"{web.addr}:{web.port}")  # type: ignore[attr-defined]


def _clean(srv, token: str) -> None:  # type: ignore[no-untyped-def]
    """Each block starts on an empty server, as a reader's first try would: kill what the
    previous one left (its tenant's sandboxes and the local tenant's, which the E2B and
    SandboxFusion examples use)."""
    from dsec.errors import DSecError
    from dsec.sdk import Client

    for tok in (token, srv.token):
        with Client(srv.url, tok) as c:
            for info in c.list():
                with contextlib.suppress(DSecError):
                    c.kill(info.id)


@pytest.mark.integration
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_doc_block_runs(block: Block, doc_server, web, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The block runs to exit 0 with DSEC_URL/DSEC_TOKEN of a real server, placeholders
    (``doc_blocks.PLACEHOLDERS``) replaced by real objects."""
    from dsec.errors import NotFound
    from dsec.sdk import Client, Sandbox

    srv = doc_server.srv
    token = doc_server.token_for(block.path.name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(DSEC_HOME=str(srv.home), DSEC_URL=srv.url, DSEC_TOKEN=token,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    sandbox = None
    with Client(srv.url, token) as c:
        if "SB_ID" in block.code:
            assert "SB_ID" in PLACEHOLDERS
            sandbox = Sandbox.create(image="busybox", network=[], labels={"run": "r1"}, client=c)
        code = _substitute(block, block.code, sandbox.id if sandbox else None, web)
        argv = (["bash", "-euo", "pipefail", "-c", code] if block.kind == "shell"
                else [sys.executable, "-c", code])
        t0 = time.monotonic()
        try:
            r = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                               check=False)
        finally:
            if sandbox is not None:
                with contextlib.suppress(NotFound):  # the block may have killed it (dsec kill SB_ID)
                    c.kill(sandbox.id)
            _clean(srv, token)
    took = time.monotonic() - t0
    assert r.returncode == 0, (f"{block.id} ({block.kind}) exited {r.returncode} after {took:.1f}s\n--- code\n"
                               f"{code}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
