"""E2E fixtures (helpers in e2e_server.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_server import Server, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A create with no room answers 429 after this wait instead of the 30 s default.
    with running_server(tmp_path_factory, "dsec-home",
                        {"DSEC_MAX_UPLOAD_BYTES": str(1 << 20), "DSEC_API_CREATE_WAIT_S": "10"}) as srv:
        yield srv
