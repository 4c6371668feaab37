"""E2E fixtures (helpers in e2e_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_server import Server, ensure_images, reap_home, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("dsec-home")
    ensure_images(home, ["busybox"])
    srv = start_server(home, {"DSEC_MAX_UPLOAD_BYTES": str(1 << 20)})
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.kill_all()
        srv.stop()
        reap_home(home)
