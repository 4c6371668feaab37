"""ep.fork() through a real server (issue 16): the fork's log is the parent's history, its
sandbox starts from the parent's files, the two then diverge; re-opening the fork replays
the shared history; ids that exist and stale owners are refused."""

from __future__ import annotations

import io
import uuid

import pytest
import zstandard
from e2e_server import Server

from dsec import errors
from dsec.sdk import Client
from dsec.sdk.episode import Episode

pytestmark = pytest.mark.integration


def test_fork_shares_history_and_diverges(server: Server) -> None:
    """Two logged steps, then a fork: the fork sees the files, continues at step 2, and
    neither episode sees the other's later writes; the fork's export holds the parent's
    steps; opening the fork again replays them (nothing re-run)."""
    eid = "ep-" + uuid.uuid4().hex[:10]
    with Client(server.url, server.token) as c:
        ep = Episode.open(eid, image="busybox", cpu=0.25, memory="128M", client=c)
        try:
            ep.exec("echo one > /tmp/w")
            ep.exec("echo two >> /tmp/w")
            child = ep.fork()
            try:
                assert child.id != ep.id and child.info.steps == 2 and child.step == 2
                r = child.exec("echo child >> /tmp/w; cat /tmp/w")
                assert (r.step, r.replayed, r.stdout) == (2, False, "one\ntwo\nchild\n")
                assert ep.exec("echo parent >> /tmp/w; cat /tmp/w").stdout == "one\ntwo\nparent\n"
                assert child.exec("cat /tmp/w").stdout == "one\ntwo\nchild\n"
                log = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(child.export()),
                                                                  read_across_frames=True).read().decode()
                assert "echo one" in log and "echo two" in log and "echo parent" not in log
                with pytest.raises(errors.Conflict):
                    ep.fork(new_id=child.id)
            finally:
                child.close()
            again = Episode.open(child.id, image="busybox", client=c)  # resume the fork from its units
            try:
                first = again.exec("echo one > /tmp/w")
                assert first.replayed and first.step == 0
            finally:
                again.close()
            stale = Episode(ep.info, c)  # another handle takes ownership: this one is fenced
            Episode.open(eid, image="busybox", client=c)
            with pytest.raises(errors.EpisodeFenced):
                stale.fork()
        finally:
            Episode.open(eid, image="busybox", client=c).close()
