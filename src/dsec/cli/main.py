"""The ``dsec`` command. Sub-commands live in their own modules and are loaded lazily.

``dsec --help`` and ``dsec ps`` must answer at once, so this module imports nothing heavy:
a sub-command's module is imported only when that sub-command runs (``--help`` lists
them from the one-line help kept here). ``tests/unit/cli/test_cli_imports.py`` keeps it so.

To add a sub-command, add ONE line to ``COMMANDS`` (keep it sorted)::

    "cluster": ("dsec.cli.cluster:app", "Ray cluster: nodes, health."),   # a typer.Typer sub-app
    "doctor": ("dsec.cli.doctor:register", "Check this host ..."),        # register(app) adds it

The target is ``module:attribute``: a ``typer.Typer`` (mounted as a command group under
that name) or a ``register(app)`` function that defines the command(s) on ``app``; the
same ``register`` may be named by several entries (``run``, ``exec``, ``ps``, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

# name -> ("module:attribute", one-line help shown by `dsec --help`).
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("dsec.cli.bench:app", "Benchmarks (each reports ratios against a baseline run side by side)."),
    "cluster": ("dsec.cli.cluster:app", "Local Ray cluster of separate DSec nodes: up --nodes N, down."),
    "demo": ("dsec.cli.demo:register", "Run concurrent scripted coding-agent episodes on the local server."),
    "doctor": ("dsec.cli.doctor:register", "Check this host and the server; print what is wrong and the fix."),
    "drill": ("dsec.cli.drill:register", "Fault-injection drill of episode recovery."),
    "episode": ("dsec.cli.episode:app", "Episodes: logged, checkpointed, resumable agent runs."),
    "exec": ("dsec.cli.sandbox:register", "Run CMD in a running sandbox, streaming its output."),
    "image": ("dsec.cli.image:app", "Manage node-local images (OCI layouts, docker-save archives, builds)."),
    "kill": ("dsec.cli.sandbox:register", "Kill sandboxes by id, or all of yours matching --label k=v."),
    "logs": ("dsec.cli.sandbox:register", "Audit log of a sandbox: commands, exit codes, files written."),
    "network": ("dsec.cli.sandbox:register", "Show a sandbox's egress allow-list, or replace it live."),
    "node": ("dsec.cli.node:app", "Cluster nodes: id, address, state, agent pid, sandboxes, allocation, images."),
    "pool": ("dsec.cli.pool:app", "Warm pools of pre-created sandboxes (admin)."),
    "ps": ("dsec.cli.sandbox:register", "List your sandboxes (state, image, age, labels, cpu/mem limits)."),
    "run": ("dsec.cli.sandbox:register", "Create a sandbox from IMAGE, run CMD in it, then kill it."),
    "sched": ("dsec.cli.pool:register", "Scheduler state (admin): node allocation, queue, counters."),
    "serve": ("dsec.cli.serve:register", "Run the DSec server (API + control plane + node agent)."),
    "sim": ("dsec.cli.sim:app", "Discrete-event cluster simulator driving the real scheduler."),
    "tenant": ("dsec.cli.tenant:app", "Manage tenants (admin)."),
    "usage": ("dsec.cli.usage:app", "Usage of your sandboxes by label (CPU-s, GiB-s, execs, bytes), quotas."),
}


def load_command(name: str) -> Any:
    """Import the module behind ``name`` and return its click command (a group for a sub-app)."""
    target, _ = COMMANDS[name]
    module, _, attr = target.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    holder = typer.Typer()
    holder.callback()(lambda: None)  # a callback makes typer build a group even for one command
    if isinstance(obj, typer.Typer):
        holder.add_typer(obj, name=name)
    else:
        obj(holder)
    cmd = typer.main.get_group(holder).commands.get(name)
    if cmd is None:
        raise RuntimeError(f"{target} defines no command named {name!r}")
    return cmd


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in ("1", "true", "yes", "y", "on", "t"):
        return True
    if str(value).strip().lower() in ("0", "false", "no", "n", "off", "f", ""):
        return False
    raise ValueError(value)


_flag.__name__ = "boolean"
_PLAIN: dict[Any, Any] = {str: str, int: int, float: float, bool: _flag, list[str]: str}


def _plain_coercion(cmd: Any, ctx: Any) -> None:
    """Give str/int/float/list[str] parameters a direct conversion.

    typer >= 0.2x converts every parameter through a pydantic TypeAdapter, and its first
    use imports pydantic and its plugin loader (~150 ms): longer than a whole ``dsec ps``
    may take. Parameters with constraints (min/max, custom parsers) or other types keep
    typer's own path; if typer's internals differ, nothing changes (just slower)."""
    try:
        from typer._coercion import RuntimeParam
    except ImportError:  # pragma: no cover - another typer
        return

    class _Plain(RuntimeParam):
        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            conv = _PLAIN[self.annotation]
            try:
                if isinstance(value, list | tuple):
                    return [conv(v) for v in value]
                return conv(value)
            except ValueError:
                raise typer.BadParameter(f"{value!r} is not a valid {conv.__name__}", ctx=ctx, param=param) from None

    help_opt = cmd.get_help_option(ctx) if hasattr(cmd, "get_help_option") else None
    for param in [*getattr(cmd, "params", []), *([help_opt] if help_opt is not None else [])]:
        desc = getattr(param, "type_descriptor", None)
        info = getattr(desc, "parameter_info", None)
        if desc is None or info is None or desc.annotation not in _PLAIN or getattr(param, "_runtime_param", 0):
            continue
        if any(getattr(info, a, None) is not None for a in ("min", "max", "parser", "click_type")):
            continue
        param._runtime_param = _Plain(parameter_info=info, annotation=desc.annotation)
    for sub in getattr(cmd, "commands", {}).values():
        _plain_coercion(sub, ctx)


class LazyGroup(TyperGroup):
    """Lists COMMANDS without importing them; imports one only to run it (or show its help)."""

    _listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        if self._listing:  # `dsec --help`: a stand-in carrying the one-line help
            from typer.core import TyperCommand

            return TyperCommand(name=cmd_name, help=COMMANDS[cmd_name][1], short_help=COMMANDS[cmd_name][1])
        cmd = load_command(cmd_name)
        _plain_coercion(cmd, ctx)
        return cmd

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        _plain_coercion(self, ctx)
        return super().parse_args(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> Any:
        self._listing = True
        try:
            return super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(name="dsec", cls=LazyGroup, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  rich_markup_mode=None)  # plain help for `dsec --help`: rich costs ~100 ms of imports


@app.callback()
def _root() -> None:
    """DSec: fast, secure, recoverable sandboxes for AI agents."""
