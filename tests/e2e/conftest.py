"""E2E fixtures (helpers in e2e_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_server import Server, ensure_images, reap_home, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("dsec-home")
    ensure_images(home, ["busybox"])
    # A create with no room answers 429 after this wait instead of the 30 s default.
    srv = start_server(home, {"DSEC_MAX_UPLOAD_BYTES": str(1 << 20), "DSEC_API_CREATE_WAIT_S": "10"})
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
        srv.stop()
        reap_home(home)
