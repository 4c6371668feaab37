"""``POST /v1/episodes/{id}/fork``: branch an episode (``EpisodeEngine.fork``): a new episode
whose log shares this one's history and whose sandbox starts from its files now."""

from __future__ import annotations

import secrets

from fastapi import APIRouter
from pydantic import BaseModel, Field

from dsec.api.episodes import Engine, EpisodeId, Epoch, Tenant, _key, _public
from dsec.models.episode import EpisodeInfo

router = APIRouter(prefix="/v1/episodes", tags=["episodes"])


class ForkRequest(BaseModel):
    new_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$",
                               description="The fork's episode id (default: this id + '-f' + random)")


@router.post("/{episode_id}/fork", response_model=EpisodeInfo, status_code=201,
             summary="Branch: a new episode with this one's history and files; the caller owns it")
async def fork(episode_id: EpisodeId, req: ForkRequest, eng: Engine, t: Tenant, epoch: Epoch = None) -> EpisodeInfo:
    new_id = req.new_id or f"{episode_id[:80]}-f{secrets.token_hex(4)}"
    return _public(await eng.fork(_key(t, episode_id), _key(t, new_id), epoch), new_id)
