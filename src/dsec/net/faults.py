"""Fault points for crash tests: ``DSEC_NET_FAULT=<point>`` makes the process SIGKILL
itself when it reaches that point, so tests can prove reconcile cleans up after a crash
at every step of building, attaching and detaching a slot."""

from __future__ import annotations

import os
import signal

ENV = "DSEC_NET_FAULT"
POINTS = ("slot.recorded", "slot.netns", "slot.links", "slot.host", "slot.nft",
          "attach.recorded", "attach.nft", "detach.recorded", "detach.nft", "detach.links")


def fault(point: str) -> None:
    if os.environ.get(ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)
