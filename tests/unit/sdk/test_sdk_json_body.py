"""The SDK's hot calls (create, exec) send bodies serialised by pydantic itself (issue 15:
``model_dump`` + ``json.dumps`` cost three times as much), with the same JSON content."""

from __future__ import annotations

import json

from dsec.models import ExecRequest, SandboxSpec
from dsec.sdk import _ops


def test_exec_and_create_bodies_are_pydantic_json_with_a_content_type() -> None:
    req = ExecRequest(cmd=["echo", "é"], env={"A": "1"}, timeout=5)
    call = _ops.exec_("sb-1", req, 30.0)
    assert call.json is None and call.content is not None
    assert call.headers["content-type"] == "application/json"
    assert json.loads(call.content) == req.model_dump(mode="json", exclude_none=True)
    spec = SandboxSpec(image="busybox", cpu=0.5, memory="64M", labels={"run": "r1"}, request_id="rid-1")
    call = _ops.create(spec)
    assert call.json is None and call.headers["content-type"] == "application/json" and call.idempotent
    assert json.loads(call.content or b"") == spec.model_dump(mode="json", exclude_none=True)
