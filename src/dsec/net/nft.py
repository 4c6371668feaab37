"""nftables through libnftables (the library behind the ``nft`` command), via ctypes.

Calling the library in-process instead of spawning ``nft -f -`` per change keeps an
attach (one transaction) around a millisecond instead of a fork+exec. Each call runs
one script as one atomic kernel transaction: it fully applies or not at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import threading
from typing import Any

from dsec.errors import SandboxFailure

_lib = ctypes.CDLL(ctypes.util.find_library("nftables") or "libnftables.so.1", use_errno=True)
_lib.nft_ctx_new.restype = ctypes.c_void_p
_lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
_lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
_lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
_lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
_lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
_lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
_lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
_lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
_lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
_lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_lib.nft_run_cmd_from_buffer.restype = ctypes.c_int

_NFT_CTX_DEFAULT = 0
_NFT_CTX_OUTPUT_JSON = 1 << 4


class NftError(SandboxFailure):
    """An nftables transaction was refused by the kernel or the parser."""


class Nft:
    """One libnftables context; calls are serialised (the context is not thread-safe)."""

    def __init__(self) -> None:
        self._ctx = _lib.nft_ctx_new(_NFT_CTX_DEFAULT)
        if not self._ctx:
            raise NftError("cannot create an nftables context (is libnftables installed?)")
        _lib.nft_ctx_buffer_output(self._ctx)
        _lib.nft_ctx_buffer_error(self._ctx)
        self._lock = threading.Lock()

    def _run(self, script: str, json_out: bool) -> str:
        with self._lock:
            if not self._ctx:  # closed: a pool build still in its worker thread must not touch freed memory
                raise NftError("the nftables context is closed (network manager stopped)")
            _lib.nft_ctx_output_set_flags(self._ctx, _NFT_CTX_OUTPUT_JSON if json_out else 0)
            rc = _lib.nft_run_cmd_from_buffer(self._ctx, script.encode())
            out = (_lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode()
            err = (_lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode()
        if rc != 0:
            raise NftError(f"nftables refused the change: {err.strip() or 'unknown error'}",
                           script=script[:2000])
        return out

    def run(self, script: str) -> None:
        """Apply ``script`` (nft syntax, many lines) as one atomic transaction."""
        if script.strip():
            self._run(script, json_out=False)

    def list_json(self, command: str) -> list[dict[str, Any]]:
        """``nft -j <command>`` as parsed objects (empty list if the object is absent)."""
        try:
            out = self._run(command, json_out=True)
        except NftError as e:
            if "No such file or directory" in e.message:
                return []
            raise
        return json.loads(out).get("nftables", []) if out.strip() else []

    def close(self) -> None:
        with self._lock:
            if self._ctx:
                _lib.nft_ctx_free(self._ctx)
                self._ctx = None
