"""``dsec usage``: run-level accounting of your sandboxes (live and dead), and per-label quotas."""

from __future__ import annotations

from typing import Any

import typer

from dsec.cli.common import handle_errors, human_bytes, note, parse_labels, print_json, wire

app = typer.Typer(help="Usage of your sandboxes by label (CPU-s, memory GiB-s, execs, bytes written, "
                       "sandbox-s) and per-label quotas.", no_args_is_help=False)

LabelOpt = typer.Option(None, "--label", "-l", help="key=value; every one must match (repeatable)")
_HEAD = ("SANDBOXES", "CPU-S", "MEM-GIB-S", "EXECS", "WRITTEN", "SANDBOX-S")


def _row(t: dict[str, Any]) -> tuple[str, ...]:
    return (str(t["sandboxes"]), f"{t['cpu_seconds']:.3f}", f"{t['memory_gb_seconds']:.3f}", str(t["exec_count"]),
            human_bytes(t["bytes_written"]), f"{t['sandbox_seconds']:.1f}")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


@app.callback(invoke_without_command=True)
@handle_errors
def usage(ctx: typer.Context, label: list[str] | None = LabelOpt,
          group_by: str | None = typer.Option(None, "--group-by", help="Label key (or 'tenant') to total by"),
          sandboxes: bool = typer.Option(False, "--sandboxes", help="Also list each sandbox"),
          as_json: bool = typer.Option(False, "--json", help="Machine-readable output")) -> None:
    """Totals of your sandboxes matching every --label (an unknown label gives zeros)."""
    if ctx.invoked_subcommand is not None:
        return
    params = [("label", f"{k}={v}") for k, v in parse_labels(label).items()]
    if group_by:
        params.append(("group_by", group_by))
    params.append(("limit", "1000" if sandboxes or as_json else "0"))
    with wire() as w:
        rep = w.call("GET", "/v1/usage", params=params)
    if as_json:
        print_json(rep)
        return
    rows = [("TOTAL", *_row(rep["totals"]))]
    rows += [(f"{group_by}={g['value']}", *_row(g["totals"])) for g in rep.get("groups", [])]
    print(_table(("", *_HEAD), rows))
    if sandboxes:
        print()
        print(_table(("SANDBOX", "STATE", *_HEAD[1:]),
                     [(s["sandbox_id"], "live" if s["ended_at"] is None else "dead", *_row(s)[1:])
                      for s in rep["sandboxes"]]))
        if rep.get("truncated"):
            note("(more sandboxes matched than listed)")


@app.command()
@handle_errors
def quota(label: str | None = typer.Argument(None, help="key=value, e.g. run=r1 (none: list your quotas)"),
          max_sandboxes: int | None = typer.Option(None, "--max-sandboxes", min=0,
                                                   help="Max concurrent sandboxes with the label"),
          max_cpu_seconds: float | None = typer.Option(None, "--max-cpu-seconds", min=0,
                                                       help="Max CPU-seconds of all sandboxes with the label"),
          delete: bool = typer.Option(False, "--delete", help="Remove the quota on LABEL"),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """List, set (applies to new creates) or --delete a per-label quota."""
    with wire() as w:
        if label is None:
            got = w.call("GET", "/v1/usage/quotas")
        elif delete:
            w.call("DELETE", "/v1/usage/quotas", params=[("label", label)])
            note(f"quota on {label} removed")
            return
        else:
            if max_sandboxes is None and max_cpu_seconds is None:
                raise typer.BadParameter("give --max-sandboxes and/or --max-cpu-seconds (or --delete)")
            got = [w.call("PUT", "/v1/usage/quotas", body={"label": label, "max_sandboxes": max_sandboxes,
                                                            "max_cpu_seconds": max_cpu_seconds})]
    if as_json:
        print_json(got)
        return
    print(_table(("LABEL", "MAX-SANDBOXES", "MAX-CPU-S"),
                 [(q["label"], "-" if q["max_sandboxes"] is None else str(q["max_sandboxes"]),
                   "-" if q["max_cpu_seconds"] is None else f"{q['max_cpu_seconds']:g}") for q in got]))
