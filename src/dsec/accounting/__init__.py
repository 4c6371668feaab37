"""Run-level accounting: what each sandbox really used (CPU-seconds from cpuacct, memory
GiB-seconds integrated from sampled cgroup memory, exec count, bytes written to its
writable layer, sandbox-seconds), per sandbox and aggregated by any label, kept after
the sandbox dies (SQLite, next to the state store), exported to Prometheus with bounded
label cardinality, and per-label quotas (``run=r1``: max concurrent sandboxes, max
CPU-seconds). See docs in README ("Run-level accounting")."""

from dsec.models.usage import LabelQuota, SandboxUsage, UsageGroup, UsageReport, UsageTotals

__all__ = ["LabelQuota", "SandboxUsage", "UsageGroup", "UsageReport", "UsageTotals"]
