"""Group admission through a real server (issue 16): all or none under contention (two
groups racing for the last room on a node that holds 6 sandboxes), a queued group is
admitted when room frees, warm pools serve groups, bad sizes are refused at submit."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from e2e_server import Server, running_server

from dsec.errors import InvalidArgument, Overloaded
from dsec.sdk import AsyncClient, AsyncSandbox, Client, Sandbox

pytestmark = pytest.mark.integration

SHAPE = {"cpu": 0.1, "memory": "64M"}


@pytest.fixture(scope="module")
def gserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "dsec-groups", {"DSEC_NODE_MAX_SANDBOXES": "6",
                                                          "DSEC_API_CREATE_WAIT_S": "5"}) as srv:
        yield srv


def _live(server: Server) -> list[str]:
    with Client(server.url, server.token) as c:
        return [i.id for i in c.list()]


def test_group_sizes_refused_at_submit(gserver: Server) -> None:
    """n=0 and a group larger than the node could ever hold are 422 naming the reason."""
    with Client(gserver.url, gserver.token, retries=0) as c:
        with pytest.raises(InvalidArgument, match="1 to"):
            Sandbox.create_group(0, client=c, **SHAPE)
        with pytest.raises(InvalidArgument, match="at most 6"):
            Sandbox.create_group(7, client=c, **SHAPE)
    assert _live(gserver) == []


def test_two_groups_race_for_the_last_room(gserver: Server) -> None:
    """Two groups of 4 submitted at once on a node with room for 6: exactly one is admitted
    whole, the other gets 429 (queue position, ETA) with none of its sandboxes left behind
    at any moment; once the winner is gone the loser is admitted whole."""
    results: dict[str, object] = {}
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the live count never shows a half group of the loser
        while not stop.is_set():
            peak[0] = max(peak[0], len(_live(gserver)))
            time.sleep(0.05)

    def run(name: str) -> None:
        with Client(gserver.url, gserver.token, retries=0) as c:
            try:
                results[name] = Sandbox.create_group(4, client=c, wait_s=3, labels={"g": name}, **SHAPE)
            except Overloaded as e:
                results[name] = e

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    w.join()
    won = [n for n, r in results.items() if isinstance(r, list)]
    lost = [n for n, r in results.items() if isinstance(r, Overloaded)]
    assert len(won) == 1 and len(lost) == 1, results
    winners = results[won[0]]
    assert isinstance(winners, list) and len(winners) == 4
    err = results[lost[0]]
    assert isinstance(err, Overloaded) and "all or none" in err.message and "eta_s" in err.details
    assert sorted(_live(gserver)) == sorted(s.id for s in winners)
    assert peak[0] <= 6
    print(f"race: group {won[0]} admitted, group {lost[0]} refused: {err.message}")
    for s in winners:
        s.kill()
    with Client(gserver.url, gserver.token) as c:
        again = Sandbox.create_group(4, client=c, wait_s=20, **SHAPE)
        assert len(again) == 4
        for s in again:
            s.kill()


def test_queued_group_admitted_when_room_frees(gserver: Server) -> None:
    """A group that does not fit waits as one unit (creating nothing; GET /v1/groups shows
    its one position and ETA) and is admitted whole as soon as room frees within its deadline."""
    with Client(gserver.url, gserver.token) as c:
        first = Sandbox.create_group(4, client=c, **SHAPE)
        out: dict[str, object] = {}

        def second() -> None:
            t0 = time.monotonic()
            out["sbs"] = Sandbox.create_group(4, client=c, wait_s=30, **SHAPE)
            out["took"] = time.monotonic() - t0

        th = threading.Thread(target=second)
        th.start()
        time.sleep(2.0)
        assert sorted(_live(gserver)) == sorted(s.id for s in first)  # the waiting group made nothing
        with httpx.Client(base_url=gserver.url, headers={"authorization": f"Bearer {gserver.token}"}) as h:
            (queued,) = h.get("/v1/groups").json()  # one unit: one position, one ETA
        assert queued["n"] == 4 and queued["position"] == 0 and queued["eta_s"] > 0 and queued["waited_s"] >= 1.5
        for s in first:
            s.kill()
        th.join(60)
        sbs = out["sbs"]
        assert isinstance(sbs, list) and len(sbs) == 4 and float(out["took"]) >= 2.0  # type: ignore[arg-type]
        assert sorted(_live(gserver)) == sorted(s.id for s in sbs)
        for s in sbs:
            s.kill()


def test_warm_pool_serves_a_group_and_async(gserver: Server) -> None:
    """With a warm pool of the shape, an async group of 3 is handed pool members (made
    before the call: their creation time says so)."""
    with httpx.Client(base_url=gserver.url, headers={"authorization": f"Bearer {gserver.token}"}) as h:
        h.put("/v1/pools", json={"spec": {"image": "busybox", **SHAPE}, "size": 3})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pools = h.get("/v1/pools").json()["pools"]
            if any(p["ready"] >= 3 for p in pools):
                break
            time.sleep(0.3)
        members = {m["id"] for m in h.get("/v1/sandboxes").json()}  # own sandboxes: none

        async def run() -> list[AsyncSandbox]:
            async with AsyncClient(gserver.url, gserver.token) as c:
                return await AsyncSandbox.create_group(3, client=c, **SHAPE)

        t0, wall0 = time.monotonic(), time.time()
        sbs = asyncio.run(run())
        took = time.monotonic() - t0
        try:
            assert len(sbs) == 3 and not members
            assert all(s.info.created_at < wall0 for s in sbs), [s.info for s in sbs]  # pool members, made before
            after = h.get("/v1/pools").json()["pools"]
            print(f"group of 3 from a warm pool: {took * 1000:.0f} ms; pools after: {after}")
        finally:
            h.put("/v1/pools", json={"spec": {"image": "busybox", **SHAPE}, "size": 0})
            with Client(gserver.url, gserver.token) as c:
                for s in sbs:
                    c.kill(s.id)
