"""SandboxFusion front end: the pure decisions (no server, no root).

Protects: file names are confined (no '..', relative names under the work dir); the
upload tar holds exactly the source and the decoded files; results map to SandboxFusion's
statuses the way its clients (sandbox-fusion, verl) read them; floods are cut and flagged;
the per-tenant key is derived from the token hash and changes with it.
"""

from __future__ import annotations

import base64
import io
import tarfile

import pytest

from dsec.api.compat.fusion import (
    LANGUAGES,
    FusionInputError,
    RunCodeRequest,
    build_upload,
    clamp_timeout,
    command_result,
    fusion_key,
    fusion_url,
    memory_mb,
    overall,
    sandbox_path,
    supported_languages,
)
from dsec.models import ExecResult


def test_sandbox_path_confines_names() -> None:
    assert sandbox_path("a.txt") == "/work/a.txt"
    assert sandbox_path("d/./e.txt") == "/work/d/e.txt"
    assert sandbox_path("/tmp/x") == "/tmp/x"
    for bad in ("../x", "a/../../etc/passwd", "/etc/../etc/passwd", "", "a\0b", "/"):
        with pytest.raises(FusionInputError):
            sandbox_path(bad)


def test_build_upload_has_source_and_decoded_files() -> None:
    req = RunCodeRequest(code="print(1)", language="python",
                         files={"in/data.bin": base64.b64encode(b"\x00\x01").decode(), "skip": None})
    with tarfile.open(fileobj=io.BytesIO(build_upload(req, LANGUAGES["python"]))) as tf:
        got = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}  # type: ignore[union-attr]
    assert got == {"work/in/data.bin": b"\x00\x01", "work/main.py": b"print(1)"}
    with pytest.raises(FusionInputError, match="base64"):
        build_upload(RunCodeRequest(code="", language="python", files={"x": "%%%"}), LANGUAGES["python"])


def test_statuses_as_sandboxfusion_clients_read_them() -> None:
    ok = command_result(ExecResult(exit_code=0, stdout="1\n", duration=0.01), 100)
    assert ok.status == "Finished" and ok.return_code == 0 and overall(None, ok) == ("Success", "")
    fail = command_result(ExecResult(exit_code=2, stderr="boom", duration=0.01), 100)
    assert overall(None, fail)[0] == "Failed" and fail.return_code == 2
    tle = command_result(ExecResult(exit_code=137, timed_out=True, duration=1.0), 100)
    assert tle.status == "TimeLimitExceeded" and tle.return_code is None
    assert overall(None, tle) == ("Failed", "run timeout")
    bad_compile = command_result(ExecResult(exit_code=1, stderr="error: x", duration=0.1), 100)
    assert overall(bad_compile, None) == ("Failed", "compile error")


def test_flood_is_cut_and_flagged() -> None:
    r = command_result(ExecResult(exit_code=0, stdout="y" * 500, duration=0.1), 100)
    assert len(r.stdout or "") == 100 and "truncated at 100 bytes" in (r.stderr or "")


def test_timeouts_memory_and_languages() -> None:
    assert clamp_timeout(0, 10, 300) == 10 and clamp_timeout(-1, 10, 300) == 10
    assert clamp_timeout(1e9, 10, 300) == 300 and clamp_timeout(2.5, 10, 300) == 2.5
    assert memory_mb(-1, 1024) == 1024 and memory_mb(1, 1024) == 16 and memory_mb(512, 1024) == 512
    assert supported_languages({"python": "python", "cpp": "cpp", "cobol": "x"}) == ["python", "cpp"]


def test_fusion_key_follows_the_token_hash() -> None:
    a, b = fusion_key("h1"), fusion_key("h2")
    assert a != b and len(a) == 40 and "h1" not in a
    assert fusion_url("http://127.0.0.1:7070/", "h1") == f"http://127.0.0.1:7070/fusion/{a}"


async def test_burst_of_first_calls_all_authenticate() -> None:
    """Regression: with an async state store, concurrent first calls on a fresh server got
    401 while the first one was still reading the tenant list (seen in the run_code bench)."""
    import asyncio
    import types

    from dsec.api.compat.fusion import FusionService
    from dsec.config import Settings
    from dsec.state.store import TenantRecord

    rec = TenantRecord(name="t1", uid="T1", token_hash="h1", admin=False, created_at=0.0)

    class SlowAsyncState:
        reads = 0

        async def list_tenants(self) -> list[TenantRecord]:
            SlowAsyncState.reads += 1
            await asyncio.sleep(0.05)
            return [rec]

        async def get_tenant(self, name: str) -> TenantRecord | None:
            await asyncio.sleep(0)
            return rec if name == "t1" else None

    svc = types.SimpleNamespace(settings=Settings(), state=SlowAsyncState())
    fusion = FusionService(svc)  # type: ignore[arg-type]
    got = await asyncio.gather(*(fusion.tenant_for_key(fusion_key("h1")) for _ in range(20)))
    assert [g.name if g else None for g in got] == ["t1"] * 20
    assert SlowAsyncState.reads == 1
    assert await fusion.tenant_for_key(fusion_key("other")) is None
