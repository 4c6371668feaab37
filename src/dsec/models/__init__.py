"""Wire models shared by the API server, the SDK and the node agent."""

from dsec.models.sandbox import (
    BackgroundProcess,
    ExecRequest,
    ExecResult,
    FileEntry,
    Isolation,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
)
from dsec.models.image import ImageInfo, LayerInfo

__all__ = [
    "BackgroundProcess", "ExecRequest", "ExecResult", "FileEntry", "Isolation", "SandboxInfo",
    "SandboxSpec", "SandboxState", "ImageInfo", "LayerInfo",
]
