"""Sandbox lifecycle: the one table of allowed transitions (pure).

Persisted states are written to the node's state DB *before* the side effects of the
transition happen, so a restarted node agent knows what might exist and cleans or
adopts it. ``running`` vs ``idle`` is a live refinement (a command is executing or
not): it changes on every exec, so it is tracked in memory and reported, not persisted.
"""

from __future__ import annotations

from dsec.errors import Conflict
from dsec.models import SandboxState as S

TRANSITIONS: dict[S, dict[S, str]] = {
    S.creating: {
        S.ready: "runtime started and the exec agent answered",
        S.failed: "a creation step failed; resources are cleaned by stopping",
        S.stopping: "destroy requested or node restart found it half-made",
    },
    S.ready: {
        S.idle: "handed to a user (warm-pool claim or direct create); TTL starts now",
        S.stopping: "pool member expired, destroyed, or found dead",
    },
    S.idle: {
        S.running: "a command started",
        S.stopping: "killed, TTL expired, lease lost, or found dead",
    },
    S.running: {
        S.idle: "the last running command ended",
        S.stopping: "killed, TTL expired, lease lost, or found dead",
    },
    S.stopping: {
        S.stopped: "processes, mounts, cgroups and network released",
        S.failed: "cleanup hit an error; the reconciler retries it",
    },
    S.failed: {
        S.stopping: "cleanup (re)started",
    },
    S.stopped: {
        S.destroyed: "record retired after the audit retention period",
    },
    S.destroyed: {},
}

LIVE_STATES = frozenset({S.creating, S.ready, S.idle, S.running})
PERSISTED_STATES = frozenset(S) - {S.running}


def can_transition(current: S, target: S) -> bool:
    return target in TRANSITIONS[current]


def check_transition(sandbox_id: str, current: S, target: S) -> None:
    """Raise Conflict naming the sandbox when ``current -> target`` is not allowed."""
    if not can_transition(current, target):
        allowed = ", ".join(s.value for s in TRANSITIONS[current]) or "none"
        raise Conflict(
            f"sandbox {sandbox_id} is {current.value}; cannot become {target.value} (allowed: {allowed})",
            sandbox_id=sandbox_id, state=current.value,
        )


def persisted(state: S) -> S:
    """The state written to disk for a live state (running is stored as idle)."""
    return S.idle if state is S.running else state
