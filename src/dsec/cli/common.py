"""Shared CLI helpers: the SDK client, error display, JSON output, human formatting."""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console

from dsec.errors import DSecError

F = TypeVar("F", bound=Callable[..., Any])
out = Console()
err = Console(stderr=True)


def client() -> Any:
    """The SDK client from DSEC_URL/DSEC_TOKEN or DSEC_HOME/server.json + token."""
    from dsec.sdk import Client

    return Client()


def handle_errors(fn: F) -> F:
    """Print ``dsec.errors`` as one actionable line and exit non-zero (no tracebacks)."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except DSecError as e:
            err.print(f"[red]error[/red] ({e.code}): {e.message}")
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, list):
        return [to_jsonable(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2) + "\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def human_age(since: float, now: float | None = None) -> str:
    s = max(0.0, (now or time.time()) - since)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def parse_labels(items: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise typer.BadParameter(f"label {item!r} must look like key=value")
        labels[k] = v
    return labels


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no data."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
