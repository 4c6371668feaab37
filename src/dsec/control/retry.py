"""Create retries: capped exponential backoff and a retry budget. Pure.

A failed create is retried on another node (the failed node is excluded) after
``retry_backoff_s`` x 2^(attempt-1), capped at ``retry_backoff_max_s``, at most
``retry_max_attempts`` attempts in all. The budget caps retries cluster-wide at
``retry_budget_ratio`` x first attempts, so a broken image or a cluster-wide fault does
not multiply load by the attempt count (retry storms).
"""

from __future__ import annotations

from dsec.config import Settings


def backoff_s(attempt: int, s: Settings) -> float:
    """Delay before attempt ``attempt + 1`` (``attempt`` >= 1 attempts already failed)."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return min(s.retry_backoff_s * (2 ** (attempt - 1)), s.retry_backoff_max_s)


class RetryBudget:
    __slots__ = ("firsts", "min_retries", "ratio", "retries")

    def __init__(self, s: Settings, min_retries: int = 10) -> None:
        self.ratio = s.retry_budget_ratio
        self.firsts = 0
        self.retries = 0
        # A fresh cluster gets a few retries before the ratio means anything.
        self.min_retries = min_retries

    def first_attempt(self) -> None:
        self.firsts += 1

    def try_spend(self) -> bool:
        if self.retries < self.min_retries or self.retries < self.ratio * self.firsts:
            self.retries += 1
            return True
        return False


def should_retry(attempts: int, retriable: bool, budget: RetryBudget, s: Settings) -> float | None:
    """Delay before retrying, or None when the request must fail now."""
    if not retriable or attempts >= s.retry_max_attempts:
        return None
    if not budget.try_spend():
        return None
    return backoff_s(attempts, s)
