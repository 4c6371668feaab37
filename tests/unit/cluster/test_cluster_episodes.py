"""The control plane's side of episodes on a cluster (dsec.cluster.episodes), over node
stand-ins that keep one shared log per episode (what the shared checkpoint store gives the
real per-node engines): an episode whose node is lost is opened again on another node,
a step in flight at the loss is retried there under its index and runs once, the client
keeps its epoch, a stale epoch is fenced, and a failed move answers NodeLost at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from dsec import errors
from dsec.cluster.episodes import ClusterEpisodes
from dsec.cluster.membership import NodeState
from dsec.config import Settings
from dsec.models import SandboxInfo, SandboxSpec
from dsec.models.episode import EpisodeInfo, StepResult

N = NodeState


class _Shared:
    """The shared store: per episode, the logged steps and the newest owner epoch."""

    def __init__(self) -> None:
        self.logs: dict[str, list[str]] = {}
        self.epochs: dict[str, int] = {}
        self.ran: list[tuple[str, int, str]] = []  # (node, step, cmd) of every live run


class _Node:
    """A node's episode engine, reduced to what the control plane relies on."""

    def __init__(self, nid: str, shared: _Shared) -> None:
        self.node_id, self.shared = nid, shared
        self.live: dict[str, int] = {}  # episode key -> the epoch this node holds
        self.dead = False
        self.hang: asyncio.Event | None = None  # a step that hangs until the node is lost

    async def episode(self, op: str, key: str, args: dict[str, Any]) -> Any:
        if self.dead:
            raise errors.NodeLost(f"node {self.node_id} lost", node=self.node_id)
        sh = self.shared
        if op == "open":
            sh.epochs[key] = self.live[key] = sh.epochs.get(key, 0) + 1
            log = sh.logs.setdefault(key, [])
            sid = args.get("sandbox_id") or "sb-x"
            info = EpisodeInfo(id=key, epoch=self.live[key], steps=len(log), seq=0, sandbox_id=sid, fs_digest="",
                               has_context=False)
            return {"episode": info, "sandbox": SandboxInfo.model_validate(
                {"id": sid, "state": "running", "image": "busybox", "node": self.node_id, "created_at": 0.0,
                 "cpu": 1, "memory": 1, "disk": 1, "pids": 1, "timeout": 60})}
        assert op == "step", op
        if args.get("epoch") != self.live[key] or sh.epochs[key] != self.live[key]:
            raise errors.EpisodeFenced(f"stale epoch {args.get('epoch')} on {self.node_id}")
        log, n, cmd = sh.logs[key], int(args["step"]), args["request"].cmd
        if n < len(log):
            return StepResult(step=n, replayed=True, exit_code=0, stdout=log[n])
        if self.hang is not None:
            await self.hang.wait()
            raise errors.NodeLost(f"node {self.node_id} lost", node=self.node_id)
        sh.ran.append((self.node_id, n, cmd))
        log.append(f"{cmd}@{self.node_id}")
        return StepResult(step=n, exit_code=0, stdout=log[n])


class _Sandboxes:
    """SandboxService.create_as without a scheduler: admission aside, the creator runs."""

    def __init__(self) -> None:
        self.reaped_ids: list[str] = []
        self.fail = False

    async def create_as(self, tenant: Any, spec: SandboxSpec, sandbox_id: str, creator: Any) -> SandboxInfo:
        if self.fail:
            raise errors.CapacityExhausted("no room anywhere", retry_after=1.0)
        return await creator(spec, sandbox_id, tenant.name)  # type: ignore[no-any-return]

    async def reaped(self, sandbox_id: str, why: str) -> None:
        self.reaped_ids.append(sandbox_id)


def _cluster(tmp_path: Any) -> tuple[ClusterEpisodes, dict[str, _Node], Any, _Sandboxes]:
    shared = _Shared()
    nodes = {"a": _Node("a", shared), "b": _Node("b", shared)}
    router = SimpleNamespace(agents=nodes, states={"a": N.ready, "b": N.draining})  # opens land on a
    sandboxes = _Sandboxes()
    s = Settings(home=tmp_path, cluster_node_lost_after_s=0.5, cluster_heartbeat_timeout_s=0.1, api_create_wait_s=1.0)
    from dsec.blobs.local import LocalBlobStore  # empty: the stand-ins keep the logs

    eps = ClusterEpisodes(s, store=LocalBlobStore(tmp_path / "blobs"), router=router, services=SimpleNamespace(sandboxes=sandboxes, scheduler=None))
    return eps, nodes, router, sandboxes


def _req(cmd: str) -> Any:
    from dsec.models import ExecRequest
    return ExecRequest(cmd=cmd)


async def test_lost_nodes_episode_moves_and_its_inflight_step_runs_once(tmp_path: Any) -> None:
    """Steps 0-1 on a; step 2 hangs there when a dies. The heartbeat's loss moves the episode
    to b; the in-flight call is retried on b under index 2 and answers; it ran once (on b),
    steps 0-1 were never re-run, the client's epoch still works, a stale one is fenced, the
    sandbox left on a is recorded as reaped."""
    from dsec.checkpoints.host import EPISODE_TENANT

    eps, nodes, router, sandboxes = _cluster(tmp_path)
    EPISODE_TENANT.set(SimpleNamespace(name="t", uid="u"))
    ep = await eps.open("u--ep", SandboxSpec(image="busybox"))
    assert eps.where["u--ep"] == "a"
    router.states["b"] = N.ready
    for i in range(2):
        await eps.step("u--ep", i, _req(f"c{i}"), ep.epoch)
    nodes["a"].hang = asyncio.Event()
    inflight = asyncio.ensure_future(eps.step("u--ep", 2, _req("c2"), ep.epoch))
    await asyncio.sleep(0.05)
    nodes["a"].dead = True
    router.states["a"] = N.lost
    eps.on_node_lost("a")  # what Heartbeats._lose calls
    nodes["a"].hang.set()  # the proxy fails the call in flight with NodeLost
    res = await asyncio.wait_for(inflight, 2)
    assert res.stdout == "c2@b" and not res.replayed
    assert eps.where["u--ep"] == "b" and eps.moved["u--ep"]["to"] == "b"
    assert nodes["a"].shared.ran == [("a", 0, "c0"), ("a", 1, "c1"), ("b", 2, "c2")]
    assert (await eps.step("u--ep", 1, _req("c1"), ep.epoch)).replayed  # the log answers
    assert sandboxes.reaped_ids == [ep.sandbox_id]
    with pytest.raises(errors.EpisodeFenced):
        await eps.step("u--ep", 3, _req("c3"), ep.epoch - 1)


async def test_a_failed_move_answers_node_lost_not_a_hang(tmp_path: Any) -> None:
    """No node can take the episode: the call that found its node lost answers NodeLost
    naming the cause, well within the wait budget; a later open places it again."""
    from dsec.checkpoints.host import EPISODE_TENANT

    eps, nodes, router, sandboxes = _cluster(tmp_path)
    EPISODE_TENANT.set(SimpleNamespace(name="t", uid="u"))
    ep = await eps.open("u--ep", SandboxSpec(image="busybox"))
    nodes["a"].dead = True
    router.states["a"] = N.lost
    sandboxes.fail = True
    eps.on_node_lost("a")
    with pytest.raises(errors.NodeLost) as e:
        await asyncio.wait_for(eps.step("u--ep", 0, _req("c0"), ep.epoch), 1.5)
    assert "no room anywhere" in e.value.message
    sandboxes.fail = False
    router.states["b"] = N.ready
    again = await eps.open("u--ep")
    assert eps.where["u--ep"] == "b" and again.epoch > ep.epoch
    assert (await eps.step("u--ep", 0, _req("c0"), again.epoch)).stdout == "c0@b"
