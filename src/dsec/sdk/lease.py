"""Owner leases: sandboxes that die with the run that owns them.

A trainer that crashes (OOM, preempted job, Ctrl-C at the wrong time) must not leave
thousands of sandboxes running until their TTL. Create them with ``owner=<run id>`` inside
a ``Lease`` of that name; the lease renews itself in the background, and the server reaps
the owner's sandboxes once the renewals stop for ``heartbeat_misses`` intervals::

    with dsec.Lease("run-42"):
        sb = dsec.Sandbox.create(image="python", owner="run-42")
        ...
    # on exit the lease is released: the run's sandboxes are killed at once

``AsyncLease`` is the asyncio twin (``async with dsec.AsyncLease("run-42"): ...``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel

from dsec.errors import DSecError
from dsec.sdk._client import AsyncClient, Client
from dsec.sdk._core import Call

log = logging.getLogger(__name__)


class LeaseStatus(BaseModel):
    owner: str
    sandboxes: int
    reap_after_s: float


def _heartbeat(owner: str) -> Call[LeaseStatus]:
    return Call("POST", f"/v1/leases/{quote(owner, safe='')}/heartbeat",
                lambda r: LeaseStatus.model_validate_json(r.content), idempotent=True)


def _release(owner: str) -> Call[list[str]]:
    return Call("DELETE", f"/v1/leases/{quote(owner, safe='')}", lambda r: list(r.json()["released"]),
                idempotent=True)


def renew_every(status: LeaseStatus) -> float:
    """Renew three times per reap window: two lost heartbeats in a row never reap."""
    return max(0.05, status.reap_after_s / 3)


class Lease:
    """Hold ``owner``'s lease from a background thread while the block runs."""

    def __init__(self, owner: str, *, client: Client | None = None, release_on_exit: bool = True) -> None:
        self.owner = owner
        self.client = client or Client.default()
        self.release_on_exit = release_on_exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.status: LeaseStatus | None = None
        self.released: list[str] = []

    def __enter__(self) -> Lease:
        self.status = self.client._run(_heartbeat(self.owner))  # fail here, loudly, if it cannot start
        self._thread = threading.Thread(target=self._renew, name=f"dsec-lease-{self.owner}", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        assert self.status is not None
        while not self._stop.wait(renew_every(self.status)):
            try:
                self.status = self.client._run(_heartbeat(self.owner))
            except DSecError as e:  # keep trying: one failed renewal is within the window
                log.warning("lease %s: renewal failed: %s", self.owner, e)

    def release(self) -> list[str]:
        """Kill the owner's sandboxes now and drop the lease."""
        self.released = self.client._run(_release(self.owner))
        return self.released

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.release_on_exit:
            self.release()


class AsyncLease:
    """asyncio twin of ``Lease``: renewals run as a task on the caller's loop."""

    def __init__(self, owner: str, *, client: AsyncClient | None = None, release_on_exit: bool = True) -> None:
        self.owner = owner
        self._client = client
        self.release_on_exit = release_on_exit
        self._task: asyncio.Task[None] | None = None
        self.status: LeaseStatus | None = None
        self.released: list[str] = []

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient.default()
        return self._client

    async def __aenter__(self) -> AsyncLease:
        self.status = await self.client._run(_heartbeat(self.owner))
        self._task = asyncio.create_task(self._renew(), name=f"dsec-lease-{self.owner}")
        return self

    async def _renew(self) -> None:
        assert self.status is not None
        while True:
            await asyncio.sleep(renew_every(self.status))
            try:
                self.status = await self.client._run(_heartbeat(self.owner))
            except DSecError as e:
                log.warning("lease %s: renewal failed: %s", self.owner, e)

    async def release(self) -> list[str]:
        self.released = await self.client._run(_release(self.owner))
        return self.released

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.release_on_exit:
            await self.release()
