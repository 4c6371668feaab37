"""Sandbox commands: ``run``, ``exec``, ``ps``, ``kill``, ``logs``."""

from __future__ import annotations

import datetime as dt
import shlex
import sys
from typing import Any

import typer
from rich.table import Table

from dsec.cli.common import client, err, handle_errors, human_age, human_bytes, out, parse_labels, print_json

LabelOpt = typer.Option(None, "--label", "-l", help="key=value (repeatable)")


def _cmd(argv: list[str]) -> str | list[str]:
    # One argument is a shell string (`dsec exec ID -- 'ls | wc -l'`); several are an argv.
    if argv and argv[0] == "--":  # click keeps the separator once positional parsing stopped
        argv = argv[1:]
    if not argv:
        raise typer.BadParameter("give a command after --, e.g. `dsec exec ID -- ls /`")
    return argv[0] if len(argv) == 1 else argv


def _stream(c: Any, sandbox_id: str, argv: list[str], timeout: float | None, as_json: bool) -> int:
    from dsec.models import ExecRequest

    req = ExecRequest(cmd=_cmd(argv), timeout=timeout)
    if as_json:
        res = c.exec(sandbox_id, req)
        print_json({"sandbox_id": sandbox_id, **res.model_dump(mode="json")})
        return res.exit_code
    for ev in c.exec_stream(sandbox_id, req):
        if ev.kind == "stdout":
            sys.stdout.write(ev.data)
            sys.stdout.flush()
        elif ev.kind == "stderr":
            sys.stderr.write(ev.data)
            sys.stderr.flush()
        elif ev.result is not None:
            if ev.result.timed_out:
                err.print(f"[yellow]command timed out after {ev.result.duration:.1f}s[/yellow]")
            return ev.result.exit_code
    return 1


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def run(image: str = typer.Argument(..., help="Image name[:tag]"),
            cmd: list[str] = typer.Argument(..., help="Command (after --)"),
            cpu: float | None = typer.Option(None, help="CPUs"),
            memory: str | None = typer.Option(None, help="Memory, e.g. 512M"),
            timeout: float | None = typer.Option(None, help="Sandbox wall timeout (s)"),
            exec_timeout: float | None = typer.Option(None, "--exec-timeout", help="Command timeout (s)"),
            isolation: str | None = typer.Option(None, help="container or gvisor"),
            network: list[str] | None = typer.Option(None, "--allow", help="Egress host:port/CIDR (repeatable)"),
            label: list[str] | None = LabelOpt,
            keep: bool = typer.Option(False, "--keep", help="Keep the sandbox after the command"),
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output")) -> None:
        """Create a sandbox from IMAGE, run CMD in it, print output, then kill it (unless --keep)."""
        from dsec.sdk._sandbox import build_spec

        c = client()
        spec = build_spec(image=image, cpu=cpu, memory=memory, timeout=timeout, isolation=isolation,
                          network=network, labels=parse_labels(label))
        if err.is_terminal and not as_json:
            with err.status(f"creating a {image} sandbox (a cold image is unpacked on first use)"):
                info = c.create(spec)
        else:
            info = c.create(spec)
        if not as_json:
            err.print(f"[dim]sandbox {info.id} ({info.image}, {info.isolation})[/dim]")
        try:
            code = _stream(c, info.id, cmd, exec_timeout, as_json)
        finally:
            if not keep:
                c.kill(info.id)
        raise typer.Exit(code)

    @app.command("exec")
    @handle_errors
    def exec_(sandbox_id: str = typer.Argument(...), cmd: list[str] = typer.Argument(..., help="Command (after --)"),
              timeout: float | None = typer.Option(None, help="Command timeout (s)"),
              as_json: bool = typer.Option(False, "--json")) -> None:
        """Run CMD in a running sandbox, streaming its output; exits with its exit code."""
        raise typer.Exit(_stream(client(), sandbox_id, cmd, timeout, as_json))

    @app.command()
    @handle_errors
    def network(sandbox_id: str = typer.Argument(...),
                allow: list[str] | None = typer.Option(None, "--allow",
                                                       help="New egress allow-list entry (repeatable)"),
                deny_all: bool = typer.Option(False, "--deny-all", help="Close every destination"),
                as_json: bool = typer.Option(False, "--json")) -> None:
        """Show a sandbox's egress allow-list, or replace it live (--allow ... / --deny-all)."""
        if allow and deny_all:
            raise typer.BadParameter("give --allow entries or --deny-all, not both")
        c = client()
        info = c.update_network(sandbox_id, [] if deny_all else allow) if (allow or deny_all) else c.get(sandbox_id)
        if as_json:
            print_json({"id": info.id, "network": info.network})
        elif info.network is None:
            out.print(f"{info.id}: no network (created with network=None; only its own loopback)")
        else:
            out.print(f"{info.id}: " + (", ".join(info.network) if info.network else "nothing allowed"))

    @app.command()
    @handle_errors
    def ps(label: list[str] | None = LabelOpt, as_json: bool = typer.Option(False, "--json")) -> None:
        """List your sandboxes (state, image, age, labels, cpu/mem limits)."""
        infos = client().list(parse_labels(label))
        if as_json:
            print_json(infos)
            return
        t = Table(box=None, header_style="bold")
        for col in ("ID", "STATE", "IMAGE", "AGE", "CPU", "MEM", "ISOLATION", "LABELS"):
            t.add_column(col)
        for i in sorted(infos, key=lambda x: x.created_at):
            t.add_row(i.id, i.state.value, i.image, human_age(i.created_at), f"{i.cpu:g}", human_bytes(i.memory),
                      i.isolation, ",".join(f"{k}={v}" for k, v in sorted(i.labels.items())))
        out.print(t)
        err.print(f"[dim]{len(infos)} sandbox(es)[/dim]")

    @app.command()
    @handle_errors
    def kill(sandbox_ids: list[str] | None = typer.Argument(None),
             label: list[str] | None = LabelOpt, as_json: bool = typer.Option(False, "--json")) -> None:
        """Kill sandboxes by id, or all of yours matching --label k=v."""
        c = client()
        killed: list[str] = []
        for sid in sandbox_ids or []:
            c.kill(sid)
            killed.append(sid)
        if label:
            killed += c.kill_by_labels(parse_labels(label))
        if not sandbox_ids and not label:
            raise typer.BadParameter("give sandbox ids or --label k=v")
        if as_json:
            print_json({"killed": killed})
        else:
            for sid in killed:
                out.print(f"killed {sid}")

    @app.command()
    @handle_errors
    def logs(sandbox_id: str, limit: int = typer.Option(1000, help="Max records"),
             as_json: bool = typer.Option(False, "--json")) -> None:
        """Audit log of a sandbox: commands (argv, exit, duration), files written (kept after death)."""
        entries = client().audit(sandbox_id, limit)
        if as_json:
            print_json(entries)
            return
        t = Table(box=None, header_style="bold")
        for col in ("TIME", "EVENT", "DETAIL"):
            t.add_column(col)
        for e in entries:
            d = e.data
            if e.kind == "exec":
                argv = d.get("argv") or []
                cmd = argv[2] if argv[:2] == ["/bin/sh", "-c"] and len(argv) > 2 else shlex.join(argv)
                detail = f"{cmd}  → exit {d.get('exit_code')} in {d.get('duration', 0):.3f}s" + (
                    " (timed out)" if d.get("timed_out") else "")
            elif e.kind in ("file_write", "upload"):
                detail = f"{d.get('path')} ({d.get('size')} bytes)"
            else:
                detail = ", ".join(f"{k}={v}" for k, v in d.items() if v not in (None, {}, []))
            t.add_row(dt.datetime.fromtimestamp(e.ts).strftime("%H:%M:%S.%f")[:-3], e.kind, detail)
        out.print(t)
