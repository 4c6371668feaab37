"""A node's peer blob endpoint: read-only HTTP serving of its verified blobs to peers.

``GET|HEAD /v1/blobs/sha256:<hex>`` with ``Authorization: Bearer <cluster token>``:

- only digests (a path that is not ``sha256:<64 hex>`` is 404; nothing else of the
  node is reachable: no listing, no other path, no write method);
- only verified blobs: the content store holds nothing that was not hashed before it
  was renamed into place, and a blob is re-hashed the first time this process serves
  it (``ContentStore.verify``: a blob rotted on disk is removed and answered 404);
- at most ``p2p_serve_max`` bodies (of blobs over 64 KiB) at once: more get 503 +
  ``Retry-After`` and the peer asks another holder. That bound is what turns "every node fetches from the
  first holder" into a tree (``dsec.cluster.p2p``);
- the token compare is constant-time; a wrong or missing token is 401 before anything
  is looked up.

Cut-through (``cut_through``): a blob this node is still receiving (``ContentStore.
inflight``: from the registry or from another peer) is served while it arrives: the
response names the full size (``Content-Length``) and ``X-DSec-Partial: 1``, and the
body follows the partial file as it grows. Those bytes are NOT verified here (they
cannot be yet): every receiver hashes what it got and commits only on a digest match,
exactly as for a complete blob. If this node's own receive fails, the body ends short
(connection closed) and the receiver falls back to another source.

Bodies go out with ``socket.sendfile`` (no copy through Python). A stdlib threading
server: it runs inside the node agent's process (a Ray actor) without an event loop
of its own and shares nothing with the agent's data path.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dsec.errors import DigestMismatch, NotFound

log = logging.getLogger("dsec.cluster.p2p")

# A cut-through body goes out in pieces of at least this much (or what arrived within
# BATCH_WAIT_S): following every small registry chunk as it lands would cost a wake-up
# and a sendfile per chunk at each hop, and the next hop would see the same small chunks.
BATCH = 256 << 10
SMALL_BLOB = 64 << 10  # served without taking one of the p2p_serve_max slots (configs, manifests)

BLOB_PATH = re.compile(r"/v1/blobs/(sha256:[0-9a-f]{64})")


def parse_blob_path(path: str) -> str | None:
    """The digest a request path names, or None (pure)."""
    m = BLOB_PATH.fullmatch(path.split("?", 1)[0])
    return m.group(1) if m else None


def token_ok(header: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time (pure)."""
    if not header or not token or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), token.encode())


class BlobServer:
    """Serves ``store``'s verified blobs on ``host:port`` (see module docstring)."""

    def __init__(self, store: Any, host: str, port: int, token: str, max_serving: int,
                 on_serve: Callable[[str, int], None] | None = None, cut_through: bool = True,
                 admit: Callable[[str, str], bool] | None = None,
                 stall_s: float = 60.0) -> None:
        self.store = store
        self.cut_through = cut_through
        self.stall_s = stall_s  # a partial body with no new bytes for this long is cut (its source hangs)
        self.served_partial = 0    # bodies that began while this node was still receiving them
        self.on_serve = on_serve  # (digest, times this node began serving it): fetchers prefer fresh holders
        self.per_digest: dict[str, int] = {}
        # (digest, requesting node) -> False: answer 503, this holder already feeds enough
        # peers of this blob in this burst and another holder can take the requester.
        self.admit = admit
        self.token = token
        self.slots = threading.BoundedSemaphore(max_serving)
        self.served_bytes = 0      # bodies sent in full (bench/tests read it)
        self.served = 0
        self.refused_busy = 0
        self._count = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("blob endpoint: " + format, *args)

            def _plain(self, code: int, text: str, extra: dict[str, str] | None = None) -> None:
                body = (text + "\n").encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                if not token_ok(self.headers.get("Authorization"), server.token):
                    self._plain(401, "unauthorized: this endpoint needs the cluster's peer token")
                    return
                digest = parse_blob_path(self.path)
                if digest is None:
                    self._plain(404, "not found: only /v1/blobs/sha256:<64 hex> is served")
                    return
                content = server.store.content
                inflight = None
                if not content.has(digest):
                    inflight = content.inflight.get(digest) if server.cut_through else None
                    if inflight is None:
                        self._plain(404, f"blob {digest} is not on this node")
                        return
                try:
                    size = inflight.size if inflight is not None else content.size(digest)
                except FileNotFoundError:  # removed (GC) since has()
                    self._plain(404, f"blob {digest} is not on this node")
                    return
                # The bound is on bandwidth: a tiny blob (a config) never waits behind long
                # layer bodies (cut-through ones hold a slot for the whole registry fetch).
                slot = size > SMALL_BLOB
                if slot and not server.slots.acquire(blocking=False):
                    with server._count:
                        server.refused_busy += 1
                    self._plain(503, "busy: serving as many peers as allowed (p2p_serve_max)",
                                {"Retry-After": "1"})
                    return
                try:
                    if (self.command == "GET" and server.admit is not None
                            and not server.admit(digest, self.headers.get("X-DSec-Node", ""))):
                        with server._count:
                            server.refused_busy += 1
                        self._plain(503, "busy: feeding as many peers of this blob as allowed (p2p_serve_max); "
                                    "ask another holder", {"Retry-After": "1"})
                        return
                    if inflight is not None:
                        try:
                            fh = open(inflight.path, "rb")  # noqa: SIM115 - closed in _partial
                        except FileNotFoundError:  # committed (renamed) or failed meanwhile
                            fh = None
                        if fh is not None:
                            self._partial(inflight, fh)
                            return
                    try:
                        fh = content.open(digest, f"blob {digest} (peer request)")  # verified once per process
                    except (NotFound, DigestMismatch):
                        self._plain(404, f"blob {digest} is not on this node")
                        return
                    with server._count:
                        n = server.per_digest[digest] = server.per_digest.get(digest, 0) + 1
                    if server.on_serve is not None and self.command == "GET":
                        try:
                            server.on_serve(digest, n)
                        except Exception:
                            log.debug("publishing a serve count failed", exc_info=True)
                    with fh:
                        size = os.fstat(fh.fileno()).st_size
                        self.send_response(200)
                        self.send_header("Content-Type", "application/octet-stream")
                        self.send_header("Content-Length", str(size))
                        self.send_header("Docker-Content-Digest", digest)
                        self.end_headers()
                        if self.command == "HEAD":
                            return
                        self.wfile.flush()
                        sent = self.connection.sendfile(fh)
                    with server._count:
                        server.served += 1
                        server.served_bytes += sent
                finally:
                    if slot:
                        server.slots.release()

            def _partial(self, inf: Any, fh: Any) -> None:
                """Stream a blob this node is still receiving, following its partial file."""
                with fh:
                    with server._count:
                        n = server.per_digest[inf.digest] = server.per_digest.get(inf.digest, 0) + 1
                        server.served_partial += 1
                    if server.on_serve is not None and self.command == "GET":
                        try:
                            server.on_serve(inf.digest, n)
                        except Exception:
                            log.debug("publishing a serve count failed", exc_info=True)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(inf.size))
                    self.send_header("Docker-Content-Digest", inf.digest)
                    self.send_header("X-DSec-Partial", "1")
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    self.wfile.flush()
                    sent = 0
                    while sent < inf.size:
                        written, state = inf.wait(sent, server.stall_s, BATCH)
                        if written > sent:
                            sent += self.connection.sendfile(fh, sent, min(written, inf.size) - sent)
                            continue
                        if state == "receiving":
                            log.warning("blob %s: no new bytes for %.0fs: cut-through body cut", inf.digest,
                                        server.stall_s)
                        # Failed, stalled, or (done) bytes beyond what was announced: end short.
                        # The receiver sees a truncated body and goes to another source.
                        self.close_connection = True
                        return
                    with server._count:
                        server.served += 1
                        server.served_bytes += sent

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.httpd = Server((host, port), Handler)
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dsec-blob-endpoint", daemon=True)

    def start(self) -> BlobServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def stats(self) -> dict[str, int]:
        with self._count:
            return {"served": self.served, "served_bytes": self.served_bytes, "refused_busy": self.refused_busy,
                    "served_partial": self.served_partial}
