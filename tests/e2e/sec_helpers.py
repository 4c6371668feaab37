"""Helpers for the issue-18 security e2e tests: raw sockets (half-sent requests, bodies
that are never finished) and the server's resident memory from /proc."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit


def _addr(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


def open_request(url: str, method: str, target: str, headers: dict[str, str], body: bytes = b"",
                 complete_headers: bool = True, timeout: float = 10) -> socket.socket:
    """A socket with a request written to it: the header block (or only part of it when
    ``complete_headers`` is False) and ``body`` (which may be a fraction of Content-Length)."""
    s = socket.create_connection(_addr(url), timeout=timeout)
    head = f"{method} {target} HTTP/1.1\r\nHost: test\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    s.sendall(head.encode() + (b"\r\n" + body if complete_headers else b""))
    return s


def read_status(s: socket.socket, timeout: float) -> int | None:
    """The status code of the response on ``s`` within ``timeout`` (None: no answer)."""
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return None
    except ConnectionError:
        pass
    if not data.startswith(b"HTTP/1."):
        return None
    return int(data.split(b" ", 2)[1])


def is_closed(s: socket.socket, timeout: float = 0.0) -> bool:
    """True when the server closed ``s`` (EOF or reset) within ``timeout``."""
    s.settimeout(timeout if timeout > 0 else 0.001)
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionError:
        return True


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


@dataclass
class Peak:
    growth_mib: float = 0.0


@contextlib.contextmanager
def peak_rss_growth(pid: int) -> Iterator[Peak]:
    """Peak resident memory of process ``pid`` during the block, over its RSS at the start
    (VmHWM is reset through /proc/PID/clear_refs first, so earlier peaks do not count)."""
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")
    base = status_kib(pid, "VmRSS")
    peak = Peak()
    try:
        yield peak
    finally:
        time.sleep(0.2)
        peak.growth_mib = (status_kib(pid, "VmHWM") - base) / 1024
