"""``Sandbox`` / ``AsyncSandbox`` handles (DESIGN.md §4).

Both classes inherit every operation from ``_SandboxOps``, which forwards to the
client; with a sync ``Client`` the result is the value, with an ``AsyncClient`` it is an
awaitable. Only the context-manager protocol differs between the two.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dsec.errors import InvalidArgument, NotFound
from dsec.models import SandboxInfo, SandboxSpec
from dsec.sdk import _ops
from dsec.sdk._client import AsyncClient, Client


def build_spec(**fields: Any) -> SandboxSpec:
    """Validate locally so bad arguments fail fast with the field named."""
    try:
        return SandboxSpec(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        errs = [{"field": ".".join(str(p) for p in x["loc"]), "error": x["msg"]} for x in e.errors()]
        raise InvalidArgument("invalid sandbox spec: " + "; ".join(f"{x['field']}: {x['error']}" for x in errs),
                              fields=errs) from None


class _Files:
    """``sb.files``: read/write/list/remove plus tar upload/download."""

    def __init__(self, sb: _SandboxOps) -> None:
        self._sb = sb

    def read(self, path: str) -> Any:
        return self._sb._c.read_file(self._sb.id, path)

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> Any:
        return self._sb._c.write_file(self._sb.id, path, data, mode)

    def list(self, path: str = "/") -> Any:
        return self._sb._c.list_files(self._sb.id, path)

    def remove(self, path: str, recursive: bool = False) -> Any:
        return self._sb._c.remove_file(self._sb.id, path, recursive)

    def upload_tar(self, path: str, tar_bytes: bytes) -> Any:
        return self._sb._c.upload_tar(self._sb.id, path, tar_bytes)

    def download_tar(self, path: str) -> Any:
        return self._sb._c.download_tar(self._sb.id, path)


class _Network:
    """``sb.network``: the sandbox's egress allow-list (created with ``network=[...]``)."""

    def __init__(self, sb: _SandboxOps) -> None:
        self._sb = sb

    def update(self, allow: list[str]) -> Any:
        """Replace the allow-list; takes effect at once (also cuts open flows it removes)."""
        return self._sb._c.update_network(self._sb.id, allow)


class _SandboxOps:
    _c: Any

    def __init__(self, info: SandboxInfo, client: Any) -> None:
        self.info = info
        self._c = client
        self.files = _Files(self)
        self.network = _Network(self)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} image={self.info.image} state={self.info.state.value}>"

    def exec(self, cmd: str | list[str], timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | bytes | None = None, background: bool = False) -> Any:
        """Run ``cmd`` (shell string or argv) and wait; returns ``ExecResult``."""
        return self._c.exec(self.id, _ops.exec_request(cmd, timeout, cwd, env, stdin, background))

    def exec_stream(self, cmd: str | list[str], timeout: float | None = None, cwd: str | None = None,
                    env: dict[str, str] | None = None, stdin: str | bytes | None = None) -> Any:
        """Iterate ``ExecEvent``s (stdout/stderr chunks, then one ``exit`` with the result)."""
        return self._c.exec_stream(self.id, _ops.exec_request(cmd, timeout, cwd, env, stdin))

    def processes(self) -> Any:
        return self._c.processes(self.id)

    def signal(self, pid: int, sig: int = 9) -> Any:
        return self._c.signal(self.id, pid, sig)

    def set_timeout(self, timeout: float) -> Any:
        return self._c.set_timeout(self.id, timeout)

    def reset(self) -> Any:
        """Return the sandbox to its image's pristine state and keep using it: every
        process killed, the writable layer emptied, /dev, IPC, limits and network as
        created. Same id, TTL and resources; ~2 ms on the container tier."""
        return self._c.reset(self.id)

    def clone(self, n: int = 1) -> Any:
        """``n`` new sandboxes whose files are copy-on-write copies of this one's as they
        are now (it is paused for a few ms, then runs on). Each clone is a full sandbox
        (own limits, network, TTL); kill them like any other. Returns a list of handles."""
        return self._c._run(_ops.clone(self.id, n).map(lambda infos: [type(self)(i, self._c) for i in infos]))

    def get_info(self) -> Any:
        return self._c.get(self.id)

    def audit(self, limit: int = 1000) -> Any:
        return self._c.audit(self.id, limit)

    def kill(self) -> Any:
        return self._c.kill(self.id)

    def checkpoint(self) -> Any:
        """Checkpoint the filesystem; returns ``CheckpointInfo`` (``Sandbox.restore(cp.id)``)."""
        return self._c.checkpoint(self.id)

    def checkpoints(self) -> Any:
        """Checkpoints taken of this sandbox, oldest first."""
        return self._c.checkpoints(self.id)


class Sandbox(_SandboxOps):
    """A sandbox used from synchronous code. ``with Sandbox.create(...) as sb:`` kills on exit."""

    @classmethod
    def create(cls, image: str = "busybox", *, client: Client | None = None, **spec: Any) -> Sandbox:
        c = client or Client.default()
        s = build_spec(image=image, **spec)
        return c._run(_ops.create(s).map(lambda info: cls(info, c)))

    @classmethod
    def create_group(cls, n: int, image: str = "busybox", *, client: Client | None = None,
                     wait_s: float | None = None, **spec: Any) -> list[Sandbox]:
        """``n`` sandboxes of one spec admitted as a gang: all within ``wait_s`` (server
        default 30 s), or none (429 ``Overloaded`` with the group's queue position and ETA)."""
        c = client or Client.default()
        s = build_spec(image=image, **spec)
        return c._run(_ops.create_group(s, n, wait_s).map(lambda infos: [cls(i, c) for i in infos]))

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Client | None = None) -> Sandbox:
        c = client or Client.default()
        return c._run(_ops.get(sandbox_id).map(lambda info: cls(info, c)))

    @classmethod
    def list(cls, labels: dict[str, str] | None = None, *, client: Client | None = None) -> list[Sandbox]:
        c = client or Client.default()
        return c._run(_ops.list_(labels).map(lambda infos: [cls(i, c) for i in infos]))

    @classmethod
    def restore(cls, checkpoint_id: str, *, client: Client | None = None, labels: dict[str, str] | None = None,
                timeout: float | None = None, request_id: str | None = None) -> Sandbox:
        """A NEW sandbox from a checkpoint: same image, resources, env and files."""
        c = client or Client.default()
        return c._run(_ops.restore(checkpoint_id, labels, timeout, request_id).map(lambda info: cls(info, c)))

    @classmethod
    def kill_by_labels(cls, labels: dict[str, str], *, client: Client | None = None) -> list[str]:
        return (client or Client.default()).kill_by_labels(labels)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        except NotFound:
            pass  # already gone (expired or killed inside the block)


class AsyncSandbox(_SandboxOps):
    """A sandbox used from asyncio. ``async with await AsyncSandbox.create(...) as sb:``."""

    @classmethod
    def create(cls, image: str = "busybox", *, client: AsyncClient | None = None, **spec: Any) -> Any:
        c = client or AsyncClient.default()
        s = build_spec(image=image, **spec)
        return c._run(_ops.create(s).map(lambda info: cls(info, c)))

    @classmethod
    def create_group(cls, n: int, image: str = "busybox", *, client: AsyncClient | None = None,
                     wait_s: float | None = None, **spec: Any) -> Any:
        """``await AsyncSandbox.create_group(8, image=...)``: all n admitted, or none."""
        c = client or AsyncClient.default()
        s = build_spec(image=image, **spec)
        return c._run(_ops.create_group(s, n, wait_s).map(lambda infos: [cls(i, c) for i in infos]))

    @classmethod
    def connect(cls, sandbox_id: str, *, client: AsyncClient | None = None) -> Any:
        c = client or AsyncClient.default()
        return c._run(_ops.get(sandbox_id).map(lambda info: cls(info, c)))

    @classmethod
    def list(cls, labels: dict[str, str] | None = None, *, client: AsyncClient | None = None) -> Any:
        c = client or AsyncClient.default()
        return c._run(_ops.list_(labels).map(lambda infos: [cls(i, c) for i in infos]))

    @classmethod
    def restore(cls, checkpoint_id: str, *, client: AsyncClient | None = None,
                labels: dict[str, str] | None = None, timeout: float | None = None,
                request_id: str | None = None) -> Any:
        """``await AsyncSandbox.restore(cp.id)``: a NEW sandbox from a checkpoint."""
        c = client or AsyncClient.default()
        return c._run(_ops.restore(checkpoint_id, labels, timeout, request_id).map(lambda info: cls(info, c)))

    @classmethod
    def kill_by_labels(cls, labels: dict[str, str], *, client: AsyncClient | None = None) -> Any:
        return (client or AsyncClient.default()).kill_by_labels(labels)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        except NotFound:
            pass

