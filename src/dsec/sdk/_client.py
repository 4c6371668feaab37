"""``Client`` and ``AsyncClient``: one pooled httpx client each, driving the sans-IO core.

Every API operation is defined ONCE in ``_Api`` as ``return self._run(call)``; the sync
client's ``_run`` returns the value, the async client's returns an awaitable. Only the
two tiny drivers (``_run`` and the exec-stream iterator) differ.

Failover: given several servers (``url=[...]`` / ``DSEC_URL=a,b``), a request that cannot
be completed on the current one (connection refused, reset, timed out) moves the client
to the next server; the retry the core's policy allows (never-sent requests, and
idempotent ones: every create carries a request id) goes there with the same body, so a
create replayed on another server of the same state returns the same sandbox. Each
server keeps its own connection pool; the hot path is unchanged (one attribute read).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx

from dsec import __version__
from dsec.errors import DSecError
from dsec.models import ExecEvent, ExecRequest, SandboxSpec
from dsec.sdk import _ops
from dsec.sdk._config import ClientConfig, failover_url, resolve_config
from dsec.sdk._core import (
    Call,
    Outcome,
    Response,
    RetryPolicy,
    Send,
    error_of,
    parse_event_line,
    plan,
    transport_error,
)
from dsec.sdk._drivers import _U3, _Aio


class _Api:
    """Operations shared verbatim by both clients (``_run`` decides sync vs async)."""

    config: ClientConfig

    def _run(self, call: Call[Any]) -> Any:
        raise NotImplementedError

    def create(self, spec: SandboxSpec) -> Any:
        return self._run(_ops.create(spec))

    def get(self, sandbox_id: str) -> Any:
        return self._run(_ops.get(sandbox_id))

    def list(self, labels: dict[str, str] | None = None) -> Any:
        return self._run(_ops.list_(labels))

    def kill(self, sandbox_id: str) -> Any:
        return self._run(_ops.kill(sandbox_id))

    def kill_by_labels(self, labels: dict[str, str]) -> Any:
        return self._run(_ops.kill_by_labels(labels))

    def update_network(self, sandbox_id: str, allow: list[str]) -> Any:
        return self._run(_ops.update_network(sandbox_id, allow))

    def set_timeout(self, sandbox_id: str, timeout: float) -> Any:
        return self._run(_ops.set_timeout(sandbox_id, timeout))

    def clone(self, sandbox_id: str, n: int = 1) -> Any:
        return self._run(_ops.clone(sandbox_id, n))

    def reset(self, sandbox_id: str) -> Any:
        return self._run(_ops.reset(sandbox_id))

    def usage(self, labels: dict[str, str] | None = None, *, group_by: str | None = None,
              limit: int | None = None) -> Any:
        """``UsageReport`` of own sandboxes (live and dead) matching every label."""
        return self._run(_ops.usage(labels, group_by, limit))

    def usage_quotas(self) -> Any:
        return self._run(_ops.usage_quotas())

    def set_usage_quota(self, label: str, *, max_sandboxes: int | None = None,
                        max_cpu_seconds: float | None = None) -> Any:
        """Cap the sandboxes labelled ``label`` ('run=r1'); new creates past it get 429."""
        return self._run(_ops.set_usage_quota(label, max_sandboxes, max_cpu_seconds))

    def delete_usage_quota(self, label: str) -> Any:
        return self._run(_ops.delete_usage_quota(label))

    def exec(self, sandbox_id: str, req: ExecRequest) -> Any:
        return self._run(_ops.exec_(sandbox_id, req, self.config.timeout_s))

    def processes(self, sandbox_id: str) -> Any:
        return self._run(_ops.processes(sandbox_id))

    def checkpoint(self, sandbox_id: str) -> Any:
        return self._run(_ops.checkpoint(sandbox_id))

    def restore(self, checkpoint_id: str, labels: dict[str, str] | None = None, timeout: float | None = None,
                request_id: str | None = None) -> Any:
        return self._run(_ops.restore(checkpoint_id, labels, timeout, request_id))

    def checkpoints(self, sandbox_id: str | None = None) -> Any:
        return self._run(_ops.checkpoints(sandbox_id))

    def get_checkpoint(self, checkpoint_id: str) -> Any:
        return self._run(_ops.get_checkpoint(checkpoint_id))

    def delete_checkpoint(self, checkpoint_id: str) -> Any:
        return self._run(_ops.delete_checkpoint(checkpoint_id))

    def signal(self, sandbox_id: str, pid: int, sig: int = 9) -> Any:
        return self._run(_ops.signal(sandbox_id, pid, sig))

    def read_file(self, sandbox_id: str, path: str) -> Any:
        return self._run(_ops.read_file(sandbox_id, path))

    def write_file(self, sandbox_id: str, path: str, data: bytes | str, mode: int = 0o644) -> Any:
        return self._run(_ops.write_file(sandbox_id, path, data, mode))

    def list_files(self, sandbox_id: str, path: str) -> Any:
        """Every entry: the server pages long listings (X-Next-Cursor); pages are followed here."""
        return self._pages(lambda cursor: _ops.list_files(sandbox_id, path, cursor))

    def _pages(self, page: Callable[[str | None], Call[tuple[list[Any], str | None]]]) -> Any:
        raise NotImplementedError

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> Any:
        return self._run(_ops.remove_file(sandbox_id, path, recursive))

    def upload_tar(self, sandbox_id: str, path: str, tar_bytes: bytes) -> Any:
        return self._run(_ops.upload_tar(sandbox_id, path, tar_bytes))

    def download_tar(self, sandbox_id: str, path: str) -> Any:
        return self._run(_ops.download_tar(sandbox_id, path))

    def audit(self, sandbox_id: str, limit: int = 1000) -> Any:
        return self._run(_ops.audit(sandbox_id, limit))

    def health(self) -> Any:
        return self._run(_ops.health())

    def images(self) -> Any:
        return self._run(_ops.images())

    def import_image(self, name: str, archive: bytes) -> Any:
        return self._run(_ops.import_image(name, archive))

    def remove_image(self, ref: str) -> Any:
        return self._run(_ops.remove_image(ref))

    def add_tenant(self, name: str, **limits: Any) -> Any:
        return self._run(_ops.add_tenant(name, **limits))

    def tenants(self) -> Any:
        return self._run(_ops.tenants())

    def remove_tenant(self, name: str) -> Any:
        return self._run(_ops.remove_tenant(name))

    def whoami(self) -> Any:
        return self._run(_ops.whoami())


def _httpx_kwargs(cfg: ClientConfig) -> dict[str, Any]:
    headers = {"user-agent": f"dsec-sdk/{__version__}"}
    if cfg.token:
        headers["authorization"] = f"Bearer {cfg.token}"
    return dict(base_url=cfg.url, headers=headers, timeout=httpx.Timeout(cfg.timeout_s),
                limits=httpx.Limits(max_connections=cfg.max_connections,
                                    max_keepalive_connections=cfg.max_keepalive, keepalive_expiry=cfg.keepalive_s))


def _request_kwargs(call: Call[Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"params": call.params, "headers": call.headers or None}
    if call.json is not None:
        kw["json"] = call.json
    if call.content is not None:
        kw["content"] = call.content
    if call.timeout is not None:
        kw["timeout"] = call.timeout
    return kw


def _response(r: httpx.Response) -> Response:
    return Response(r.status_code, dict(r.headers), r.content)


class Client(_Api):
    """Synchronous client. Thread-safe; reuse one per process (pooled keep-alive connections).

    Requests go over urllib3; an httpx ``transport`` (tests) switches to httpx."""

    def __init__(self, url: str | list[str] | None = None, token: str | None = None, *,
                 retries: int | None = None, timeout: float | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.config = resolve_config(url, token, retries=retries, timeout=timeout)
        self._policy = RetryPolicy(self.config.retries, self.config.backoff_s, self.config.backoff_max_s)
        self._transport = transport
        self._pools: dict[str, tuple[httpx.Client, _U3 | None]] = {}
        self._switch = threading.Lock()
        self._use(self.config.url)

    def _use(self, url: str) -> None:
        """Send to ``url`` from now on (its pool is made once and kept)."""
        with self._switch:
            pair = self._pools.get(url)
            if pair is None:
                cfg = replace(self.config, url=url)
                pair = self._pools[url] = (httpx.Client(transport=self._transport, **_httpx_kwargs(cfg)),
                                           _U3(cfg) if self._transport is None else None)
            self._http, self._u3 = pair
            self.config = replace(self.config, url=url)

    def _failed(self, url: str) -> None:
        nxt = failover_url(self.config, url)
        if nxt is not None:
            self._use(nxt)

    def _send(self, call: Call[Any]) -> Response:
        if self._u3 is not None:
            return self._u3.request(call)
        return _response(self._http.request(call.method, call.path, **_request_kwargs(call)))

    def _run(self, call: Call[Any]) -> Any:
        gen = plan(call, self._policy, self.config.url)
        step = next(gen)
        while True:
            try:
                if isinstance(step, Send):
                    url = self.config.url
                    try:
                        out = Outcome(response=self._send(call))
                    except httpx.TransportError as e:
                        out = Outcome(error=e)
                        self._failed(url)  # the retry (if the policy allows one) goes to the next server
                    step = gen.send(out)
                else:
                    time.sleep(step.seconds)
                    step = gen.send(None)
            except StopIteration as stop:
                return stop.value

    def _pages(self, page: Callable[[str | None], Call[tuple[list[Any], str | None]]]) -> list[Any]:
        items: list[Any] = []
        cursor: str | None = None
        while True:
            got, cursor = self._run(page(cursor))
            items += got
            if cursor is None:
                return items

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> Iterator[ExecEvent]:
        call = _ops.exec_stream(sandbox_id, req, self.config.timeout_s)
        url = self.config.url
        lines = self._u3.lines(call) if self._u3 is not None else self._httpx_lines(call)
        try:
            for line in lines:
                ev = parse_event_line(line)
                if ev is not None:
                    yield ev
        except httpx.TransportError as e:
            self._failed(url)
            raise transport_error(e, url) from e

    def _httpx_lines(self, call: Call[Any]) -> Iterator[str]:
        with self._http.stream(call.method, call.path, **_request_kwargs(call)) as r:
            if r.status_code >= 400:
                r.read()
                raise error_of(_response(r))
            yield from r.iter_lines()

    def close(self) -> None:
        for http, u3 in self._pools.values():
            if u3 is not None:
                u3.close()
            http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    _default: Client | None = None
    _default_lock = threading.Lock()

    @classmethod
    def default(cls) -> Client:
        """The process-wide client built from the environment (DSEC_URL, DSEC_TOKEN, DSEC_HOME)."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default


class AsyncClient(_Api):
    """asyncio client. One per event loop; sized for thousands of concurrent sandboxes.

    Requests go over aiohttp (a pooled keep-alive HTTP/1.1 client with a C parser; a
    round trip costs about a third of httpx's, which is most of the SDK's share of the
    exec overhead). Passing an httpx ``transport`` (e.g. ``httpx.ASGITransport`` for
    in-process tests) uses httpx instead; both feed the same sans-IO core.
    """

    def __init__(self, url: str | list[str] | None = None, token: str | None = None, *,
                 retries: int | None = None, timeout: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = resolve_config(url, token, retries=retries, timeout=timeout)
        self._policy = RetryPolicy(self.config.retries, self.config.backoff_s, self.config.backoff_max_s)
        self._transport = transport
        self._pools: dict[str, tuple[httpx.AsyncClient, _Aio | None]] = {}
        self._use(self.config.url)

    def _use(self, url: str) -> None:
        """Send to ``url`` from now on (its pool is made once and kept)."""
        pair = self._pools.get(url)
        if pair is None:
            cfg = replace(self.config, url=url)
            pair = self._pools[url] = (httpx.AsyncClient(transport=self._transport, **_httpx_kwargs(cfg)),
                                       _Aio(cfg) if self._transport is None else None)
        self._http, self._aio = pair
        self.config = replace(self.config, url=url)

    def _failed(self, url: str) -> None:
        nxt = failover_url(self.config, url)
        if nxt is not None:
            self._use(nxt)

    async def _send(self, call: Call[Any]) -> Response:
        if self._aio is not None:
            return await self._aio.request(call)
        return _response(await self._http.request(call.method, call.path, **_request_kwargs(call)))

    async def _run(self, call: Call[Any]) -> Any:  # type: ignore[override]
        gen = plan(call, self._policy, self.config.url)
        step = next(gen)
        while True:
            try:
                if isinstance(step, Send):
                    url = self.config.url
                    try:
                        out = Outcome(response=await self._send(call))
                    except httpx.TransportError as e:
                        out = Outcome(error=e)
                        self._failed(url)  # the retry (if the policy allows one) goes to the next server
                    step = gen.send(out)
                else:
                    await asyncio.sleep(step.seconds)
                    step = gen.send(None)
            except StopIteration as stop:
                return stop.value

    async def _pages(self, page: Callable[[str | None], Call[tuple[list[Any], str | None]]]) -> list[Any]:
        items: list[Any] = []
        cursor: str | None = None
        while True:
            got, cursor = await self._run(page(cursor))
            items += got
            if cursor is None:
                return items

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        call = _ops.exec_stream(sandbox_id, req, self.config.timeout_s)
        url = self.config.url
        lines = self._aio.lines(call) if self._aio is not None else self._httpx_lines(call)
        try:
            async for line in lines:
                ev = parse_event_line(line)
                if ev is not None:
                    yield ev
        except httpx.TransportError as e:
            self._failed(url)
            raise transport_error(e, url) from e

    async def _httpx_lines(self, call: Call[Any]) -> AsyncIterator[str]:
        async with self._http.stream(call.method, call.path, **_request_kwargs(call)) as r:
            if r.status_code >= 400:
                await r.aread()
                raise error_of(_response(r))
            async for line in r.aiter_lines():
                yield line

    async def aclose(self) -> None:
        for http, aio in self._pools.values():
            if aio is not None:
                await aio.close()
            await http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    _defaults: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient] = weakref.WeakKeyDictionary()

    @classmethod
    def default(cls) -> AsyncClient:
        """The client of the running event loop built from the environment."""
        loop = asyncio.get_running_loop()
        client = cls._defaults.get(loop)
        if client is None:
            client = cls._defaults[loop] = cls()
        return client


__all__ = ["AsyncClient", "Client", "DSecError"]
