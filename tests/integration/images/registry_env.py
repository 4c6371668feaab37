"""Test helpers for registry tests: the real CNCF distribution registry (Debian's
``docker-registry``) on a free loopback port with its own storage dir and config
(optionally htpasswd basic auth, bearer-token auth, or TLS), a tiny standard bearer
token server, and a fake registry that can serve corrupt bytes. Every server is
stopped by the fixture that started it (registry by PID, in-process servers by flag).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

USER, PASSWORD = "dsec-user", "s3cret-pw"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed(dir_: Path, cn: str = "127.0.0.1") -> tuple[Path, Path, Any]:
    """A self-signed cert valid for 127.0.0.1/localhost: (cert.pem, key.pem, private key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    dir_.mkdir(parents=True, exist_ok=True)
    cp, kp = dir_ / f"{cn}-cert.pem", dir_ / f"{cn}-key.pem"
    cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                     serialization.NoEncryption()))
    return cp, kp, (key, cert)


class ThreadServer:
    """A FastAPI app under uvicorn in a daemon thread on a loopback port."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class TokenServer(ThreadServer):
    """Standard registry bearer-token server: GET /token?service=&scope= with basic auth
    (USER/PASSWORD) -> {"token": JWT RS256, x5c header}; wrong credentials -> 401."""

    service = "dsec-test-registry"
    issuer = "dsec-test-issuer"

    def __init__(self, tmp: Path) -> None:
        self.cert_path, _, (self._key, cert) = self_signed(tmp / "token-ca", cn="dsec-token-signer")
        from cryptography.hazmat.primitives import serialization
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.issued = 0
        app = FastAPI()

        @app.get("/token")
        def token(request: Request) -> JSONResponse:
            auth = request.headers.get("authorization", "")
            want = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
            if auth != want:
                return JSONResponse({"details": "bad credentials"}, status_code=401)
            access = []
            for scope in request.query_params.getlist("scope"):
                typ, name, actions = scope.split(":")
                access.append({"type": typ, "name": name, "actions": actions.split(",")})
            self.issued += 1
            return JSONResponse({"token": self._jwt(access), "expires_in": 300})

        super().__init__(app)
        self.realm = f"http://127.0.0.1:{self.port}/token"

    def _jwt(self, access: list[dict[str, Any]]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        def b64(d: bytes) -> str:
            return base64.urlsafe_b64encode(d).rstrip(b"=").decode()

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        claims = {"iss": self.issuer, "sub": USER, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        sig = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{b64(sig)}"


class Registry:
    """The real distribution registry (``docker-registry serve CONFIG``) on 127.0.0.1:PORT."""

    def __init__(self, tmp: Path, auth: str | None = None, token: TokenServer | None = None,
                 tls: bool = False) -> None:
        self.dir = tmp / f"registry-{uuid.uuid4().hex[:6]}"
        self.storage = self.dir / "data"
        self.storage.mkdir(parents=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        cfg: dict[str, Any] = {
            "version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True}},
            "http": {"addr": self.host, "secret": uuid.uuid4().hex},
        }
        self.cert: Path | None = None
        if tls:
            self.cert, key, _ = self_signed(self.dir / "tls")
            cfg["http"]["tls"] = {"certificate": str(self.cert), "key": str(key)}
        if auth == "htpasswd":
            out = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], capture_output=True, text=True, check=True)
            (self.dir / "htpasswd").write_text(out.stdout.strip() + "\n")
            cfg["auth"] = {"htpasswd": {"realm": "dsec-test", "path": str(self.dir / "htpasswd")}}
        elif auth == "token":
            assert token is not None
            cfg["auth"] = {"token": {"realm": token.realm, "service": token.service, "issuer": token.issuer,
                                     "rootcertbundle": str(token.cert_path)}}
        (self.dir / "config.yml").write_text(yaml.safe_dump(cfg))
        self.log = open(self.dir / "registry.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.dir / "config.yml")],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        scheme = "https" if tls else "http"
        deadline = time.monotonic() + 15
        while True:
            try:
                httpx.get(f"{scheme}://{self.host}/v2/", verify=False, timeout=1)
                break
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"registry did not start: {(self.dir / 'registry.log').read_text()[-2000:]}")
                time.sleep(0.05)

    def blob_data(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class FakeRegistry(ThreadServer):
    """A minimal registry serving fixed manifests/blobs, with hooks to corrupt them
    (``blob_override[digest] = bytes`` serves other bytes under a digest)."""

    def __init__(self, manifests: dict[str, tuple[bytes, str]], blobs: dict[str, bytes]) -> None:
        self.manifests = manifests          # reference -> (raw, media type)
        self.blobs = blobs
        self.blob_override: dict[str, bytes] = {}
        self.break_times: dict[str, int] = {}  # digest -> how many more GETs die half-way
        self.hits: list[str] = []
        app = FastAPI()

        @app.get("/v2/")
        def ping() -> Response:
            return Response(b"{}", media_type="application/json")

        @app.get("/v2/{repo:path}/manifests/{ref}")
        def manifest(repo: str, ref: str) -> Response:
            if ref not in self.manifests:
                return Response(json.dumps({"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}),
                                status_code=404, media_type="application/json")
            raw, mt = self.manifests[ref]
            return Response(raw, media_type=mt)

        @app.get("/v2/{repo:path}/blobs/{digest}")
        def blob(repo: str, digest: str) -> Response:
            self.hits.append(digest)
            data = self.blob_override.get(digest, self.blobs.get(digest))
            if data is None:
                return Response(json.dumps({"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown"}]}),
                                status_code=404, media_type="application/json")
            if self.break_times.get(digest, 0) > 0:
                self.break_times[digest] -= 1

                def half_then_die() -> Iterator[bytes]:
                    yield data[: len(data) // 2]
                    raise ConnectionAbortedError("fake registry dies mid-transfer")

                return StreamingResponse(half_then_die(), media_type="application/octet-stream",
                                         headers={"content-length": str(len(data))})
            return Response(data, media_type="application/octet-stream")

        super().__init__(app)
        self.host = f"127.0.0.1:{self.port}"


def image_blobs(store: Any, ref: str) -> tuple[dict[str, tuple[bytes, str]], dict[str, bytes]]:
    """(manifests by tag and digest, blobs) of a local image, for a FakeRegistry."""
    info = store.resolve(ref)
    mdigest = store.manifest_digest(info.id)
    raw = store.content.read_bytes(mdigest)
    mt = json.loads(raw).get("mediaType") or "application/vnd.oci.image.manifest.v1+json"
    blobs = {d: store.content.read_bytes(d) for d in [info.id] + [li.digest for li in info.layers]}
    return {"v1": (raw, mt), mdigest: (raw, mt)}, blobs


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def store_files(root: Path) -> set[str]:
    """Every blob / layer / temp file of a store (what a failed pull must not change)."""
    out = set()
    for sub in ("blobs", "layers"):
        d = root / sub
        if d.exists():
            out |= {str(p.relative_to(root)) for p in d.rglob("*")}
    return out


def run(argv: list[str], env: dict[str, str] | None = None, stdin: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, input=stdin, check=False,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, f"{argv}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


Cleanup = Callable[[], None]
