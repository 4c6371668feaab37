"""Group admission's pure decisions (issue 16): how many sandboxes of a shape a cluster can
ever hold (refuse impossible groups at submit) and whether a whole group has room now."""

from __future__ import annotations

from types import SimpleNamespace

from dsec.api.groups import max_of_shape, room_now


def _node(cpu: float = 2.0, memory: int = 8 << 30, disk: int = 100 << 30, max_sandboxes: int = 100,
          used: tuple[float, int, int, int] = (0.0, 0, 0, 0), healthy: bool = True, predicted: float = 0.0,
          isolation: tuple[str, ...] = ("container",)) -> SimpleNamespace:
    return SimpleNamespace(cpu=cpu, memory=memory, disk=disk, max_sandboxes=max_sandboxes, isolation=isolation,
                           healthy=healthy, predicted=predicted, used_cpu=used[0], used_memory=used[1],
                           used_disk=used[2], count=used[3])


def test_max_of_shape_takes_the_tightest_limit_per_node() -> None:
    """Per node: the least of cpu, memory (both x overcommit ratio), disk and the count cap;
    nodes without the isolation add nothing."""
    nodes = [_node(cpu=2, max_sandboxes=100), _node(max_sandboxes=3), _node(isolation=("gvisor",))]
    assert max_of_shape(nodes, 0.5, 1 << 30, 1 << 30, "container", 1.0) == 4 + 3
    assert max_of_shape(nodes, 0.5, 1 << 30, 1 << 30, "container", 1.5) == 6 + 3
    assert max_of_shape(nodes, 0.1, 1 << 30, 60 << 30, "container", 1.0) == 1 + 1


def test_room_now_counts_every_member_on_copies() -> None:
    """The whole group must fit on the healthy nodes' free room (greedy, several per node);
    an unhealthy or overloaded node offers none; nothing is changed on the nodes."""
    a = _node(cpu=1.0, used=(0.5, 0, 0, 0))
    b = _node(max_sandboxes=2, used=(0.0, 0, 0, 1))
    assert room_now([a, b], 3, 0.25, 1 << 20, 1 << 20, "container", 1.0, 0.85)  # 2 on a, 1 on b
    assert not room_now([a, b], 4, 0.25, 1 << 20, 1 << 20, "container", 1.0, 0.85)
    assert a.used_cpu == 0.5 and b.count == 1
    assert not room_now([_node(healthy=False)], 1, 0.1, 1, 1, "container", 1.0, 0.85)
    assert not room_now([_node(predicted=0.9)], 1, 0.1, 1, 1, "container", 1.0, 0.85)
    assert room_now([], 0, 0.1, 1, 1, "container", 1.0, 0.85)
