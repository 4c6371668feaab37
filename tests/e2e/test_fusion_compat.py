"""SandboxFusion compatibility against a real ``dsec serve``: the unmodified ``sandbox-fusion``
client package and verl's ``verl.utils.reward_score.sandbox_fusion.check_correctness``
call ``fusion_url`` from server.json (no auth header) and get SandboxFusion's schema back.

verl's package ``__init__`` imports torch and tensordict (verl.protocol) and transformers
(verl.utils.tokenizer), which this machine does not install; the sandbox_fusion reward
module itself needs only ``requests``. The test therefore registers empty parent
packages (``verl``, ``verl.utils``, ``verl.utils.reward_score``) pointing at the installed
files and imports verl's real, unmodified ``sandbox_fusion`` package under them.
"""

from __future__ import annotations

import base64
import concurrent.futures
import importlib
import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_server import Server, running_server

pytestmark = pytest.mark.integration

sandbox_fusion = pytest.importorskip("sandbox_fusion")
from sandbox_fusion import RunCodeRequest, RunStatus, run_code

IMAGES = ["busybox", "python", "cpp"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "fusion-home", {
            "DSEC_FUSION_POOL_MAX": "8", "DSEC_FUSION_MAX_REQUEST_BYTES": str(4 << 20),
            "DSEC_FUSION_MAX_OUTPUT_BYTES": str(64 << 10)}, images=IMAGES) as srv:
        yield srv


@pytest.fixture(scope="module")
def fusion_url(server: Server) -> str:
    url = json.loads((server.home / "server.json").read_text())["fusion_url"]
    assert url.startswith(server.url + "/fusion/")
    return url


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(url + "/run_code", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def test_client_python_bash_cpp(fusion_url: str) -> None:
    """run_code through the unmodified client: stdout, stdin, return codes, compile step."""
    py = run_code(RunCodeRequest(code="import sys\nprint(sys.stdin.read().upper())", stdin="hi", language="python"),
                  endpoint=fusion_url)
    assert py.status == RunStatus.Success and py.run_result.stdout == "HI\n"
    assert py.run_result.return_code == 0 and py.run_result.execution_time > 0
    sh = run_code(RunCodeRequest(code='echo "$BASH_VERSION" | cut -c1; exit 3', language="bash"),
                  endpoint=fusion_url)
    assert sh.status == RunStatus.Failed and sh.run_result.return_code == 3 and sh.run_result.stdout.strip()
    cpp = run_code(RunCodeRequest(code="#include <iostream>\nint main(){int a,b;std::cin>>a>>b;"
                                       "std::cout<<a+b<<std::endl;}", stdin="2 40", language="cpp",
                                  compile_timeout=60), endpoint=fusion_url, client_timeout=120)
    assert cpp.status == RunStatus.Success, cpp
    assert cpp.compile_result.status == "Finished" and cpp.compile_result.return_code == 0
    assert cpp.run_result.stdout == "42\n"
    bad = run_code(RunCodeRequest(code="int main( {", language="cpp"), endpoint=fusion_url, client_timeout=120)
    assert bad.status == RunStatus.Failed and bad.run_result is None
    assert bad.compile_result.return_code != 0 and "error" in bad.compile_result.stderr


def test_ping_and_auth(server: Server, fusion_url: str) -> None:
    """/v1/ping answers under the tenant's URL; no key, a wrong key or a bare /run_code is 401,
    never a run (anonymous access is off by default). GET /v1/fusion gives the same URL."""
    assert httpx.get(fusion_url + "/v1/ping").json() == "pong"
    body = {"code": "print(1)", "language": "python"}
    for url in (server.url + "/fusion/run_code", server.url + "/fusion/" + "0" * 40 + "/run_code",
                server.url + "/run_code"):
        assert httpx.post(url, json=body).status_code in (401, 404)
    info = httpx.get(server.url + "/v1/fusion", headers={"authorization": f"Bearer {server.token}"}).json()
    assert info["fusion_url"] == fusion_url and {"python", "bash", "cpp"} <= set(info["languages"])


def test_files_and_fetch_files(fusion_url: str) -> None:
    """``files`` (base64) are written next to the program, ``fetch_files`` come back base64;
    a file the program did not make is left out."""
    body = {"code": "print(open('data/in.txt').read()[::-1]); open('out.bin','wb').write(bytes(range(4)))",
            "language": "python", "files": {"data/in.txt": base64.b64encode(b"abc").decode()},
            "fetch_files": ["out.bin", "missing.txt"]}
    r = _post(fusion_url, body)
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "cba\n"
    assert base64.b64decode(r["files"]["out.bin"]) == bytes(range(4)) and "missing.txt" not in r["files"]


def test_no_state_carried_between_calls(fusion_url: str) -> None:
    """Isolation: a file, a background process and /dev/shm from one call are gone in the
    next, even when it lands in the same (reset) sandbox."""
    dirty = ("import os, subprocess; open('/tmp/left','w').write('x'); open('/dev/shm/s','w').write('x');"
             "subprocess.Popen(['sleep','1000'], start_new_session=True); print('ok')")
    check = ("import os, subprocess; print(os.path.exists('/tmp/left'), os.path.exists('/dev/shm/s'),"
             "subprocess.run(['sh','-c','ps -e -o comm | grep -c sleep'], capture_output=True, text=True)"
             ".stdout.strip())")
    pods = set()
    for _ in range(4):
        r = _post(fusion_url, {"code": dirty, "language": "python"})
        assert r["run_result"]["stdout"] == "ok\n"
        pods.add(r["executor_pod_name"])
        r = _post(fusion_url, {"code": check, "language": "python"})
        assert r["run_result"]["stdout"] == "False False 0\n", r
        pods.add(r["executor_pod_name"])
    assert len(pods) < 8  # sandboxes were reused (reset), not made per call


def test_bad_input_answers_in_schema_and_server_stays_responsive(fusion_url: str) -> None:
    """Unknown language, endless code, output floods, fork bombs, '..' names, oversized
    stdin: each a clear status in SandboxFusion's schema; the server answers ping after."""
    r = _post(fusion_url, {"code": "x", "language": "cobol"})
    assert r["status"] == "SandboxError" and "cobol" in r["message"]
    r = _post(fusion_url, {"code": "while True: pass", "language": "python", "run_timeout": 1})
    assert r["status"] == "Failed" and r["run_result"]["status"] == "TimeLimitExceeded"
    r = _post(fusion_url, {"code": "import sys\nwhile True: sys.stdout.write('y'*65536)", "language": "python",
                           "run_timeout": 2})
    assert r["run_result"]["status"] == "TimeLimitExceeded" and len(r["run_result"]["stdout"]) <= 64 << 10
    assert "truncated" in r["run_result"]["stderr"]
    r = _post(fusion_url, {"code": "b(){ b|b & }; b; sleep 1", "language": "bash", "run_timeout": 2})
    assert r["status"] in ("Success", "Failed") and r["run_result"]["status"] in ("TimeLimitExceeded", "Finished")
    for _ in range(3):  # whichever pooled sandbox the next calls get: no bomb left in it
        r = _post(fusion_url, {"code": "ps -e -o pid= | wc -l", "language": "bash"})
        assert r["status"] == "Success" and int(r["run_result"]["stdout"]) <= 4, r
    r = _post(fusion_url, {"code": "print(1)", "language": "python", "files": {"../x": "eA=="}})
    assert r["status"] == "SandboxError" and "'..'" in r["message"]
    r = _post(fusion_url, {"code": "print(1)", "language": "python", "fetch_files": ["/etc/../etc/passwd"]})
    assert r["status"] == "SandboxError"
    big = httpx.post(fusion_url + "/run_code", json={"code": "print(1)", "language": "python",
                                                     "stdin": "x" * (50 << 20)}, timeout=120)
    assert big.status_code == 200 and big.json()["status"] == "SandboxError"
    assert "exceeds" in big.json()["message"]
    r = _post(fusion_url, {"code": "print(1)", "language": "python", "memory_limit_MB": 64,
                           "run_timeout": 0.0001})
    assert r["status"] in ("Success", "Failed")  # a tiny timeout is honoured, not an error
    r = _post(fusion_url, {"code": "x = bytearray(400 << 20); print('big')", "language": "python",
                           "memory_limit_MB": 128})
    assert r["status"] == "Failed" and r["run_result"]["return_code"] != 0  # the memory limit holds
    t0 = time.perf_counter()
    assert httpx.get(fusion_url + "/v1/ping", timeout=5).json() == "pong"
    assert time.perf_counter() - t0 < 1.0


def _verl_sandbox_fusion() -> types.ModuleType:
    spec = importlib.util.find_spec("sandbox_fusion")  # noqa: F841 - the client is installed
    import importlib.metadata as md

    try:
        dist = md.distribution("verl")
    except md.PackageNotFoundError:
        pytest.skip("verl not installed (pip install --no-deps verl)")
    root = Path(str(dist.locate_file("verl")))
    for name, sub in (("verl", ""), ("verl.utils", "utils"), ("verl.utils.reward_score", "utils/reward_score")):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(root / sub)]  # type: ignore[attr-defined]
            sys.modules[name] = mod
    return importlib.import_module("verl.utils.reward_score.sandbox_fusion")


def test_verl_check_correctness(fusion_url: str) -> None:
    """verl's check_correctness gives the right per-case results: pass, wrong answer,
    runtime error and timeout; compute_score gives the pass fraction."""
    sf = _verl_sandbox_fusion()
    code = "a, b = map(int, input().split())\nprint(a + b)"
    res, meta = sf.check_correctness(fusion_url + "/run_code",
                                     {"inputs": ["1 2", "5 5", "3 4"], "outputs": ["3", "10", "8"]}, code)
    assert res == [True, True, False], meta
    res, meta = sf.check_correctness(fusion_url + "/run_code", {"inputs": ["1"], "outputs": ["1"]},
                                     "raise SystemExit(input() and 2)")
    assert res == [-2] and meta[0]["status"] == "runtime_error"
    res, meta = sf.check_correctness(fusion_url + "/run_code", {"inputs": ["1"], "outputs": ["1"]},
                                     "while True: pass", timeout=1)
    assert res == [-3] and meta[0]["status"] == "timeout"
    score, _ = sf.compute_score(fusion_url + "/run_code", None, 1024, f"```python\n{code}\n```",
                                {"inputs": ["1 1", "2 2"], "outputs": ["2", "5"]})
    assert score == 0.5


def test_concurrent_calls(fusion_url: str) -> None:
    """32 calls at once through the client: every answer right (the pool waits, nothing fails)."""
    def one(i: int) -> str:
        r = run_code(RunCodeRequest(code=f"print({i} * 2)", language="python"), endpoint=fusion_url,
                     client_timeout=120)
        return r.run_result.stdout
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        outs = list(ex.map(one, range(32)))
    assert outs == [f"{i * 2}\n" for i in range(32)]


def _until_built(fusion_url: str, body: dict, limit_s: float = 900) -> tuple[dict, list[str]]:
    """Call until the language's image is there; returns the answer and the progress seen."""
    progress: list[str] = []
    deadline = time.monotonic() + limit_s
    while True:
        r = _post(fusion_url, body, timeout=300)
        if r["status"] != "SandboxError" or "being built" not in r["message"]:
            return r, progress
        progress.append(r["message"])
        assert time.monotonic() < deadline, progress[-1]
        time.sleep(2)


@pytest.mark.timeout(1200)  # a fresh machine runs mmdebstrap for the nodejs image here (~2-3 min)
def test_nodejs_image_built_on_first_use(fusion_url: str) -> None:
    """A language whose image is not on the server (nodejs) answers SandboxError 'being
    built ... progress: ...' while the stock image builds in the background, then runs."""
    r, progress = _until_built(fusion_url, {"code": "process.stdin.on('data', d => console.log(String(d).trim() * 2))",
                                            "language": "nodejs", "stdin": "21"})
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "42\n", r
    assert all("progress:" in p for p in progress)
