"""Where the SDK/CLI finds the server and token, without configuration on the embedded default.

Order: explicit argument > ``DSEC_URL`` / ``DSEC_TOKEN`` > files written by ``dsec serve``
under ``DSEC_HOME`` (``server.json`` with the URL, ``token`` with the local admin token)
> ``http://127.0.0.1:7070``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dsec.config import Settings, load_settings

SERVER_FILE = "server.json"
TOKEN_FILE = "token"


@dataclass(frozen=True)
class ClientConfig:
    url: str
    token: str | None
    retries: int
    backoff_s: float
    backoff_max_s: float
    timeout_s: float
    max_connections: int
    max_keepalive: int
    keepalive_s: float


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


def resolve_config(url: str | None = None, token: str | None = None, *, retries: int | None = None,
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
    return ClientConfig(url=url.rstrip("/"), token=token, retries=s.client_retries if retries is None else retries,
                        backoff_s=s.client_backoff_s, backoff_max_s=s.client_backoff_max_s,
                        timeout_s=s.client_timeout_s if timeout is None else timeout,
                        max_connections=s.client_max_connections, max_keepalive=s.client_max_keepalive,
                        keepalive_s=s.client_keepalive_s)
