"""Sandbox commands: ``run``, ``exec``, ``ps``, ``kill``, ``logs``, ``network``.

They talk to the API over ``dsec.cli.wire`` (standard library only) so that they answer at
once; answers are the API's JSON (the fields of ``dsec.models.SandboxInfo`` etc.).
"""

from __future__ import annotations

import datetime as dt
import shlex
import sys
from typing import Any

import typer

from dsec.cli import common
from dsec.cli.common import handle_errors, human_age, human_bytes, note, parse_labels, print_json, wire

LabelOpt = typer.Option(None, "--label", "-l", help="key=value (repeatable)")
_SB = "/v1/sandboxes"


def _cmd(argv: list[str]) -> str | list[str]:
    # One argument is a shell string (`dsec exec ID -- 'ls | wc -l'`); several are an argv.
    if argv and argv[0] == "--":  # click keeps the separator once positional parsing stopped
        argv = argv[1:]
    if not argv:
        raise typer.BadParameter("give a command after --, e.g. `dsec exec ID -- ls /`")
    return argv[0] if len(argv) == 1 else argv


def _stream(w: Any, sandbox_id: str, argv: list[str], timeout: float | None, as_json: bool) -> int:
    from dsec.cli.wire import sid

    req: dict[str, Any] = {"cmd": _cmd(argv)}
    if timeout is not None:
        req["timeout"] = timeout
    http_timeout = (timeout or 0) + w.target.timeout_s  # the HTTP wait outlasts the command's own timeout
    if as_json:
        res = w.call("POST", f"{_SB}/{sid(sandbox_id)}/exec", req, timeout=http_timeout)
        print_json({"sandbox_id": sandbox_id, **res})
        return int(res["exit_code"])
    for ev in w.lines("POST", f"{_SB}/{sid(sandbox_id)}/exec/stream", req, timeout=http_timeout):
        kind = ev.get("kind")
        if kind == "stdout":
            sys.stdout.write(ev.get("data", ""))
            sys.stdout.flush()
        elif kind == "stderr":
            sys.stderr.write(ev.get("data", ""))
            sys.stderr.flush()
        elif ev.get("result") is not None:
            result = ev["result"]
            if result.get("timed_out"):
                note(f"command timed out after {result.get('duration', 0):.1f}s")
            return int(result["exit_code"])
    return 1


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Plain aligned columns (like `docker ps`): no rich import for the hot commands."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


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
        spec = {k: v for k, v in {"image": image, "cpu": cpu, "memory": memory, "timeout": timeout,
                                  "isolation": isolation, "network": network,
                                  "labels": parse_labels(label)}.items() if v is not None}
        with wire() as w:
            if sys.stderr.isatty() and not as_json:
                with common.err.status(f"creating a {image} sandbox (a cold image is unpacked on first use)"):
                    info = w.create(spec)
            else:
                info = w.create(spec)
            if not as_json:
                note(f"sandbox {info['id']} ({info['image']}, {info['isolation']})")
            try:
                code = _stream(w, info["id"], cmd, exec_timeout, as_json)
            finally:
                if not keep:
                    w.kill(info["id"])
        raise typer.Exit(code)

    @app.command("exec")
    @handle_errors
    def exec_(sandbox_id: str = typer.Argument(...), cmd: list[str] = typer.Argument(..., help="Command (after --)"),
              timeout: float | None = typer.Option(None, help="Command timeout (s)"),
              as_json: bool = typer.Option(False, "--json")) -> None:
        """Run CMD in a running sandbox, streaming its output; exits with its exit code."""
        with wire() as w:
            code = _stream(w, sandbox_id, cmd, timeout, as_json)
        raise typer.Exit(code)

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
        from dsec.cli.wire import sid

        with wire() as w:
            path = f"{_SB}/{sid(sandbox_id)}"
            info = (w.call("PUT", f"{path}/network", {"allow": [] if deny_all else list(allow or [])})
                    if (allow or deny_all) else w.call("GET", path))
        if as_json:
            print_json({"id": info["id"], "network": info["network"]})
        elif info["network"] is None:
            print(f"{info['id']}: no network (created with network=None; only its own loopback)")
        else:
            print(f"{info['id']}: " + (", ".join(info["network"]) if info["network"] else "nothing allowed"))

    @app.command()
    @handle_errors
    def ps(label: list[str] | None = LabelOpt, as_json: bool = typer.Option(False, "--json")) -> None:
        """List your sandboxes (state, image, age, labels, cpu/mem limits)."""
        with wire() as w:
            infos = w.call("GET", _SB, params=[("label", f"{k}={v}") for k, v in parse_labels(label).items()])
        if as_json:
            print_json(infos)
            return
        rows = [(i["id"], i["state"], i["image"], human_age(i["created_at"]), f"{i['cpu']:g}",
                 human_bytes(i["memory"]), i["isolation"], i.get("node") or "-",
                 ",".join(f"{k}={v}" for k, v in sorted((i.get("labels") or {}).items())))
                for i in sorted(infos, key=lambda x: x["created_at"])]
        print(_columns(("ID", "STATE", "IMAGE", "AGE", "CPU", "MEM", "ISOLATION", "NODE", "LABELS"), rows))
        note(f"{len(infos)} sandbox(es)")

    @app.command()
    @handle_errors
    def kill(sandbox_ids: list[str] | None = typer.Argument(None),
             label: list[str] | None = LabelOpt, as_json: bool = typer.Option(False, "--json")) -> None:
        """Kill sandboxes by id, or all of yours matching --label k=v."""
        if not sandbox_ids and not label:
            raise typer.BadParameter("give sandbox ids or --label k=v")
        killed: list[str] = []
        with wire() as w:
            for one in sandbox_ids or []:
                w.kill(one)
                killed.append(one)
            if label:
                killed += w.call("POST", f"{_SB}/kill", {"labels": parse_labels(label)})["killed"]
        if as_json:
            print_json({"killed": killed})
        else:
            for one in killed:
                print(f"killed {one}")

    @app.command()
    @handle_errors
    def logs(sandbox_id: str, limit: int = typer.Option(1000, help="Max records"),
             as_json: bool = typer.Option(False, "--json")) -> None:
        """Audit log of a sandbox: commands (argv, exit, duration), files written (kept after death)."""
        from dsec.cli.wire import sid

        with wire() as w:
            entries = w.call("GET", f"{_SB}/{sid(sandbox_id)}/audit", params=[("limit", str(limit))])
        if as_json:
            print_json(entries)
            return
        rows: list[tuple[str, ...]] = []
        for e in entries:
            d, kind = e.get("data") or {}, e["kind"]
            if kind == "exec":
                argv = d.get("argv") or []
                cmd = argv[2] if argv[:2] == ["/bin/sh", "-c"] and len(argv) > 2 else shlex.join(argv)
                detail = f"{cmd}  → exit {d.get('exit_code')} in {d.get('duration', 0):.3f}s" + (
                    " (timed out)" if d.get("timed_out") else "")
            elif kind in ("file_write", "upload"):
                detail = f"{d.get('path')} ({d.get('size')} bytes)"
            else:
                detail = ", ".join(f"{k}={v}" for k, v in d.items() if v not in (None, {}, []))
            rows.append((dt.datetime.fromtimestamp(e["ts"]).strftime("%H:%M:%S.%f")[:-3], kind, detail))
        print(_columns(("TIME", "EVENT", "DETAIL"), rows))
