"""Wire models of the usage API (``GET /v1/usage``, quotas)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

GIB = float(1 << 30)


class UsageTotals(BaseModel):
    """What a set of sandboxes used. Memory is GiB x seconds of the sandbox's memory cgroup
    usage (page cache and its tmpfs writable layer included), integrated over samples."""

    sandboxes: int = Field(0, description="Sandboxes counted")
    cpu_seconds: float = Field(0.0, description="CPU time (cgroup cpuacct), seconds")
    memory_gb_seconds: float = Field(0.0, description="Memory cgroup usage integrated over time, GiB x s")
    exec_count: int = Field(0, description="Commands run through the API (sync, background and streamed)")
    bytes_written: int = Field(0, description="Growth of the writable layer, summed over samples (bytes "
                               "deleted later are not subtracted)")
    sandbox_seconds: float = Field(0.0, description="Wall time from hand-over to death (or now)")

    def add(self, other: UsageTotals) -> UsageTotals:
        return UsageTotals(sandboxes=self.sandboxes + other.sandboxes,
                           cpu_seconds=self.cpu_seconds + other.cpu_seconds,
                           memory_gb_seconds=self.memory_gb_seconds + other.memory_gb_seconds,
                           exec_count=self.exec_count + other.exec_count,
                           bytes_written=self.bytes_written + other.bytes_written,
                           sandbox_seconds=self.sandbox_seconds + other.sandbox_seconds)


class SandboxUsage(UsageTotals):
    sandbox_id: str
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: float = Field(..., description="Hand-over time (unix)")
    ended_at: float | None = Field(None, description="Death time; None while live")


class UsageGroup(BaseModel):
    value: str = Field(..., description="The label's value ('' for sandboxes without the label)")
    totals: UsageTotals


class UsageReport(BaseModel):
    labels: dict[str, str] = Field(default_factory=dict, description="The filter (every label must match)")
    totals: UsageTotals
    group_by: str | None = None
    groups: list[UsageGroup] = Field(default_factory=list)
    sandboxes: list[SandboxUsage] = Field(default_factory=list, description="Newest first, at most `limit`")
    truncated: bool = Field(False, description="More sandboxes matched than listed (totals count them all)")


class LabelQuota(BaseModel):
    """A cap on the sandboxes of one label value (``run=r1``) of the calling tenant."""

    label: str = Field(..., pattern=r"^[^=]+=.*$", max_length=256, description="key=value, e.g. run=r1")
    max_sandboxes: int | None = Field(None, ge=0, description="Max concurrent live sandboxes with this label")
    max_cpu_seconds: float | None = Field(None, ge=0, description="Max CPU-seconds used by all sandboxes "
                                          "with this label (live and dead); new creates are refused at it")

    @model_validator(mode="after")
    def _some_limit(self) -> LabelQuota:
        if self.max_sandboxes is None and self.max_cpu_seconds is None:
            raise ValueError("give max_sandboxes and/or max_cpu_seconds")
        return self

    @property
    def key_value(self) -> tuple[str, str]:
        k, _, v = self.label.partition("=")
        return k, v
