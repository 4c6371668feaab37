"""Pure fencing decisions: epochs, stale owners, units written by a fenced owner."""

from __future__ import annotations

from dsec.checkpoints.fencing import Fence, OwnerRecord, decide, next_epoch, valid_units


def test_next_epoch_is_above_the_record_and_every_unit():
    """A new owner's epoch beats the owner record and every unit's writer (a lost or
    corrupt owner record cannot hand out an epoch that was already used)."""
    assert next_epoch(None, []) == 1
    assert next_epoch(3, [1, 2]) == 4
    assert next_epoch(None, [5, 2]) == 6
    assert next_epoch(2, [7]) == 8


def test_decide_fences_older_epochs_and_superseded_servers():
    """Same epoch or a non-fencing caller may write; an older epoch is a stale client; a
    newer request epoch or a newer owner record in the store means this server is stale."""
    assert decide(3, 3) is Fence.OK
    assert decide(None, 3) is Fence.OK
    assert decide(2, 3) is Fence.STALE_CLIENT
    assert decide(4, 3) is Fence.STALE_SERVER
    assert decide(3, 3, stored_epoch=3) is Fence.OK
    assert decide(None, 3, stored_epoch=4) is Fence.STALE_SERVER
    assert decide(3, 3, stored_epoch=None) is Fence.OK


def test_units_of_a_fenced_writer_are_not_restorable():
    """Ordered by (seq, epoch), a unit written after a newer owner's unit is invalid; a
    stale unit at the same seq as the new owner's loses to it; older history stays valid."""
    units = [(10, 1), (11, 1), (11, 2), (12, 1), (13, 2)]
    assert valid_units(units) == [True, True, True, False, True]
    assert valid_units([(3, 2), (1, 1), (2, 1)]) == [True, True, True]
    assert valid_units([(5, 0), (6, 0)]) == [True, True]          # units from before fencing
    assert valid_units([]) == []


def test_owner_record_roundtrip_and_garbage():
    """The owner record decodes back; garbage decodes to None (treated as absent)."""
    rec = OwnerRecord(epoch=4, opened_at=1.5)
    assert OwnerRecord.decode(rec.encode()) == rec
    assert OwnerRecord.decode(b"\x00garbage") is None
    assert OwnerRecord.decode(b'{"epoch": 0}') is None
