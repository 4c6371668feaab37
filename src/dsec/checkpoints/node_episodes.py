"""Episodes run on a node for a control plane on another machine (``dsec serve --cluster``).

The episode engine (``EpisodeEngine``) captures a step's filesystem from the sandbox's
overlay upper dir and builds restored sandboxes on checkpoint layers: both are local to
the node that holds the sandbox. On a cluster each node therefore runs its own engine
over its own agent, writing units to the SHARED checkpoint store; the control plane
(dsec.cluster.episodes) places an episode on a node, forwards its calls there, and after
a node loss opens it again on another node, where this engine restores it from the last
unit (the log decides what already ran: nothing executes twice).

Ownership: this engine has no state store, so epochs are the blob store's owner record;
the control plane serializes the opens of one episode, and a node that was given up but
still runs is fenced at its next unit (the store's owner epoch is above its own).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dsec import errors
from dsec.checkpoints.engine import EpisodeEngine
from dsec.checkpoints.host import EPISODE_TENANT
from dsec.models import ExecRequest, SandboxSpec

OPS = ("open", "step", "save_context", "context", "checkpoint", "resume", "info", "close")


class NodeEpisodes:
    """``episode(op, key, args)`` of ``LocalNodeAgent``: one engine per node, made on first use."""

    def __init__(self, agent: Any) -> None:
        from dsec.blobs import open_checkpoint_store
        from dsec.checkpoints.nodehost import NodeEpisodeHost

        self.agent = agent
        self.engine = EpisodeEngine(agent.settings, open_checkpoint_store(agent.settings), NodeEpisodeHost(agent))

    async def call(self, op: str, key: str, args: dict[str, Any]) -> Any:
        if op not in OPS:
            raise errors.InvalidArgument(f"episode operation {op!r} is not one of {', '.join(OPS)}", field="op")
        eng = self.engine
        if op == "open":
            fence = getattr(self.agent, "fence", None)  # placed by a scheduler leader: its token
            if fence is not None:
                fence.check(args.get("fence"), f"opening episode {key.split('--', 1)[-1]!r}")
            # The sandbox it makes carries the tenant's name like any other on this node.
            tenant = args.get("tenant")
            EPISODE_TENANT.set(SimpleNamespace(name=tenant) if tenant else None)
            spec = args.get("spec")
            info = await eng.open(key, SandboxSpec.model_validate(spec) if spec is not None else None,
                                  sandbox_id=args.get("sandbox_id"))
            sandbox = await self.agent.get(info.sandbox_id) if info.sandbox_id else None
            return {"episode": info, "sandbox": sandbox}
        if op == "step":
            return await eng.step(key, int(args["step"]), ExecRequest.model_validate(args["request"]),
                                  args.get("epoch"))
        if op == "save_context":
            return await eng.save_context(key, args.get("context"), args.get("epoch"))
        if op == "context":
            return await eng.context(key)
        if op == "checkpoint":
            return await eng.checkpoint(key, args.get("weights_ref"), args.get("meta") or {}, args.get("epoch"))
        if op == "resume":
            return await eng.resume(key)
        if op == "info":
            return await eng.info(key)
        await eng.close(key, args.get("epoch"))
        return None
