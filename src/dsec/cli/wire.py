"""The CLI's thin HTTP path for its hot commands (run, exec, ps, kill, logs, network).

Why not the SDK here: importing it costs ~0.3 s (httpx, pydantic, pydantic-settings, the
node models) before the first byte is sent, and a CLI command must answer at once
(``dsec ps`` <= 150 ms). This path uses only the standard library (a plain socket: even
``http.client`` costs ~20 ms of imports, the ``email`` package mostly) and ``dsec.errors``;
the wire format is the API's, so answers are plain JSON dicts.

``resolve_target`` finds the server and token exactly as ``dsec.sdk._config.
resolve_config`` does (env > ``DSEC_CONFIG`` TOML > defaults; ``DSEC_HOME/server.json``
and ``DSEC_HOME/token`` when unset); ``tests/unit/cli/test_wire.py`` keeps the two equal.
"""

from __future__ import annotations

import json
import os
import socket
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


class _RemoteDisconnected(ConnectionResetError):
    """The server closed a (kept-alive) connection without answering."""


class _Response:
    """One HTTP/1.1 answer read from the connection: status, headers, then the body by
    Content-Length, chunks, or until the server closes."""

    def __init__(self, f: Any, head_only: bool) -> None:
        self._f = f
        line = f.readline(65537)
        if not line:
            raise _RemoteDisconnected("the server closed the connection without answering")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise DSecError(f"not an HTTP answer: {line[:100]!r}")
        self.status = int(parts[1])
        self.headers: dict[str, str] = {}
        while True:
            h = f.readline(65537)
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            self.headers[k.strip().lower()] = v.strip()
        self.keep_alive = parts[0] != b"HTTP/1.0" and self.headers.get("connection", "").lower() != "close"
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._left: int | None = None if self._chunked or length is None else int(length)
        self._chunk_left = 0
        self._buf = b""
        self.done = head_only or self.status in (204, 304) or self._left == 0
        if not self._chunked and self._left is None:
            self.keep_alive = False  # the body ends when the server closes

    def getheader(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def _piece(self) -> bytes:
        if self.done:
            return b""
        f = self._f
        if self._chunked:
            if self._chunk_left == 0:
                size = int(f.readline(65537).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while f.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    self.done = True
                    return b""
                self._chunk_left = size
            data = f.read(min(self._chunk_left, 65536))
            if not data:
                raise _RemoteDisconnected("the server closed the connection mid-answer")
            self._chunk_left -= len(data)
            if self._chunk_left == 0:
                f.readline(65537)  # the CRLF after a chunk
            return data
        data = f.read(65536 if self._left is None else min(self._left, 65536))
        if self._left is not None:
            if not data:
                raise _RemoteDisconnected("the server closed the connection mid-answer")
            self._left -= len(data)
            self.done = self._left == 0
        elif not data:
            self.done = True
        return data

    def read(self) -> bytes:
        out = [self._buf]
        self._buf = b""
        while not self.done:
            out.append(self._piece())
        return b"".join(out)

    def readline(self) -> bytes:
        while b"\n" not in self._buf and not self.done:
            self._buf += self._piece()
        line, nl, self._buf = self._buf.partition(b"\n")
        return line + nl

    def isclosed(self) -> bool:
        return self.done and not self._buf


class _Conn:
    """A keep-alive HTTP/1.1 connection over a plain socket (TLS only for https URLs)."""

    def __init__(self, scheme: str, host: str, port: int, timeout: float) -> None:
        self.scheme, self.host, self.port, self.timeout = scheme, host, port, timeout
        self.sock: socket.socket | None = None
        self._f: Any = None
        self._last: _Response | None = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self.sock is not None:
            self.sock.close()
        self.sock, self._f, self._last = None, None, None

    def request(self, method: str, target: str, body: bytes | None, headers: dict[str, str]) -> None:
        if self._last is not None and not (self._last.isclosed() and self._last.keep_alive):
            self.close()  # never send on a connection with an unread or closing answer
        if self.sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            if self.scheme == "https":
                import ssl

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
            self.sock, self._f = sock, sock.makefile("rb")
        self.sock.settimeout(self.timeout)
        host = self.host if ":" not in self.host else f"[{self.host}]"
        lines = [f"{method} {target} HTTP/1.1", f"host: {host}:{self.port}",
                 *(f"{k}: {v}" for k, v in headers.items()), f"content-length: {len(body or b'')}", "", ""]
        self.sock.sendall("\r\n".join(lines).encode("latin-1") + (body or b""))
        self._method = method

    def getresponse(self) -> _Response:
        self._last = _Response(self._f, head_only=self._method == "HEAD")
        return self._last


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
        self.url = url
        self._conn = _Conn(u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80), self.target.timeout_s)
        self._prefix = u.path.rstrip("/")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: Any, params: list[tuple[str, str]] | None,
              timeout: float | None) -> _Response:
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
                  timeout: float | None) -> _Response:
        url = self._prefix + path + (("?" + urlencode(params)) if params else "")
        data = None if body is None else json.dumps(body).encode()
        self._conn.timeout = timeout or self.target.timeout_s
        for fresh in (False, True):
            try:
                self._conn.request(method, url, body=data, headers=self._headers)
                return self._conn.getresponse()
            except (ConnectionRefusedError, FileNotFoundError) as e:
                self._conn.close()
                raise ServerUnreachable(f"no DSec server answers at {self.url}", url=self.url,
                                        reason=e.strerror or str(e)) from None
            except (_RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
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
