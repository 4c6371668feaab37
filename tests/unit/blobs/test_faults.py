"""Fault-point spec parsing and firing rules."""

from __future__ import annotations

import pytest

from dsec.testing import faults


def test_parse_spec():
    """name=action[@n] entries parse; malformed ones are refused with a clear message."""
    assert faults.parse_spec("a=exit, b=raise@3") == {"a": ("exit", 1), "b": ("raise", 3)}
    for bad in ("a", "a=boom", "a=raise@x", "a=raise@0", "=raise"):
        with pytest.raises(ValueError):
            faults.parse_spec(bad)


def test_fires_at_nth_hit_once(monkeypatch):
    """An armed point fires exactly at its n-th hit and then disarms itself."""
    faults.arm("p", "raise", at=2)
    faults.fault_point("p")
    with pytest.raises(faults.FaultInjected):
        faults.fault_point("p")
    faults.fault_point("p")
    faults.fault_point("unarmed")
