"""Schemathesis fuzzes every operation of the OpenAPI spec against a real server (real
node agent, real sandboxes): no 5xx answers, and no sandbox outlives the run."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from e2e_server import Server
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

pytestmark = pytest.mark.integration

def _mounts_under(root: Path, wait_s: float = 15, ignore: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    deadline = time.monotonic() + wait_s
    while True:
        found = [m for line in Path("/proc/self/mounts").read_text().splitlines()
                 if (m := line.split()[1]).startswith(str(root))
                 and Path(m).relative_to(root).parts[0] not in ignore]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


EXAMPLES = 6  # per operation and mode: ~30 operations x 2 modes stays well under 60 s


def test_fuzz_no_server_errors_no_leaks(server: Server) -> None:
    """Valid and invalid schema-derived requests to every operation get 2xx/4xx, never 5xx;
    afterwards every sandbox the fuzzer created is killed and none remain."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    auth = {"authorization": f"Bearer {server.token}"}
    failures: list[str] = []
    episodes: set[str] = set()  # episodes own their sandboxes until closed: close them after
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                if case.method.upper() == "DELETE" and case.path.startswith("/v1/tenants"):
                    case.path_parameters = {"name": "fuzz-nobody"}  # never remove the fuzzer's tenant
                if case.method.upper() == "DELETE" and case.path.startswith("/v1/images"):
                    case.path_parameters = {"ref": "fuzz-nothing:0"}  # never remove the stock images
                if case.path == "/v1/pools" and isinstance(case.body, dict) and isinstance(case.body.get("size"), int):
                    case.body["size"] = min(case.body["size"], 1)  # a 4096-member pool is valid, but slow here
                resp = case.call(base_url=server.url, headers=auth, timeout=60)
                if case.path.startswith("/v1/episodes") and resp.status_code < 300:
                    episodes.add(str((case.path_parameters or {}).get("episode_id", "")))
                if case.method.upper() == "POST" and resp.status_code == 201 and "/v1/sandboxes" in case.path:
                    # Free the capacity at once: the fuzzer checks answers, not how many
                    # sandboxes fit; a full node would turn later creates into 429s.
                    sid = resp.json().get("id")
                    if sid:
                        httpx.delete(f"{server.url}/v1/sandboxes/{sid}", headers=auth, timeout=60)
                if resp.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} ({mode.value}): {resp.status_code} "
                                    f"{resp.text[:300]}")

            try:
                check()
            except Unsatisfiable:
                pass  # e.g. no invalid request exists for GET /health
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as c:
        for ep in episodes - {""}:
            assert c.delete(f"/v1/episodes/{ep}").status_code in (204, 404, 422)
        leftover = c.get("/v1/sandboxes").json()
        for sb in leftover:
            assert c.delete(f"/v1/sandboxes/{sb['id']}").status_code in (204, 404)
        assert c.get("/v1/sandboxes").json() == []
        # Idle warm-pool members are the server's own (no tenant sees them); anything else
        # still mounted is a leak.
        warm = {i for n in c.get("/v1/scheduler").json()["nodes"] for i in n["warm_ids"]}
    leaked = [m for m in _mounts_under(server.home / "sandboxes", ignore=warm)]
    assert leaked == [], "sandbox mounts left behind"
    assert not failures, "\n".join(failures)
