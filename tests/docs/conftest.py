"""Doc-test fixtures: one real server (busybox + python images) per module, a web server
in a network namespace for the allow-list examples, a tenant per doc file."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
for sub in ("e2e", "integration/net"):  # reuse the e2e server helpers and the net lab's "remote hosts"
    if str(TESTS / sub) not in sys.path:
        sys.path.insert(0, str(TESTS / sub))


@dataclass
class DocServer:
    srv: object  # e2e_server.Server
    tokens: dict[str, str] = field(default_factory=dict)

    def token_for(self, doc: str) -> str:
        """An admin tenant per doc file: episode ids and labels of one file never meet another's."""
        if doc not in self.tokens:
            from dsec.sdk import Client

            name = "doc-" + "".join(c if c.isalnum() else "-" for c in doc.lower())[:40]
            with Client(self.srv.url, self.srv.token) as c:  # type: ignore[attr-defined]
                self.tokens[doc] = c.add_tenant(name, admin=True).token
        return self.tokens[doc]


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocServer]:
    from e2e_server import ensure_images, reap_home, start_server
    from netlab import _free_octet

    home = tmp_path_factory.mktemp("doc-home")
    ensure_images(home, ["busybox", "python"])
    # Its own sandbox address range and cgroup parent: another DSec server on this machine
    # (a developer's, a concurrent test run) may hold the default range, and the scheduler's
    # load probe would count that server's sandboxes' CPU against this one's admissions.
    # No demand-driven warm pools: each example is a reader's separate first try, and warm
    # members left by earlier examples (other shapes) would hold CPU reservations that an
    # all-or-none group needs (README group example; reported on issue 17). Declared pools
    # (`dsec pool set`) still work.
    parent = f"dsec-doc-{os.getpid()}"
    srv = start_server(home, {"DSEC_NET_CIDR": f"10.252.{_free_octet(set())}.0/24", "DSEC_CGROUP_PARENT": parent,
                              "DSEC_WARM_POOL_FACTOR": "0"})
    try:
        yield DocServer(srv)
    finally:
        srv.stop()
        reap_home(home)  # sandbox records carry their cgroup parent
        for d in Path("/sys/fs/cgroup").glob(f"*/{parent}"):
            with contextlib.suppress(OSError):
                d.rmdir()  # empty once every sandbox is gone


@dataclass
class Web:
    addr: str
    port: int


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    """A "remote host" (a network namespace linked to this one) serving HTTP on 8080."""
    from netlab import _free_octet, _make_remote, _remove_remote, _wait_port

    www = tmp_path_factory.mktemp("www")
    (www / "index.html").write_text("hello from the allow-listed host\n")
    remote = _make_remote(f"d{os.getpid() % 1000:03d}", _free_octet(set()))
    try:
        remote.run(sys.executable, "-m", "http.server", "8080", "--bind", remote.addr, "--directory", str(www),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(remote, 8080)
        yield Web(remote.addr, 8080)
    finally:
        _remove_remote(remote)
