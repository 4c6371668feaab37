"""The CLI's thin HTTP path for its hot commands (run, exec, ps, kill, logs, network).

Why not the SDK here: importing it costs ~0.3 s (httpx, pydantic, pydantic-settings, the
node models) before the first byte is sent, and a CLI command must answer at once
(``dsec ps`` <= 150 ms). This path uses only the standard library (``http.client``) and
``dsec.errors``; the wire format is the API's, so answers are plain JSON dicts.

``resolve_target`` finds the server and token exactly as ``dsec.sdk._config.
resolve_config`` does (env > ``DSEC_CONFIG`` TOML > defaults; ``DSEC_HOME/server.json``
and ``DSEC_HOME/token`` when unset); ``tests/unit/cli/test_wire.py`` keeps the two equal.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from dsec.errors import DSecError, TransientError, error_from_dict

# The defaults of dsec.config.Settings these need (importing Settings costs ~70 ms of
# pydantic-settings); the parity test fails if they drift.
_DEFAULTS: dict[str, Any] = {"home": "/var/lib/dsec", "host": "127.0.0.1", "port": 7070, "url": None,
                             "token": None, "client_timeout_s": 120.0, "client_retries": 4,
                             "client_backoff_s": 0.2, "client_backoff_max_s": 5.0}


@dataclass(frozen=True)
class Target:
    url: str  # the first server; ``urls`` has every one (DSEC_URL=http://a:7070,http://b:7070)
    urls: tuple[str, ...]
    token: str | None
    home: Path
    timeout_s: float
    retries: int
    backoff_s: float
    backoff_max_s: float
    token_source: str  # "DSEC_TOKEN", "token in <DSEC_CONFIG>", "<home>/token" or "none": for error messages


def _settings(env: Mapping[str, str]) -> dict[str, Any]:
    """The client settings: DSEC_* env (any case, like pydantic-settings) > TOML file > defaults."""
    upper = {k.upper(): v for k, v in env.items()}
    toml: dict[str, Any] = {}
    path = upper.get("DSEC_CONFIG")
    if path:
        import tomllib

        with open(path, "rb") as fh:
            toml = {k: v for k, v in tomllib.load(fh).items() if not isinstance(v, dict)}
    out: dict[str, Any] = {}
    for name, default in _DEFAULTS.items():
        raw = upper.get(f"DSEC_{name.upper()}")
        val: Any = raw if raw is not None else toml.get(name, default)
        if val is not None and isinstance(default, int | float):
            val = type(default)(val)
        out[name] = val
    out["token_from"] = "DSEC_TOKEN" if "DSEC_TOKEN" in upper else f"token in {path}"
    return out


def resolve_target(env: Mapping[str, str] | None = None) -> Target:
    env = os.environ if env is None else env
    s = _settings(env)
    home = Path(env.get("DSEC_HOME", str(s["home"])))
    url = s["url"]
    if url is None:
        try:
            info = json.loads((home / "server.json").read_text())
            url = str(info["url"]) if isinstance(info, dict) and "url" in info else None
        except (OSError, ValueError):
            url = None
        url = url or f"http://{s['host']}:{s['port']}"
    token, source = s["token"], s["token_from"]
    if token is None:
        try:
            token = (home / "token").read_text().strip() or None
        except OSError:
            token = None
        source = str(home / "token") if token else "none"
    # Several servers on one shared state, comma-separated: as dsec.sdk._config.split_urls.
    urls = tuple(dict.fromkeys(u.strip().rstrip("/") for u in str(url).split(",") if u.strip())) or (str(url),)
    return Target(url=urls[0], urls=urls, token=token, home=home, timeout_s=s["client_timeout_s"],
                  retries=s["client_retries"], backoff_s=s["client_backoff_s"],
                  backoff_max_s=s["client_backoff_max_s"], token_source=source)


class ServerUnreachable(TransientError):
    """No DSec server answers at the configured URL (named, with the next command, by the CLI)."""


def sid(sandbox_id: str) -> str:
    return quote(sandbox_id, safe="")


class Wire:
    """One keep-alive connection to the API; JSON in, JSON out, ``dsec.errors`` on failure.
    With several servers, a request that could not be sent goes to the next one (creates
    carry a request id, so a replayed one never makes two sandboxes)."""

    def __init__(self, target: Target | None = None) -> None:
        self.target = target or resolve_target()
        self._headers = {"content-type": "application/json", "user-agent": "dsec-cli"}
        if self.target.token:
            self._headers["authorization"] = f"Bearer {self.target.token}"
        self._connect(self.target.url)

    def _connect(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise DSecError(f"DSEC_URL {url!r} is not an http(s) URL (e.g. http://127.0.0.1:7070)")
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self.url = url
        self._conn = cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=self.target.timeout_s)
        self._prefix = u.path.rstrip("/")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: Any, params: list[tuple[str, str]] | None,
              timeout: float | None) -> http.client.HTTPResponse:
        tried: dict[str, str] = {}  # url -> why it could not be reached
        while True:
            try:
                return self._send_one(method, path, body, params, timeout)
            except ServerUnreachable as e:
                tried[self.url] = str(e.details.get("reason"))
                rest = [u for u in self.target.urls if u not in tried]
                if not rest:
                    where = ", ".join(f"{u} ({why})" for u, why in tried.items())
                    raise ServerUnreachable(f"no DSec server answers at {'' if len(tried) == 1 else 'any of '}"
                                            f"{where}", url=self.url) from None
                self._conn.close()
                self._connect(rest[0])

    def _send_one(self, method: str, path: str, body: Any, params: list[tuple[str, str]] | None,
                  timeout: float | None) -> http.client.HTTPResponse:
        url = self._prefix + path + (("?" + urlencode(params)) if params else "")
        data = None if body is None else json.dumps(body).encode()
        self._conn.timeout = timeout or self.target.timeout_s
        if self._conn.sock is not None:
            self._conn.sock.settimeout(self._conn.timeout)
        for fresh in (False, True):
            try:
                self._conn.request(method, url, body=data, headers=self._headers)
                return self._conn.getresponse()
            except (ConnectionRefusedError, FileNotFoundError) as e:
                self._conn.close()
                raise ServerUnreachable(f"no DSec server answers at {self.url}", url=self.url,
                                        reason=e.strerror or str(e)) from None
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                # A kept-alive connection the server closed meanwhile: one fresh attempt.
                self._conn.close()
                if fresh:
                    raise TransientError(f"connection to {self.url} failed: {e}", url=self.url) from None
            except TimeoutError:
                self._conn.close()
                raise TransientError(f"request to {self.url} timed out; retry or raise "
                                     "DSEC_CLIENT_TIMEOUT_S", url=self.url) from None
            except OSError as e:
                self._conn.close()
                raise ServerUnreachable(f"cannot reach a DSec server at {self.url}", url=self.url,
                                        reason=e.strerror or str(e)) from None
        raise AssertionError("unreachable")

    @staticmethod
    def _error(status: int, raw: bytes) -> DSecError:
        try:
            body = json.loads(raw)
            if isinstance(body, dict) and "code" in body:
                return error_from_dict(body, status)
        except ValueError:
            pass
        return DSecError(f"unexpected HTTP {status} from {raw[:200].decode(errors='replace')!r}", status=status)

    def call(self, method: str, path: str, body: Any = None, params: list[tuple[str, str]] | None = None,
             timeout: float | None = None) -> Any:
        """One request; 429/503 are retried after Retry-After (as the SDK does), up to client_retries."""
        for attempt in range(self.target.retries + 1):
            resp = self._send(method, path, body, params, timeout)
            raw = resp.read()
            if resp.status < 400:
                return json.loads(raw) if raw else None
            if resp.status not in (429, 503) or attempt == self.target.retries:
                raise self._error(resp.status, raw)
            try:
                delay = float(resp.getheader("retry-after") or "")
            except ValueError:
                delay = self.target.backoff_s * 2 ** attempt
            time.sleep(min(self.target.backoff_max_s, delay))
        raise AssertionError("unreachable")

    def lines(self, method: str, path: str, body: Any, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """An NDJSON stream (exec/stream); an in-band ``error`` item raises its ``dsec.errors`` class."""
        resp = self._send(method, path, body, None, timeout)
        if resp.status >= 400:
            raise self._error(resp.status, resp.read())
        try:
            while True:
                line = resp.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                obj = json.loads(line)
                if obj.get("kind") == "error":
                    raise error_from_dict(obj.get("error") or {}, 500)
                yield obj
        finally:
            if not resp.isclosed():  # left early (exit item seen, or an error): never reuse a half-read stream
                self._conn.close()

    # --- the operations the hot commands use ---------------------------------------------
    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        # A request id makes a retried create idempotent (never two sandboxes).
        return self.call("POST", "/v1/sandboxes", {**spec, "request_id": "cli-" + uuid.uuid4().hex})

    def kill(self, sandbox_id: str) -> None:
        self.call("DELETE", f"/v1/sandboxes/{sid(sandbox_id)}")
