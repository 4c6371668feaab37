"""Fencing through the engine: two owners of one episode, only the newest may write."""

from __future__ import annotations

import asyncio

import pytest
from ckpt_agent import command, make_engine

from dsec import errors
from dsec.checkpoints.unit import UnitMeta, commit_unit, complete_units
from dsec.models import ExecRequest, SandboxSpec
from dsec.node import syscalls

pytestmark = pytest.mark.integration



def _req(i: int) -> ExecRequest:
    return ExecRequest(cmd=command(i))


def test_stale_client_on_the_same_server_is_fenced(work):
    """A client that re-opens the episode takes it over: the old handle's step, context,
    checkpoint and close are refused with EpisodeFenced and nothing of it is logged; the
    new owner continues from the same log."""
    eng = make_engine(work)

    async def go():
        old = await eng.open("ep", SandboxSpec(image="bb"))
        await eng.step("ep", 0, _req(0), old.epoch)
        new = await eng.open("ep")                       # the client 'thought dead' is replaced
        assert new.epoch > old.epoch and new.steps == 1
        with pytest.raises(errors.EpisodeFenced) as ei:
            await eng.step("ep", 1, _req(1), old.epoch)
        assert "newer owner" in str(ei.value)
        for call in (eng.save_context("ep", {"x": 1}, old.epoch), eng.checkpoint("ep", "w", None, old.epoch),
                     eng.close("ep", old.epoch)):
            with pytest.raises(errors.EpisodeFenced):
                await call
        assert (await eng.info("ep")).steps == 1 and await eng.context("ep") is None
        r = await eng.step("ep", 1, _req(1), new.epoch)
        assert not r.replayed and r.stdout.strip() == "2"   # /work/log: two writing steps, once each
        await eng.close("ep", new.epoch)
    asyncio.run(go())


def test_stale_server_cannot_commit_after_another_server_resumed(work):
    """Server A holds the episode; server B (same store, its own node) resumes it. A's
    next write sees B's owner record and is fenced before its metadata is written; A
    drops its copy and sandbox; B's log holds exactly the steps acknowledged to anyone."""
    a = make_engine(work)
    b = make_engine(work)
    b.host.root = work / "sbx-b"   # B is another node: its own sandboxes
    b.host.root.mkdir()

    async def go():
        ia = await a.open("ep", SandboxSpec(image="bb"))
        for i in range(2):
            await a.step("ep", i, _req(i), ia.epoch)
        ib = await b.open("ep")
        assert ib.resumed and ib.steps == 2 and ib.epoch > ia.epoch
        with pytest.raises(errors.EpisodeFenced) as ei:
            await a.step("ep", 2, _req(2), ia.epoch)
        assert "resumed elsewhere" in str(ei.value)
        assert "ep" not in a._live                        # A forgot its superseded copy
        with pytest.raises(errors.NotFound):
            await a.step("ep", 2, _req(2), ia.epoch)
        for i in range(2, 4):
            r = await b.step("ep", i, _req(i), ib.epoch)
            assert not r.replayed
        units = complete_units(b.store, "ep")
        assert units[0].steps == 4 and units[0].epoch == ib.epoch
        assert all(u.epoch in (ia.epoch, ib.epoch) for u in units)
        await b.close("ep", ib.epoch)
    asyncio.run(go())
    assert syscalls.mounts_under(str(work / "sbx")) == []   # A's sandbox was destroyed


def test_a_stale_unit_that_slipped_past_the_checks_is_never_restored(work):
    """If a stale owner's unit lands after the new owner's (the check-then-write race of
    a store without compare-and-swap), restore ignores it and resumes from the new
    owner's newest unit."""
    eng = make_engine(work)

    async def go():
        i1 = await eng.open("ep", SandboxSpec(image="bb"))
        await eng.step("ep", 0, _req(0), i1.epoch)
        await eng.forget("ep")
        i2 = await eng.open("ep")
        await eng.step("ep", 1, _req(1), i2.epoch)
        newest = complete_units(eng.store, "ep")[0]
        # The stale owner's write: a later seq, its old epoch, claiming a different history.
        stale = UnitMeta.model_validate({**newest.model_dump(), "seq": newest.seq + 1, "epoch": i1.epoch,
                                         "meta": {"stale": True}})
        stale.inline = newest.inline
        commit_unit(eng.store, stale)
        await eng.forget("ep")
        i3 = await eng.open("ep")
        assert i3.steps == 2 and i3.epoch > i2.epoch and i3.seq == newest.seq
        assert "stale" not in eng._live["ep"].user_meta
        assert complete_units(eng.store, "ep")[0].epoch == i1.epoch   # it is there, and skipped
        r = await eng.step("ep", 2, _req(2), i3.epoch)
        assert r.stdout.strip() == "2"
        await eng.close("ep", i3.epoch)
    asyncio.run(go())
