"""OCI distribution (registry v2) client: references, auth, blobs and manifests over httpx.

Pure decisions (reference parsing, which schemes may be tried, challenge parsing, which
manifest of an index to use) are small functions at the top; ``RegistryClient`` does
the HTTP. Store-side work (verify, commit, register) is in ``registry_ops.py``.

Auth: a 401 carries ``WWW-Authenticate``. ``Basic`` -> the configured user/password on
every request. ``Bearer realm=..,service=..,scope=..`` -> GET the realm with the
service and scope (with basic credentials when we have them), cache the token per
scope, retry. A second 401 after authenticating is ``Unauthorized`` naming the registry
and user (never the password).

Transport: https first. Plain http is tried only when the https connection itself
fails (the server does not speak TLS) AND the host is loopback or the caller passed
``insecure=True``; a certificate that does not verify is never "fixed" by falling back
to http. ``insecure`` also turns certificate verification off (like skopeo's
``--tls-verify=false``).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx

from dsec.errors import (
    DSecError,
    Forbidden,
    ImageError,
    InvalidArgument,
    NotFound,
    TransientError,
    Unauthorized,
)
from dsec.images import media

MANIFEST_ACCEPT = f"{media.MT_OCI_MANIFEST}, {media.MT_DOCKER_MANIFEST}, {media.MT_OCI_INDEX}, {media.MT_DOCKER_LIST}"
MAX_MANIFEST_BYTES = 4 << 20   # the distribution spec's recommended manifest limit
MAX_CONFIG_BYTES = 16 << 20
CHUNK = 1 << 20

_REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


# --- pure decisions -----------------------------------------------------------------

@dataclass(frozen=True)
class Reference:
    registry: str          # HOST[:PORT]
    repository: str        # path inside the registry, e.g. "library/python"
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest when given, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f"@{self.digest}" if self.digest else f":{self.tag}")

    def local_name(self) -> str:
        """The name a pulled image gets in the local store."""
        if self.digest:
            return f"{self.registry}/{self.repository}@{self.digest}"
        return f"{self.registry}/{self.repository}:{self.tag or 'latest'}"


def _is_registry_host(part: str) -> bool:
    return "." in part or ":" in part or part == "localhost" or part.startswith("[")


def parse_reference(ref: str, default_registry: str = "") -> Reference:
    """``HOST[:PORT]/REPO[:TAG][@sha256:HEX]``; a ref without a host uses ``default_registry``."""
    text = ref.strip()
    if not text or any(c.isspace() for c in text):
        raise InvalidArgument(f"invalid image reference {ref!r}: expected HOST[:PORT]/REPO[:TAG|@sha256:...]")
    digest = None
    if "@" in text:
        text, digest = text.rsplit("@", 1)
        if not _DIGEST_RE.fullmatch(digest):
            raise InvalidArgument(f"invalid image reference {ref!r}: digest {digest!r} is not sha256:<64 hex>")
    first, _, rest = text.partition("/")
    if rest and _is_registry_host(first):
        registry, path = first, rest
    elif default_registry:
        registry, path = default_registry.rstrip("/"), text
    else:
        raise InvalidArgument(f"image reference {ref!r} names no registry: write HOST[:PORT]/REPO[:TAG] "
                              "(or set image_registry / DSEC_IMAGE_REGISTRY)")
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG_RE.fullmatch(tag):
            raise InvalidArgument(f"invalid image reference {ref!r}: bad tag {tag!r}")
    if not _REPO_RE.fullmatch(path):
        raise InvalidArgument(f"invalid image reference {ref!r}: repository {path!r} must be lowercase "
                              "[a-z0-9] components separated by '/', '.', '_' or '-'")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)


def host_of(registry: str) -> str:
    if registry.startswith("["):
        return registry[1:registry.index("]")]
    return registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry


def is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def schemes_to_try(registry: str, insecure: bool) -> list[str]:
    """https always first; plain http only for loopback hosts or with --insecure."""
    return ["https", "http"] if insecure or is_loopback(host_of(registry)) else ["https"]


_CHALLENGE_RE = re.compile(r'(\w+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^,\s]*))')


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="x",service="y"`` -> ("bearer", {"realm": "x", "service": "y"})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
              for m in _CHALLENGE_RE.finditer(rest)}
    return scheme.lower(), params


def pick_platform(index: dict[str, Any], what: str) -> dict[str, Any]:
    """linux/amd64 entry of an image index / manifest list (entries without a platform count)."""
    for desc in index.get("manifests") or []:
        plat = desc.get("platform") or {}
        if plat.get("architecture", "amd64") == "amd64" and plat.get("os", "linux") == "linux":
            return dict(desc)
    raise ImageError(f"{what}: the image index has no linux/amd64 manifest")


def error_text(resp: httpx.Response) -> str:
    """The registry's own error codes/messages (OCI error body), or the status line."""
    try:
        body = json.loads(resp.read()[:65536])
        errs = body.get("errors") or []
        parts = [f"{e.get('code')}: {e.get('message')}" for e in errs if isinstance(e, dict)]
        if parts:
            return "; ".join(parts)
    except (ValueError, AttributeError, httpx.HTTPError):
        pass
    return f"HTTP {resp.status_code} {resp.reason_phrase}"


def _widen_reads(resp: httpx.Response, size: int = 1 << 20) -> None:
    """Best effort: let this response's HTTP/1.1 connection read up to ``size`` bytes per
    recv instead of httpcore's 64 KiB. Each recv is a GIL round trip; on a CPU-starved
    node (the bench machine runs at load 10 on 2 cores) 16x fewer of them made a
    python-image pull ~1.3x faster. Set on this connection instance only (never on the
    class: the SDK's small exec calls share the process); if httpx/httpcore internals
    differ, nothing changes."""
    obj: object = resp.stream
    for _ in range(6):
        if hasattr(type(obj), "READ_NUM_BYTES"):
            try:
                obj.READ_NUM_BYTES = size  # type: ignore[attr-defined]
            except AttributeError:
                pass
            return
        nxt = None
        for attr in ("_stream", "_httpcore_stream", "_connection"):
            nxt = getattr(obj, attr, None)
            if nxt is not None:
                break
        if nxt is None:
            return
        obj = nxt


# --- the client -----------------------------------------------------------------------

_SSL_CONTEXTS: dict[str, ssl.SSLContext] = {}
_SSL_LOCK = threading.Lock()


def _ssl_context(ca_file: Path | None) -> ssl.SSLContext:
    """System roots (+ ca_file), built once per process: loading the system bundle costs
    ~0.1 s, which a node pulling image after image should pay once."""
    key = str(ca_file or "")
    with _SSL_LOCK:
        ctx = _SSL_CONTEXTS.get(key)
        if ctx is None:
            ctx = ssl.create_default_context()
            if ca_file is not None:
                ctx.load_verify_locations(cafile=str(ca_file))
            _SSL_CONTEXTS[key] = ctx
        return ctx



class RegistryClient:
    """One registry (HOST[:PORT]); thread-safe (one httpx pool, token cache under a lock)."""

    def __init__(self, registry: str, *, username: str | None = None, password: str | None = None,
                 insecure: bool = False, ca_file: Path | None = None, timeout_s: float = 60.0,
                 pool: int = 8) -> None:
        self.registry = registry
        self.insecure = insecure
        self._creds = (username, password or "") if username else None
        verify: bool | ssl.SSLContext = False if insecure else _ssl_context(ca_file)
        self._http = httpx.Client(verify=verify, timeout=httpx.Timeout(timeout_s),
                                  limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
                                  follow_redirects=True, headers={"User-Agent": "dsec-registry-client"})
        self._base: str | None = None
        self._lock = threading.Lock()
        self._basic = False                       # registry asked for Basic auth
        self._bearer: dict[str, str] = {}         # scope -> token
        self._challenge: dict[str, str] | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport / auth --------------------------------------------------------------
    def base(self) -> str:
        """Scheme + host, found once with ``GET /v2/`` (the API version check)."""
        with self._lock:
            if self._base is not None:
                return self._base
            errors: list[str] = []
            for scheme in schemes_to_try(self.registry, self.insecure):
                url = f"{scheme}://{self.registry}"
                try:
                    r = self._http.get(url + "/v2/")
                except httpx.ConnectError as exc:
                    if isinstance(exc.__cause__, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
                        raise ImageError(f"registry {self.registry}: TLS certificate does not verify ({exc}); "
                                         "trust its CA with registry_ca_file, or pass --insecure") from exc
                    errors.append(f"{scheme}: {exc}")
                    continue
                except httpx.TransportError as exc:
                    errors.append(f"{scheme}: {exc}")
                    continue
                if r.status_code == 401:
                    self._note_challenge(r)
                elif r.status_code == 404:
                    raise ImageError(f"{url} is not an OCI/Docker registry (GET /v2/ answered 404)")
                self._base = url
                return url
            hint = "" if len(errors) > 1 or is_loopback(host_of(self.registry)) else \
                " (plain http is tried only for loopback hosts or with --insecure)"
            raise TransientError(f"registry {self.registry} is not reachable: {'; '.join(errors)}{hint}",
                                 registry=self.registry)

    def _note_challenge(self, r: httpx.Response) -> tuple[str, dict[str, str]]:
        scheme, params = parse_challenge(r.headers.get("www-authenticate", ""))
        if scheme == "basic":
            self._basic = True
        elif scheme == "bearer":
            self._challenge = params
        return scheme, params

    def _auth_header(self, scope: str) -> dict[str, str]:
        with self._lock:
            tok = self._bearer.get(scope)
        if tok:
            return {"Authorization": f"Bearer {tok}"}
        if self._basic and self._creds:
            user, pw = self._creds
            return {"Authorization": "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()}
        return {}

    def _fetch_token(self, params: dict[str, str], scope: str) -> None:
        realm = params.get("realm")
        if not realm:
            raise ImageError(f"registry {self.registry}: Bearer challenge without a realm")
        # Ask for what we will do (e.g. pull,push) and for what the challenge named, if other.
        q = [("service", params["service"])] if params.get("service") else []
        # (a scope string may hold several space-separated scopes: one parameter each)
        q += [("scope", sc) for sc in dict.fromkeys((scope + " " + (params.get("scope") or "")).split())]
        try:
            r = self._http.get(realm, params=q, auth=httpx.BasicAuth(*self._creds) if self._creds else None)
        except httpx.TransportError as exc:
            raise TransientError(f"token server {realm} of registry {self.registry} is not reachable: {exc}",
                                 registry=self.registry) from exc
        if r.status_code in (401, 403):
            raise Unauthorized(f"token server {realm} of registry {self.registry} refused "
                               f"{self._who()}: {error_text(r)}", registry=self.registry)
        if r.status_code != 200:
            raise ImageError(f"token server {realm} of registry {self.registry}: {error_text(r)}")
        try:
            body = r.json()
            tok = body.get("token") or body.get("access_token")
        except ValueError:
            tok = None
        if not tok:
            raise ImageError(f"token server {realm} of registry {self.registry} answered no token")
        with self._lock:
            self._bearer[scope] = str(tok)

    def _who(self) -> str:
        return f"user {self._creds[0]!r}" if self._creds else "anonymous access (no credentials given)"

    def request(self, method: str, path_or_url: str, scope: str, *, what: str,
                headers: dict[str, str] | None = None, content: Callable[[], Any] | None = None,
                stream: bool = False, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        """One authenticated call. ``content`` is a factory so a body can be re-sent after
        a 401. Returns the response (open when ``stream``); raises a DSecError naming
        ``what`` for anything outside ``ok``."""
        url = path_or_url if "://" in path_or_url else self.base() + path_or_url
        for attempt in range(2):
            h = dict(headers or {})
            h.update(self._auth_header(scope))
            body = content() if content is not None else None
            try:
                req = self._http.build_request(method, url, headers=h, content=body)
                r = self._http.send(req, stream=True)
            except httpx.TransportError as exc:
                raise TransientError(f"registry {self.registry}: {what}: {type(exc).__name__}: {exc}",
                                     registry=self.registry) from exc
            if r.status_code == 401 and attempt == 0:
                r.read()
                r.close()
                kind, params = self._note_challenge(r)
                if kind == "bearer":
                    self._fetch_token(params, scope)
                    continue
                if kind == "basic" and self._creds:
                    continue
                raise Unauthorized(f"registry {self.registry} requires credentials for {what}: give --username "
                                   "and --password-stdin (or DSEC_REGISTRY_USERNAME/PASSWORD)",
                                   registry=self.registry)
            if r.status_code in ok:
                if not stream:
                    r.read()
                    r.close()
                return r
            r.read()
            r.close()
            raise self._error(r, what)
        raise AssertionError("unreachable")

    def _error(self, r: httpx.Response, what: str) -> DSecError:
        text = error_text(r)
        where = f"registry {self.registry}"
        if r.status_code == 401:
            return Unauthorized(f"{where} refused {self._who()} for {what}: {text}", registry=self.registry)
        if r.status_code == 403:
            return Forbidden(f"{where} forbids {what} to {self._who()}: {text}", registry=self.registry)
        if r.status_code == 404:
            return NotFound(f"{where}: {what}: not found ({text})", registry=self.registry)
        if r.status_code >= 500 or r.status_code == 429:
            return TransientError(f"{where}: {what}: {text}", registry=self.registry)
        return ImageError(f"{where}: {what}: {text}", registry=self.registry, status=r.status_code)

    # --- API -------------------------------------------------------------------------
    @staticmethod
    def scope(repo: str, push: bool = False) -> str:
        return f"repository:{repo}:{'pull,push' if push else 'pull'}"

    def get_manifest(self, repo: str, reference: str, what: str) -> tuple[bytes, str, str | None]:
        """(raw bytes, media type, Docker-Content-Digest header or None)."""
        r = self.request("GET", f"/v2/{repo}/manifests/{reference}", self.scope(repo), what=what,
                         headers={"Accept": MANIFEST_ACCEPT}, stream=True)
        try:
            if int(r.headers.get("content-length") or 0) > MAX_MANIFEST_BYTES:
                raise ImageError(f"{what}: manifest is larger than {MAX_MANIFEST_BYTES} bytes")
            buf = bytearray()
            try:
                for chunk in r.iter_bytes():
                    buf += chunk
                    if len(buf) > MAX_MANIFEST_BYTES:
                        raise ImageError(f"{what}: manifest is larger than {MAX_MANIFEST_BYTES} bytes")
            except (httpx.TransportError, httpx.StreamError, httpx.DecodingError) as exc:
                raise TransientError(f"registry {self.registry}: {what}: the connection broke while reading the "
                                     f"manifest ({type(exc).__name__}: {exc})", registry=self.registry) from exc
        finally:
            r.close()
        mt = r.headers.get("content-type", "").split(";")[0].strip()
        return bytes(buf), mt, r.headers.get("docker-content-digest")

    @contextmanager
    def blob_stream(self, repo: str, digest: str, what: str) -> Iterator[httpx.Response]:
        r = self.request("GET", f"/v2/{repo}/blobs/{digest}", self.scope(repo), what=what,
                         headers={"Accept-Encoding": "identity"}, stream=True)
        _widen_reads(r)
        try:
            yield r
        finally:
            r.close()

    def blob_exists(self, repo: str, digest: str, push: bool = True) -> bool:
        r = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", self.scope(repo, push), what=f"HEAD blob {digest}",
                         ok=(200, 404))
        return r.status_code == 200

    def upload_blob(self, repo: str, digest: str, path: Path, size: int, chunk_bytes: int = 0,
                    progress: Callable[[int], None] | None = None, mount_from: str | None = None) -> bool:
        """POST an upload session, then one monolithic PUT (chunk_bytes=0) or PATCH
        chunks + a closing PUT. The blob's bytes are sent exactly as stored. With
        ``mount_from`` (a repository of this registry believed to hold the blob) the POST
        asks to mount it from there first: 201 = mounted, nothing sent (returns True);
        202 = the registry declined and opened a normal upload session instead."""
        scope = self.scope(repo, push=True)
        what = f"upload of blob {digest} to {repo}"
        path_q = f"/v2/{repo}/blobs/uploads/"
        if mount_from:
            try:
                r = self.request("POST", f"{path_q}?mount={digest}&from={mount_from}",
                                 f"{scope} {self.scope(mount_from)}", what=what, ok=(201, 202),
                                 headers={"Content-Length": "0"})
            except (NotFound, Forbidden, Unauthorized, ImageError):
                r = None  # no access to the source repo (or no mount support): upload it
            if r is not None and r.status_code == 201:
                return True
        else:
            r = None
        if r is None:
            r = self.request("POST", path_q, scope, what=what, ok=(202,), headers={"Content-Length": "0"})
        loc = self._location(r, what)

        def reader(start: int, length: int) -> Callable[[], Iterator[bytes]]:
            def gen() -> Iterator[bytes]:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    left = length
                    while left > 0:
                        data = fh.read(min(CHUNK, left))
                        if not data:
                            raise ImageError(f"{what}: {path} is shorter than {size} bytes")
                        left -= len(data)
                        if progress is not None:
                            progress(len(data))
                        yield data
            return gen

        if chunk_bytes <= 0 or size <= chunk_bytes:
            url = str(httpx.URL(loc).copy_merge_params({"digest": digest}))
            self.request("PUT", url, scope, what=what, ok=(201,), content=reader(0, size),
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
            return False
        off = 0
        while off < size:
            n = min(chunk_bytes, size - off)
            r = self.request("PATCH", loc, scope, what=what, ok=(202,), content=reader(off, n),
                             headers={"Content-Type": "application/octet-stream", "Content-Length": str(n),
                                      "Content-Range": f"{off}-{off + n - 1}"})
            loc = self._location(r, what)
            off += n
        url = str(httpx.URL(loc).copy_merge_params({"digest": digest}))
        self.request("PUT", url, scope, what=what, ok=(201,), headers={"Content-Length": "0"})
        return False

    def _location(self, r: httpx.Response, what: str) -> str:
        loc = r.headers.get("location")
        if not loc:
            raise ImageError(f"registry {self.registry}: {what}: answer has no Location header")
        return str(r.request.url.join(loc))  # may be relative (spec)

    def put_manifest(self, repo: str, reference: str, raw: bytes, media_type: str) -> str | None:
        r = self.request("PUT", f"/v2/{repo}/manifests/{reference}", self.scope(repo, push=True),
                         what=f"manifest PUT {repo}:{reference}", ok=(201,), content=lambda: raw,
                         headers={"Content-Type": media_type})
        return r.headers.get("docker-content-digest")


__all__ = ["Reference", "RegistryClient", "is_loopback", "parse_challenge", "parse_reference", "pick_platform",
           "schemes_to_try"]
