"""Fixtures of the networking integration tests (implementations in netlab.py)."""

from netlab import host_server, lab, sandbox_exec  # noqa: F401 - pytest fixtures
