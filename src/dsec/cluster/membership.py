"""Node states on a cluster: the one table of allowed transitions, and the pure
heartbeat judgement (is a node lost?).

The control plane probes every node agent (``NodeAgent.health`` with a short timeout)
every ``cluster_heartbeat_interval_s``; a node whose last good answer is older than
``cluster_node_lost_after_s``, or whose Ray node is dead, is ``lost``: its sandboxes
answer NodeLost (410) at once, the scheduler stops placing there and releases their
capacity. The other way round, a lost node that answers again is told what the control
plane gave up (its sandboxes at the time of the loss) and destroys them before it is
``ready`` again: nothing leaks, nothing the clients were told is gone comes back.
"""

from __future__ import annotations

from enum import Enum

from dsec.errors import Conflict


class NodeState(str, Enum):
    ready = "ready"
    draining = "draining"
    lost = "lost"


N = NodeState

NODE_TRANSITIONS: dict[NodeState, dict[NodeState, str]] = {
    N.ready: {
        N.draining: "`dsec node drain`: no new placements; running sandboxes finish or migrate",
        N.lost: "no good heartbeat within cluster_node_lost_after_s, or its Ray node died",
    },
    N.draining: {
        N.ready: "drain cancelled (undrain)",
        N.lost: "no good heartbeat within cluster_node_lost_after_s, or its Ray node died",
    },
    N.lost: {
        N.ready: "answers heartbeats again and destroyed what the control plane gave up",
    },
}


def can_transition(current: NodeState, target: NodeState) -> bool:
    return target in NODE_TRANSITIONS[current]


def check_transition(node_id: str, current: NodeState, target: NodeState) -> None:
    """Raise Conflict naming the node when ``current -> target`` is not allowed."""
    if not can_transition(current, target):
        allowed = ", ".join(s.value for s in NODE_TRANSITIONS[current]) or "none"
        raise Conflict(f"node {node_id} is {current.value}; cannot become {target.value} (allowed: {allowed})",
                       node=node_id, state=current.value)


def is_lost(ray_alive: bool | None, last_ok: float, now: float, lost_after_s: float) -> bool:
    """Pure: a node is lost when Ray says its node is dead, or when its agent has not
    answered a heartbeat for ``lost_after_s`` (raylet or machine gone: Ray itself takes
    tens of seconds to notice). ``ray_alive`` None: Ray's view is unknown this pass."""
    return ray_alive is False or now - last_ok > lost_after_s


def placeable(state: NodeState) -> bool:
    """Only a ready node takes new sandboxes."""
    return state is NodeState.ready
