"""Where the SDK/CLI finds the server and token, without configuration on the embedded default.

Order: explicit argument > ``DSEC_URL`` / ``DSEC_TOKEN`` > files written by ``dsec serve``
under ``DSEC_HOME`` (``server.json`` with the URL, ``token`` with the local admin token)
> ``http://127.0.0.1:7070``.

Several API servers on one shared state (``dsec serve --state redis://...``): give them
all, ``DSEC_URL=http://a:7070,http://b:7070`` or ``Client(url=[...])``; requests go to the
first until it cannot be reached, then fail over to the next (``ClientConfig.urls``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dsec.config import Settings, load_settings
from dsec.errors import InvalidArgument

SERVER_FILE = "server.json"
TOKEN_FILE = "token"


@dataclass(frozen=True)
class ClientConfig:
    url: str  # the server requests go to now (the first of ``urls`` until it fails)
    token: str | None
    retries: int
    backoff_s: float
    backoff_max_s: float
    timeout_s: float
    max_connections: int
    max_keepalive: int
    keepalive_s: float
    urls: tuple[str, ...] = ()  # every server to fail over between (empty = just ``url``)


def read_server_file(home: Path) -> dict[str, object] | None:
    try:
        return json.loads((home / SERVER_FILE).read_text())
    except (OSError, ValueError):
        return None


def read_token_file(home: Path) -> str | None:
    try:
        return (home / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def split_urls(url: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"http://a,http://b"`` or a list -> the servers, in order, without trailing slashes."""
    parts = url.split(",") if isinstance(url, str) else list(url)
    urls = tuple(dict.fromkeys(u.strip().rstrip("/") for u in parts if u and u.strip()))
    if not urls:
        raise InvalidArgument(f"no server URL in {url!r}: give one (http://HOST:PORT) or several, "
                              "comma-separated (DSEC_URL=http://a:7070,http://b:7070)", field="url")
    return urls


def failover_url(cfg: ClientConfig, failed: str) -> str | None:
    """Where requests go after one to ``failed`` could not be completed: the next server,
    if ``failed`` is still the current one (many requests failing at once move on once,
    not back and forth); None with a single server."""
    if len(cfg.urls) < 2 or cfg.url != failed:
        return None
    return cfg.urls[(cfg.urls.index(failed) + 1) % len(cfg.urls)]


def resolve_config(url: str | list[str] | None = None, token: str | None = None, *, retries: int | None = None,
                   timeout: float | None = None, settings: Settings | None = None) -> ClientConfig:
    s = settings or load_settings()
    home = Path(os.environ.get("DSEC_HOME", str(s.home)))
    if url is None:
        url = s.url
    if url is None:
        info = read_server_file(home)
        url = str(info["url"]) if info and "url" in info else f"http://{s.host}:{s.port}"
    if token is None:
        token = s.token or read_token_file(home)
    urls = split_urls(url)
    return ClientConfig(url=urls[0], urls=urls, token=token, retries=s.client_retries if retries is None else retries,
                        backoff_s=s.client_backoff_s, backoff_max_s=s.client_backoff_max_s,
                        timeout_s=s.client_timeout_s if timeout is None else timeout,
                        max_connections=s.client_max_connections, max_keepalive=s.client_max_keepalive,
                        keepalive_s=s.client_keepalive_s)
