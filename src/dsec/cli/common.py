"""Shared CLI helpers: the SDK client, error display with the next step, JSON output, formatting.

Imported by every command: keep it light (no pydantic, no SDK at import time)."""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from dsec.errors import DSecError, NotFound, TransientError, Unauthorized

F = TypeVar("F", bound=Callable[..., Any])
_CONSOLES: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """``out`` / ``err``: rich consoles, made on first use (importing rich costs ~35 ms,
    which the hot commands do not pay unless they print something rich)."""
    if name not in ("out", "err"):
        raise AttributeError(name)
    if name not in _CONSOLES:
        from rich.console import Console

        _CONSOLES[name] = Console(stderr=name == "err")
    return _CONSOLES[name]


def note(message: str) -> None:
    """A plain status line on stderr (no rich import on the hot path)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def client() -> Any:
    """The SDK client from DSEC_URL/DSEC_TOKEN or DSEC_HOME/server.json + token."""
    from dsec.sdk import Client

    return Client()


def wire() -> Any:
    """The CLI's light HTTP client for its hot commands (``dsec.cli.wire``)."""
    from dsec.cli.wire import Wire

    return Wire()


SERVE_HINT = ("start it in another shell: `dsec serve` (as root; `sudo .venv/bin/dsec serve` for a non-root "
              "user), or point DSEC_URL at a running server; `dsec doctor` checks this host")


def next_step(e: DSecError) -> str | None:
    """The command a user runs next after a first-hour error, or None when the message says it all."""
    from dsec.cli.wire import ServerUnreachable, resolve_target

    sdk_unreachable = isinstance(e, TransientError) and e.message.startswith("cannot connect")  # the SDK's words
    if isinstance(e, ServerUnreachable) or sdk_unreachable:
        return f"no server is running there: {SERVE_HINT}"
    if isinstance(e, Unauthorized):
        t = resolve_target()
        if t.token_source == "none":
            return (f"no token: set DSEC_TOKEN, or run on the server's machine with DSEC_HOME pointing at its data "
                    f"dir ({t.home}/token is read when DSEC_TOKEN is unset)")
        return (f"the token from {t.token_source} is not valid for {t.url}: for the local server unset DSEC_TOKEN "
                f"(the CLI then reads {t.home}/token); for another server ask its admin for one "
                "(`dsec tenant add NAME` prints a new token)")
    image = e.details.get("image") if isinstance(e, NotFound) else None
    if isinstance(image, str):
        from dsec.images.stock import STOCK  # the error path only: this import is not free

        name, _, tag = image.partition(":")
        if name in STOCK and tag in ("", "latest"):
            return (f"the stock image {name!r} is not built yet on the server's machine: run "
                    f"`dsec image ensure-stock --only {name}` there as root (`scripts/setup.sh` builds them all)")
        return (f"no image {image!r}: `dsec image ls` lists this node's images; stock ones are "
                f"{', '.join(STOCK)}; add one with `dsec image import PATH` or `dsec image build`")
    return None


def report_error(e: DSecError) -> None:
    """One line naming the problem, then (when known) the next command to run."""
    console = __getattr__("err")
    console.print(f"[red]error[/red] ({e.code}): {e.message}", highlight=False)
    hint = next_step(e)
    if hint:
        console.print(f"[yellow]next[/yellow]: {hint}", highlight=False)


def handle_errors(fn: F) -> F:
    """Print ``dsec.errors`` as one actionable line and exit non-zero (no tracebacks)."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except DSecError as e:
            report_error(e)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):  # a pydantic model (pydantic is not imported here: CLI start-up)
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
    if not items:  # the common case pays no import (dsec.models pulls pydantic: ~0.1 s)
        return {}
    # Imported here: the wire models are not needed to start the CLI.
    from dsec.models.sandbox import parse_labels as parse

    try:
        return parse(items)
    except DSecError as e:
        raise typer.BadParameter(e.message) from None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no data."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
