"""``dsec.usage(labels={...})`` / ``await dsec.ausage(labels={...})``: run-level accounting
of the caller's own sandboxes (live and dead) through the default client."""

from __future__ import annotations

from typing import Any

from dsec.models.usage import UsageReport
from dsec.sdk._client import AsyncClient, Client


def usage(labels: dict[str, str] | None = None, *, group_by: str | None = None, limit: int | None = None,
          client: Client | None = None) -> UsageReport:
    """Totals (CPU-seconds, memory GiB-seconds, execs, bytes written, sandbox-seconds) of
    own sandboxes carrying every label; ``group_by='task'`` adds totals per task value."""
    return (client or Client.default()).usage(labels, group_by=group_by, limit=limit)  # type: ignore[no-any-return]


async def ausage(labels: dict[str, str] | None = None, *, group_by: str | None = None, limit: int | None = None,
                 client: AsyncClient | None = None) -> UsageReport:
    """The asyncio form of ``dsec.usage``."""
    result: Any = await (client or AsyncClient.default()).usage(labels, group_by=group_by, limit=limit)
    return result  # type: ignore[no-any-return]
