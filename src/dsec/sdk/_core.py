"""The SDK's logic, written once and free of I/O (sans-IO).

A ``Call`` describes one API request and how to parse its answer. ``plan(call, policy)``
is a generator that yields ``Send``/``Sleep`` steps and receives outcomes; the sync and
async clients are ~10-line drivers that perform those steps with ``httpx.Client`` or
``httpx.AsyncClient``. Retries, backoff, Retry-After and error mapping live here only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import httpx

from dsec.errors import DSecError, TransientError, error_from_dict
from dsec.models import ExecEvent

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Response], T]
    params: list[tuple[str, str]] | None = None
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # Safe to resend after the server may have acted on it (GET, DELETE, create with request_id).
    idempotent: bool = False
    timeout: float | None = None

    def map(self, fn: Callable[[T], U]) -> Call[U]:
        parse = self.parse
        return replace(self, parse=lambda r: fn(parse(r)))  # type: ignore[return-value,arg-type]


@dataclass(frozen=True)
class Send:
    call: Call[Any]


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Outcome:
    response: Response | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class RetryPolicy:
    retries: int
    backoff_s: float
    backoff_max_s: float

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * (2 ** attempt))

    def on_status(self, attempt: int, status: int, retry_after: str | None) -> float | None:
        """Delay before retrying an HTTP answer, or None to hand it to the caller."""
        if attempt >= self.retries or status not in (429, 503):
            return None
        try:
            hinted = float(retry_after) if retry_after is not None else None
        except ValueError:
            hinted = None
        return min(self.backoff_max_s, hinted) if hinted is not None else self.backoff(attempt)

    def on_error(self, attempt: int, err: Exception, idempotent: bool) -> float | None:
        """Delay before retrying a transport failure, or None to give up."""
        if attempt >= self.retries:
            return None
        # Never sent: always safe. Sent but no answer: only if resending cannot double-act.
        never_sent = isinstance(err, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
        if never_sent or (idempotent and isinstance(err, httpx.TransportError)):
            return self.backoff(attempt)
        return None


def error_of(resp: Response) -> DSecError:
    """Turn an error answer into the matching ``dsec.errors`` class."""
    try:
        body = resp.json()
        if isinstance(body, dict) and "code" in body:
            return error_from_dict(body, resp.status)
    except ValueError:
        pass
    text = resp.content[:200].decode(errors="replace")
    if resp.status in (502, 503, 504):
        return TransientError(f"server/proxy answered HTTP {resp.status}: {text}; retry later", status=resp.status)
    return DSecError(f"unexpected HTTP {resp.status} from the DSec API: {text}", status=resp.status)


def transport_error(err: Exception, url: str) -> DSecError:
    if isinstance(err, httpx.ConnectError):
        return TransientError(f"cannot connect to the DSec server at {url}: {err}. Is `dsec serve` running? "
                              "Set DSEC_URL to point elsewhere.", url=url)
    if isinstance(err, httpx.TimeoutException):
        return TransientError(f"request to {url} timed out ({type(err).__name__}); retry or raise the client "
                              "timeout (DSEC_CLIENT_TIMEOUT_S)", url=url)
    return TransientError(f"connection to {url} failed: {type(err).__name__}: {err}", url=url)


def plan(call: Call[T], policy: RetryPolicy, url: str) -> Generator[Send | Sleep, Outcome | None, T]:
    attempt = 0
    while True:
        outcome = yield Send(call)
        assert outcome is not None
        if outcome.error is not None:
            delay = policy.on_error(attempt, outcome.error, call.idempotent)
            if delay is None:
                raise transport_error(outcome.error, url) from outcome.error
        else:
            resp = outcome.response
            assert resp is not None
            if resp.status < 400:
                return call.parse(resp)
            delay = policy.on_status(attempt, resp.status, resp.headers.get("retry-after"))
            if delay is None:
                raise error_of(resp)
        yield Sleep(delay)
        attempt += 1


def parse_event_line(line: str) -> ExecEvent | None:
    """One NDJSON line of a streamed exec; in-band errors raise their ``dsec.errors`` class."""
    if not line.strip():
        return None
    obj = json.loads(line)
    if obj.get("kind") == "error":
        raise error_from_dict(obj.get("error") or {}, 500)
    return ExecEvent.model_validate(obj)
