"""DeniedTally: how a sandbox's refused connection attempts are bounded for its audit log."""

from __future__ import annotations

from dsec.net.denied import DeniedTally, itemized_fields
from dsec.net.models import DeniedAttempt


def _ev(seq: int, dst: str = "10.0.0.1", port: int | None = 80, proto: str = "tcp",
        target: str = "remote") -> DeniedAttempt:
    return DeniedAttempt(time=1000.0 + seq, destination=dst, protocol=proto, port=port, target=target, seq=seq)


def test_first_attempt_per_destination_itemized_repeats_counted() -> None:
    """Only the first attempt to a destination becomes a record; repeats only count."""
    t = DeniedTally(max_distinct=10)
    new = t.add([_ev(1), _ev(2), _ev(3, port=443), _ev(4)])
    assert [(e.seq, e.port) for e in new] == [(1, 80), (3, 443)]
    assert t.total == 4
    s = t.summary()
    assert s["counts"][0] == {"destination": "10.0.0.1", "protocol": "tcp", "port": 80, "target": "remote",
                              "count": 3}
    assert s["destinations"] == 2 and s["not_itemized"] == 0


def test_cap_bounds_records_and_counts_the_rest() -> None:
    """Past max_distinct destinations nothing more is itemized or keyed (a port scan
    cannot grow the log or the tally); the attempts are still counted."""
    t = DeniedTally(max_distinct=2)
    new = t.add([_ev(i, port=1000 + i) for i in range(1, 101)])
    assert [e.port for e in new] == [1001, 1002]
    assert len(t.counts) == 2
    assert (t.total, t.not_itemized) == (100, 98)
    assert t.add([_ev(101, port=1001)]) == []  # a known destination still counts
    assert t.summary()["counts"][0]["count"] == 2


def test_resume_ignores_seen_and_out_of_order_events() -> None:
    """Re-reading overlapping batches (poll, then teardown) never double-counts."""
    t = DeniedTally(max_distinct=5)
    t.add([_ev(2), _ev(1)])
    assert t.last_seq == 2
    new = t.add([_ev(1), _ev(2), _ev(3, dst="10.0.0.2")])
    assert [e.seq for e in new] == [3]
    assert t.total == 3


def test_distinct_by_protocol_and_target() -> None:
    """Same address and port over UDP, or to the host, are separate destinations."""
    t = DeniedTally(max_distinct=5)
    new = t.add([_ev(1), _ev(2, proto="udp"), _ev(3, target="host"), _ev(4, port=None, proto="icmp")])
    assert len(new) == 4


def test_itemized_fields_name_destination_port_time() -> None:
    """An itemized record says where, which port and protocol, and when."""
    f = itemized_fields(_ev(7, dst="192.0.2.9", port=22))
    assert f == {"destination": "192.0.2.9", "port": 22, "protocol": "tcp", "target": "remote", "time": 1007.0}


def test_summary_top_limits_and_orders() -> None:
    """The summary ranks destinations by count (most refused first) and can be cut."""
    t = DeniedTally(max_distinct=5)
    t.add([_ev(1, port=1), _ev(2, port=2), _ev(3, port=2), _ev(4, port=3), _ev(5, port=3), _ev(6, port=3)])
    assert [c["port"] for c in t.summary(top=2)["counts"]] == [3, 2]
