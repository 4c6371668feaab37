"""DSec Python SDK: ``Sandbox``/``AsyncSandbox`` handles over ``Client``/``AsyncClient``."""

from dsec.models.checkpoint import CheckpointInfo
from dsec.sdk._client import AsyncClient, Client
from dsec.sdk._sandbox import AsyncSandbox, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "CheckpointInfo", "Client", "Sandbox"]
