"""E2B wire formats, as pure functions: the REST models of the E2B control-plane API, the
Connect protocol (JSON codec) that the SDK speaks to envd, the envd multipart upload, and
the mapping of DSec objects and errors onto them. No I/O here: ``dsec.api.compat.e2b``
does the routing and calls the service layer.

Connect protocol (https://connectrpc.com/docs/protocol), JSON codec only — the codec the
E2B SDK uses: unary calls are ``POST /<service>/<Method>`` with an ``application/json``
body and answer ``application/json`` (errors: a non-200 status and ``{code, message}``);
server-streaming calls send and answer ``application/connect+json`` envelopes (1 flag
byte, 4-byte big-endian length, message) and the answer always ends with an end-of-stream
envelope (flag 0x02) carrying ``{}`` or ``{"error": {code, message}}``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import stat as stat_mod
import struct
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field

from dsec.errors import Conflict, DSecError, InvalidArgument, NotFound
from dsec.models import FileEntry, SandboxInfo

ENVD_VERSION = "0.5.7"
"""The envd version DSec's compat layer answers as. The SDK gates features on it: >= 0.3.0
(stdin flag), >= 0.4.0 (no per-call user header), >= 0.5.7 (octet-stream uploads); below
0.6.2 so file metadata (xattrs, unsupported here) fails in the SDK with its own message."""

CLIENT_ID = "dsec"
END_STREAM = 0x02
_COMPRESSED = 0x01
MAX_RPC_BODY = 1 << 20
"""Largest Connect request accepted (requests are small JSON: paths, argv, env)."""

# --- errors ---------------------------------------------------------------------------

# Connect code -> HTTP status for unary error answers (Connect protocol spec).
CONNECT_HTTP = {"canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
                "not_found": 404, "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429,
                "failed_precondition": 400, "aborted": 409, "out_of_range": 400, "unimplemented": 501,
                "internal": 500, "unavailable": 503, "data_loss": 500, "unauthenticated": 401}

_DSEC_TO_CONNECT = {401: "unauthenticated", 403: "permission_denied", 409: "failed_precondition",
                    413: "failed_precondition", 422: "invalid_argument", 429: "resource_exhausted",
                    502: "unavailable", 503: "unavailable", 504: "deadline_exceeded", 507: "resource_exhausted"}


class AlreadyExists(Conflict):
    """envd's ALREADY_EXISTS (``files.make_dir`` of an existing path answers False)."""

    code = "already_exists"


def sandbox_gone_message(sandbox_id: str) -> str:
    """The SDK tells "sandbox not running" from other failures by the words 'was not found'
    in a 502 / unavailable answer (what E2B's proxy answers for a dead sandbox)."""
    return f"sandbox {sandbox_id} was not found: it was killed, expired, or belongs to another tenant"


def is_sandbox_missing(err: DSecError) -> bool:
    """A NotFound about the sandbox itself (not about a path inside it)."""
    return isinstance(err, NotFound) and "sandbox_id" in err.details and "path" not in err.details


def connect_error(err: DSecError, sandbox_id: str) -> tuple[str, str]:
    """(Connect code, message) for a DSec error raised while serving an envd RPC."""
    if is_sandbox_missing(err):
        return "unavailable", sandbox_gone_message(sandbox_id)
    if isinstance(err, NotFound):
        return "not_found", err.message
    if isinstance(err, AlreadyExists):
        return "already_exists", err.message
    return _DSEC_TO_CONNECT.get(err.http_status, "internal"), err.message


def http_error(err: DSecError) -> tuple[int, dict[str, Any]]:
    """(status, body) of an E2B REST / envd HTTP error: ``{"code": <status>, "message"}``.
    DSec's 422 (bad argument) is E2B's 400."""
    status = 400 if err.http_status == 422 else err.http_status
    return status, {"code": status, "message": err.message}


# --- Connect framing ------------------------------------------------------------------

def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def end_stream(error: tuple[str, str] | None = None) -> bytes:
    """The end-of-stream envelope every streamed answer must finish with."""
    body: dict[str, Any] = {} if error is None else {"error": {"code": error[0], "message": error[1]}}
    return envelope(body, END_STREAM)


def parse_envelopes(body: bytes) -> list[bytes]:
    """Split a Connect streaming request body into its message payloads."""
    out: list[bytes] = []
    i = 0
    while i < len(body):
        if len(body) - i < 5:
            raise InvalidArgument("truncated Connect envelope header")
        flags, length = struct.unpack_from(">BI", body, i)
        i += 5
        if flags & _COMPRESSED:
            raise InvalidArgument("compressed Connect messages are not accepted (send identity)")
        if len(body) - i < length:
            raise InvalidArgument("truncated Connect envelope")
        if not flags & END_STREAM:
            out.append(body[i:i + length])
        i += length
    return out


def parse_timeout_ms(value: str | None) -> float | None:
    """``Connect-Timeout-Ms`` (at most 10 digits) in seconds; None when absent."""
    if value is None:
        return None
    if not value.isdigit() or len(value) > 10:
        raise InvalidArgument(f"Connect-Timeout-Ms must be a positive integer, got {value!r}")
    return int(value) / 1000 or None


MAX_COMMAND_S = 24 * 3600.0
"""Longest command (ExecRequest's bound); what E2B's timeout=0 (no limit) maps to."""
TIMEOUT_MARGIN_S = 0.05
"""A command's timeout is its stream's Connect-Timeout-Ms less this (at most a tenth)."""


def command_timeout(stream_timeout_s: float | None) -> float:
    """The exec timeout of a command whose stream carries ``Connect-Timeout-Ms``.

    No header is E2B's timeout=0, "no limit": the longest exec DSec runs (the sandbox's
    own timeout still ends it), not the native default for an exec without a timeout.
    Otherwise the command ends a little before the client's own deadline, so the timeout
    is reported (and audited, counted) by the server rather than the stream being cut."""
    if stream_timeout_s is None:
        return MAX_COMMAND_S
    return min(stream_timeout_s - min(TIMEOUT_MARGIN_S, stream_timeout_s / 10), MAX_COMMAND_S)


# --- envd access token ----------------------------------------------------------------

def envd_token(tenant_name: str, tenant_token_hash: str, sandbox_id: str) -> str:
    """The per-sandbox envd access token (``X-Access-Token``): it opens this one sandbox
    only. It names its tenant and is keyed by that tenant's token hash, so it survives
    server restarts and dies with the tenant's token (rotation, deletion)."""
    mac = hmac.new(tenant_token_hash.encode(), f"e2b-envd\0{tenant_name}\0{sandbox_id}".encode(), hashlib.sha256)
    name = base64.urlsafe_b64encode(tenant_name.encode()).decode().rstrip("=")
    return f"dsec_envd_{name}.{mac.hexdigest()}"


def envd_token_tenant(token: str) -> str | None:
    """The tenant name an envd token claims (unverified), or None when malformed."""
    if not token.startswith("dsec_envd_") or "." not in token or len(token) > 512:
        return None
    name = token[len("dsec_envd_"):].rpartition(".")[0]
    try:
        decoded = base64.b64decode(name + "=" * (-len(name) % 4), altchars=b"-_", validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return decoded or None


def envd_token_valid(token: str, tenant_name: str, tenant_token_hash: str, sandbox_id: str) -> bool:
    return hmac.compare_digest(token.encode(), envd_token(tenant_name, tenant_token_hash, sandbox_id).encode())


# --- REST models ----------------------------------------------------------------------

class NewSandbox(BaseModel):
    """``POST /v2/sandboxes`` body (fields the SDK sends; unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    templateID: str = Field(..., min_length=1, max_length=256)
    timeout: int | None = Field(None, ge=1, le=7 * 24 * 3600)
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    autoPause: bool | None = None
    allow_internet_access: bool | None = None
    mcp: Any = None
    network: Any = None
    volumeMounts: Any = None
    iam: Any = None


class TimeoutBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: int = Field(..., ge=0, le=7 * 24 * 3600)


class ConnectBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout: int | None = Field(None, ge=0, le=7 * 24 * 3600)


def unsupported_create_fields(body: NewSandbox) -> list[str]:
    """Create options DSec does not offer: refused by name rather than silently ignored."""
    bad = []
    if body.autoPause:
        bad.append("autoPause (pause/resume: use DSec checkpoints)")
    if body.allow_internet_access:
        bad.append("allow_internet_access=true (egress is off by default; use the native network allow-list)")
    for name in ("mcp", "network", "volumeMounts", "iam"):
        if getattr(body, name):
            bad.append(name)
    return bad


def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts or 0.0, UTC).isoformat().replace("+00:00", "Z")


def created_json(info: SandboxInfo, access_token: str) -> dict[str, Any]:
    """E2B ``Sandbox`` (answer of create and connect)."""
    return {"templateID": info.image, "sandboxID": info.id, "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
            "envdAccessToken": access_token, "trafficAccessToken": None, "domain": None}


def detail_json(info: SandboxInfo) -> dict[str, Any]:
    """E2B ``ListedSandbox`` / ``SandboxDetail``: DSec sandboxes are always 'running'
    (DSec has no paused state)."""
    started = info.started_at or info.created_at
    end = info.expires_at if info.expires_at is not None else started + info.timeout
    return {"templateID": info.image, "sandboxID": info.id, "clientID": CLIENT_ID, "startedAt": _iso(started),
            "endAt": _iso(end), "cpuCount": max(1, round(info.cpu)), "memoryMB": info.memory // (1 << 20),
            "diskSizeMB": info.disk // (1 << 20), "state": "running", "envdVersion": ENVD_VERSION,
            "metadata": dict(info.labels)}


def parse_metadata_query(value: str | None) -> dict[str, str]:
    """``?metadata=`` of ``GET /v2/sandboxes``: an urlencoded ``k=v&k2=v2`` (each part
    percent-encoded once more by the SDK)."""
    if not value:
        return {}
    from urllib.parse import unquote

    try:
        pairs = parse_qsl(value, keep_blank_values=True, strict_parsing=True, max_num_fields=64)
    except ValueError as e:
        raise InvalidArgument(f"metadata filter {value!r} must look like key=value&key2=value2 ({e})",
                              field="metadata") from None
    return {unquote(k): unquote(v) for k, v in pairs}


# --- envd: process service ------------------------------------------------------------

class ProcessConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    cmd: str = Field(..., min_length=1, max_length=4096)
    args: list[str] = Field(default_factory=list, max_length=4096)
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, max_length=4096)


class StartRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    process: ProcessConfig
    pty: Any = None
    tag: str | None = None
    stdin: bool | None = None


class ProcessSelector(BaseModel):
    model_config = ConfigDict(extra="ignore")
    pid: int | None = Field(None, ge=0, le=2**32 - 1)
    tag: str | None = None


class ConnectRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    process: ProcessSelector


class SendSignalRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    process: ProcessSelector
    signal: str | int = "SIGNAL_UNSPECIFIED"


_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


def signal_number(value: str | int) -> int:
    try:
        return _SIGNALS[value]
    except KeyError:
        raise InvalidArgument(f"signal {value!r} is not supported (SIGNAL_SIGKILL or SIGNAL_SIGTERM)",
                              field="signal") from None


_BASH_OR_SH = '[ -x /bin/bash ] && exec /bin/bash "$@"; exec /bin/sh "$@"'


def command_argv(cfg: ProcessConfig) -> list[str]:
    """The argv to run. The SDK always asks for ``/bin/bash -l -c CMD``; images without
    bash (busybox) run the same arguments with ``/bin/sh`` instead of failing."""
    if "\0" in cfg.cmd or any("\0" in a for a in cfg.args):
        raise InvalidArgument("command and arguments must not contain NUL", field="process.args")
    if cfg.cmd == "/bin/bash":
        return ["/bin/sh", "-c", _BASH_OR_SH, "sh", *cfg.args]
    return [cfg.cmd, *cfg.args]


def _b64(data: str) -> str:
    return base64.b64encode(data.encode("utf-8", errors="surrogateescape")).decode()


def start_event(pid: int) -> dict[str, Any]:
    return {"event": {"start": {"pid": pid}}}


def data_event(kind: str, data: str) -> dict[str, Any]:
    return {"event": {"data": {kind: _b64(data)}}}


def keepalive_event() -> dict[str, Any]:
    return {"event": {"keepalive": {}}}


def end_event(exit_code: int, *, signal: int | None = None) -> dict[str, Any]:
    """envd's EndEvent: a signal death reports exit code -1 and 'signal: <name>'."""
    if signal is not None:
        name = {9: "killed", 15: "terminated"}.get(signal, f"signal {signal}")
        return {"event": {"end": {"exitCode": -1, "exited": False, "status": f"signal: {name}",
                                  "error": f"signal: {name}"}}}
    end: dict[str, Any] = {"exitCode": exit_code, "exited": True, "status": f"exit status {exit_code}"}
    if exit_code != 0:
        end["error"] = f"exit status {exit_code}"
    return {"event": {"end": end}}


# --- envd: filesystem service ---------------------------------------------------------

class PathRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    path: str = Field(..., min_length=1, max_length=4096)


class ListDirRequest(PathRequest):
    depth: int = Field(1, ge=0, le=64)


class MoveRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    source: str = Field(..., min_length=1, max_length=4096)
    destination: str = Field(..., min_length=1, max_length=4096)


_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_MODE_BITS = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}


def entry_info(e: FileEntry) -> dict[str, Any]:
    """filesystem.EntryInfo (proto3 JSON: int64 size as a string, RFC 3339 time)."""
    out: dict[str, Any] = {"name": e.name, "path": e.path, "size": str(e.size), "mode": e.mode,
                           "permissions": stat_mod.filemode(_MODE_BITS.get(e.type, 0) | e.mode),
                           "owner": "root", "group": "root", "modifiedTime": _iso(e.mtime)}
    if e.type in _FILE_TYPES:
        out["type"] = _FILE_TYPES[e.type]
    if e.type == "symlink":
        out["isSymlink"] = True
    return out


def split_path(path: str) -> tuple[str, str]:
    """(parent, name) of an absolute path; ('/', '') for the root."""
    norm = "/" + "/".join(p for p in path.split("/") if p and p != ".")
    if norm == "/":
        return "/", ""
    parent, _, name = norm.rpartition("/")
    return parent or "/", name


def write_info(path: str) -> dict[str, Any]:
    """One entry of the ``POST /files`` answer."""
    return {"name": split_path(path)[1], "type": "file", "path": path}


# --- envd: multipart upload -----------------------------------------------------------

_BOUNDARY = re.compile(r'boundary="?([^";]{1,200})"?')
_DISPOSITION = re.compile(r'filename="([^"]*)"')
_FORM_ESCAPE = re.compile(r"%22|%[01][0-9A-F]|\\\\")


def _form_unescape(value: str) -> str:
    """Undo the HTML5 form-parameter escaping clients apply to filenames (httpx: '"' as
    %22, control characters as %XX, a backslash doubled)."""
    return _FORM_ESCAPE.sub(lambda m: "\\" if m.group(0) == "\\\\" else chr(int(m.group(0)[1:], 16)), value)


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """(filename, data) of each ``file`` part of a multipart/form-data body. The SDK
    names each part with the file's path in the sandbox."""
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise InvalidArgument("multipart upload without a boundary in its Content-Type")
    delim = b"--" + m.group(1).encode()
    parts = body.split(b"\r\n" + delim)
    if not parts or not parts[0].startswith(delim):
        raise InvalidArgument("multipart body does not start with its boundary")
    files: list[tuple[str, bytes]] = []
    for raw in [parts[0][len(delim):], *parts[1:]]:
        if raw.startswith(b"--"):  # closing delimiter
            break
        head, sep, data = raw.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise InvalidArgument("multipart part without a header block")
        headers = head.decode("utf-8", errors="replace")
        fm = _DISPOSITION.search(headers)
        if 'name="file"' not in headers or fm is None:
            continue
        files.append((_form_unescape(fm.group(1)), data))
    if not files:
        raise InvalidArgument("multipart upload has no 'file' part")
    return files
