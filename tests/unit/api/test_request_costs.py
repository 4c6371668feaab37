"""Per-request costs on the exec/create path (issue 15: the SDK's share of an exec is
~0.4 ms, so a few µs per request count): metric series looked up once, a valid token
hashed once."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.api import auth as auth_mod
from dsec.api.auth import TenantAuth
from dsec.api.metrics import Metrics
from dsec.errors import Unauthorized
from dsec.state.sqlite import SqliteStateStore


def test_metric_children_are_memoised_and_count_in_their_series() -> None:
    """``Metrics.child`` hands out the same series as ``labels()`` each time, and what is
    observed through it is exported under those labels."""
    m = Metrics()
    a = m.child(m.execs, "ok")
    assert m.child(m.execs, "ok") is a and m.child(m.execs, "timeout") is not a
    a.inc()
    m.child(m.execs, "ok").inc()
    m.child(m.api_seconds, "POST", "/v1/sandboxes/{sandbox_id}/exec", "2xx").observe(0.001)
    text = m.render().decode()
    assert 'dsec_execs_total{result="ok"} 2.0' in text
    assert 'dsec_api_request_seconds_count{method="POST",route="/v1/sandboxes/{sandbox_id}/exec",status="2xx"} 1.0' \
        in text


async def test_a_valid_token_is_hashed_once_and_a_removed_tenant_is_still_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second request with a token that authenticated skips its sha256; guesses are
    hashed every time (never remembered); a tenant removed after its token was seen is
    refused once the cache is invalidated, as before."""
    state = SqliteStateStore(tmp_path / "s.db")
    try:
        auth = TenantAuth(state)
        rec, token = await auth.create_tenant("alice")
        hashed: list[str] = []
        real = auth_mod.hash_token
        monkeypatch.setattr(auth_mod, "hash_token", lambda t: hashed.append(t) or real(t))
        for _ in range(3):
            assert (await auth.authenticate(f"Bearer {token}")).uid == rec.uid
        assert hashed == [token]
        for _ in range(2):
            with pytest.raises(Unauthorized):
                await auth.authenticate("Bearer guess")
        assert hashed == [token, "guess", "guess"]
        await state.delete_tenant("alice")
        auth.invalidate()
        with pytest.raises(Unauthorized):
            await auth.authenticate(f"Bearer {token}")
    finally:
        await state.close()
