"""Wire models shared by the API server, the SDK and the node agent."""

from dsec.models.image import ImageInfo, LayerInfo
from dsec.models.sandbox import (
    BackgroundProcess,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEntry,
    Isolation,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)

__all__ = [
    "BackgroundProcess", "ExecEvent", "ExecRequest", "ExecResult", "FileEntry", "Isolation", "SandboxInfo",
    "SandboxSpec", "SandboxState", "ImageInfo", "LayerInfo",
]
