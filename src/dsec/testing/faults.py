"""Named fault points for crash-safety tests and drills.

Production code calls ``fault_point("ckpt.after_parts")`` between the writes of a
crash-sensitive protocol. Normally that is one dict lookup. A test (or ``dsec drill``)
arms a point either in-process with :func:`arm` or in a child process through the
``DSEC_FAULTS`` environment variable, e.g.::

    DSEC_FAULTS="ckpt.after_parts=exit"            # os._exit at the first hit
    DSEC_FAULTS="blob.local.mid_write=raise@3"     # raise FaultInjected at the 3rd hit
    DSEC_FAULTS="a=kill,b=raise"                   # several points

Actions: ``raise`` (FaultInjected, an in-process failure the caller must survive),
``exit`` (``os._exit(FAULT_EXIT_CODE)``: the process dies with no cleanup, like a power
cut for everything not yet fsynced) and ``kill`` (SIGKILL to self).
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_EXIT_CODE = 97
ENV_VAR = "DSEC_FAULTS"
ACTIONS = ("raise", "exit", "kill")


class FaultInjected(RuntimeError):
    """Raised by an armed fault point whose action is ``raise``."""


class _Armed:
    __slots__ = ("action", "at", "hits")

    def __init__(self, action: str, at: int) -> None:
        self.action, self.at, self.hits = action, at, 0


_lock = threading.Lock()
_armed: dict[str, _Armed] = {}
_env_loaded: str | None = None


def parse_spec(spec: str) -> dict[str, tuple[str, int]]:
    """Parse ``name=action[@n],...`` into {name: (action, n)}; raise ValueError if malformed."""
    out: dict[str, tuple[str, int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, rest = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{ENV_VAR}: entry {item!r} must look like name=action[@n]")
        action, _, nth = rest.partition("@")
        if action not in ACTIONS:
            raise ValueError(f"{ENV_VAR}: action {action!r} of {name!r} must be one of {ACTIONS}")
        try:
            at = int(nth) if nth else 1
        except ValueError:
            raise ValueError(f"{ENV_VAR}: hit count {nth!r} of {name!r} is not an integer") from None
        if at < 1:
            raise ValueError(f"{ENV_VAR}: hit count of {name!r} must be >= 1")
        out[name] = (action, at)
    return out


def _load_env() -> None:
    global _env_loaded
    spec = os.environ.get(ENV_VAR, "")
    if spec == _env_loaded:
        return
    _env_loaded = spec
    for name, (action, at) in parse_spec(spec).items():
        _armed[name] = _Armed(action, at)


def arm(name: str, action: str = "raise", at: int = 1) -> None:
    """Arm ``name`` in this process: fire ``action`` at its ``at``-th hit (then disarm)."""
    if action not in ACTIONS:
        raise ValueError(f"fault action {action!r} must be one of {ACTIONS}")
    with _lock:
        _armed[name] = _Armed(action, at)


def disarm_all() -> None:
    with _lock:
        _armed.clear()


def fault_point(name: str) -> None:
    """Fire the fault armed at ``name``, if any. Cheap when nothing is armed."""
    if not _armed and not os.environ.get(ENV_VAR):
        return
    with _lock:
        _load_env()
        armed = _armed.get(name)
        if armed is None:
            return
        armed.hits += 1
        if armed.hits < armed.at:
            return
        del _armed[name]
    if armed.action == "exit":
        os._exit(FAULT_EXIT_CODE)
    if armed.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise FaultInjected(f"fault injected at {name!r}")
