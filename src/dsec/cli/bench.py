"""``dsec bench ...``: benchmarks that compare against a baseline in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="Benchmarks (each reports ratios against a baseline run side by side).",
                  no_args_is_help=True)
console = Console(stderr=True)


def _emit(report: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    console.print(f"[green]report written to {path}[/]")


@app.command()
def sandbox(rounds: int = typer.Option(10, help="create/destroy rounds per image"),
            execs: int = typer.Option(1000, help="exec round trips"),
            many: int = typer.Option(500, help="idle sandboxes held at once (0 to skip)"),
            out: Path = typer.Option(Path("reports"), help="report directory")) -> None:
    """Create-to-first-exec vs podman run, exec vs runc exec, destroy, N idle sandboxes."""
    from dsec.bench.sandbox import run
    with console.status("benchmarking sandboxes") as status:
        report = run(rounds=rounds, exec_n=execs, many=many, progress=lambda m: status.update(m))
    _emit(report, out, "sandbox-bench")
