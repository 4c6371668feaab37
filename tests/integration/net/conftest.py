"""Fixtures of the networking integration tests (implementations in netlab.py)."""

from netlab import host_server, lab, real_node, sandbox_exec, sandboxes, tier  # noqa: F401 - pytest fixtures
