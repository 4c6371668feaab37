"""Run-level accounting routes: ``GET /v1/usage`` and per-label quotas (``/v1/usage/quotas``).

A tenant only ever sees and limits its own sandboxes. Wiring (``install_usage``): the
ledger follows the local node's sandboxes, counts execs through ``SandboxService``,
enforces quotas at admission and exports bounded ``dsec_usage_*`` Prometheus counters.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request

from dsec.accounting.ledger import UsageLedger, parse_labels
from dsec.api.deps import Ctx
from dsec.errors import InvalidArgument
from dsec.models.usage import LabelQuota, UsageReport

router = APIRouter(prefix="/v1/usage", tags=["usage"])


def _ledger(request: Request) -> UsageLedger:
    ledger = getattr(request.app.state, "usage", None)
    if ledger is None:
        raise InvalidArgument("usage accounting is off on this server (DSEC_USAGE_ENABLED=false)", field="usage")
    return ledger  # type: ignore[no-any-return]


@router.get("", response_model=UsageReport,
            summary="CPU-seconds, memory GiB-seconds, execs, bytes written, sandbox-seconds of own sandboxes")
async def usage(request: Request, ctx: Ctx,
                label: Annotated[list[str], Query(max_length=64, description="key=value, repeatable; all must "
                                                  "match (an unknown label matches nothing)")] = [],
                group_by: Annotated[str | None, Query(max_length=128, description="Label key (or 'tenant') "
                                                      "to total by")] = None,
                limit: Annotated[int | None, Query(ge=0, description="Per-sandbox rows listed (newest first); "
                                                   "0: totals only")] = None) -> UsageReport:
    ledger = _ledger(request)
    cap = ctx.svc.settings.usage_query_max_sandboxes
    return await ledger.report(ctx.tenant, parse_labels(label), group_by, min(cap, cap if limit is None else limit))


@router.get("/quotas", response_model=list[LabelQuota], summary="Own per-label quotas")
async def quotas(request: Request, ctx: Ctx) -> list[LabelQuota]:
    return _ledger(request).quotas(ctx.tenant)


@router.put("/quotas", response_model=LabelQuota,
            summary="Set a per-label quota (max concurrent sandboxes, max CPU-seconds); applies to new creates")
async def set_quota(request: Request, q: LabelQuota, ctx: Ctx) -> LabelQuota:
    return await _ledger(request).set_quota(ctx.tenant, q)


@router.delete("/quotas", status_code=204, summary="Remove a per-label quota")
async def delete_quota(request: Request, ctx: Ctx,
                       label: Annotated[str, Query(max_length=256, description="key=value")]) -> None:
    await _ledger(request).delete_quota(ctx.tenant, label)


def install_usage(app: FastAPI, services: Any) -> UsageLedger | None:
    """Mount the routes and build the ledger (None when accounting is off). The caller
    starts it after the services (``await ledger.start()``) and closes it before them."""
    app.include_router(router)
    settings = services.settings
    if not settings.usage_enabled:
        return None
    if services.sandboxes.usage is not None:  # a second app over the same services: one ledger
        return services.sandboxes.usage  # type: ignore[no-any-return]
    manager = getattr(services.node, "manager", None)
    # The in-process node's own parent (a remote node's sandboxes are not read here).
    parent = manager.cgroup_parent if manager is not None else settings.cgroup_parent
    ledger = UsageLedger(settings, services.state, cgroup_parent=parent,
                         owners=services.sandboxes._owners.get)
    if manager is not None:  # a remote (Ray) node: execs and quotas only; see README
        ledger.attach(manager)
    services.sandboxes.usage = ledger
    services.metrics.registry.register(ledger.collector)
    return ledger
