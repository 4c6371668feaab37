"""Schemathesis fuzzes every operation of the OpenAPI spec against a real server: no 5xx
answers, and no sandbox outlives the run."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from e2e_server import Server
from hypothesis import HealthCheck, settings

pytestmark = pytest.mark.integration

# Schemathesis must fetch the spec lazily: the server fixture starts it.
schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case, server: Server) -> None:
    """Any schema-derived request, valid or not, gets a 2xx/4xx JSON answer, never a 5xx."""
    if case.path.startswith("/v1/tenants") and case.method == "DELETE":
        case.path_parameters = {"name": "fuzz-nobody"}  # never delete the fuzzer's own tenant
    resp = case.call(base_url=server.url, headers={"authorization": f"Bearer {server.token}"}, timeout=60)
    assert resp.status_code < 500, f"{case.method} {case.formatted_path}: {resp.status_code} {resp.text[:500]}"


def test_no_leaked_sandboxes_after_fuzz(server: Server) -> None:
    """Every sandbox the fuzzer created can be listed and killed; none remain."""
    h = {"authorization": f"Bearer {server.token}"}
    with httpx.Client(base_url=server.url, headers=h, timeout=60) as c:
        for sb in c.get("/v1/sandboxes").json():
            assert c.delete(f"/v1/sandboxes/{sb['id']}").status_code in (204, 404)
        assert c.get("/v1/sandboxes").json() == []
