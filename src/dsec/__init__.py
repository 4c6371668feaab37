"""DSec: fast, secure, recoverable sandboxes for AI-agent training.

Public surface (loaded lazily so node-side code importing ``dsec.*`` does not pay for
the HTTP client)::

    import dsec
    with dsec.Sandbox.create(image="python", labels={"run": "r1"}) as sb:
        print(sb.exec("python -c 'print(1)'").stdout)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncEpisode", "AsyncLease", "AsyncSandbox", "Lease", "CheckpointInfo", "Client", "Episode", "Sandbox", "errors", "ExecResult", "ExecEvent", "SandboxInfo",
    "SandboxSpec", "FileEntry", "DSecError", "__version__", "usage", "ausage", "UsageReport",
]

if TYPE_CHECKING:
    from dsec import errors
    from dsec.errors import DSecError
    from dsec.models import ExecEvent, ExecResult, FileEntry, SandboxInfo, SandboxSpec
    from dsec.models.usage import UsageReport
    from dsec.sdk import AsyncClient, AsyncSandbox, CheckpointInfo, Client, Sandbox
    from dsec.sdk.async_episode import AsyncEpisode
    from dsec.sdk.episode import Episode
    from dsec.sdk.lease import AsyncLease, Lease
    from dsec.sdk.usage import ausage, usage

_LAZY = {
    "CheckpointInfo": "dsec.sdk", "Lease": "dsec.sdk.lease", "AsyncLease": "dsec.sdk.lease",
    "Episode": "dsec.sdk.episode", "AsyncEpisode": "dsec.sdk.async_episode", "AsyncClient": "dsec.sdk", "AsyncSandbox": "dsec.sdk", "Client": "dsec.sdk", "Sandbox": "dsec.sdk",
    "ExecResult": "dsec.models", "FileEntry": "dsec.models", "SandboxInfo": "dsec.models",
    "SandboxSpec": "dsec.models", "ExecEvent": "dsec.models", "DSecError": "dsec.errors",
    "usage": "dsec.sdk.usage", "ausage": "dsec.sdk.usage", "UsageReport": "dsec.models.usage",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "errors":
        return importlib.import_module("dsec.errors")
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsec' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
