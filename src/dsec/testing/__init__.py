"""Test support shipped with DSec: the shared fake node agent, fault points, servers."""

from dsec.testing.fake_node import FakeCheckpointStore, FakeNodeAgent

__all__ = ["FakeCheckpointStore", "FakeNodeAgent"]
