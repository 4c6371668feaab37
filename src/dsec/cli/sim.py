"""``dsec sim``: run the discrete-event simulator and write a comparison report."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dsec.sim.config import SimConfig
from dsec.sim.report import ROWS, _fmt
from dsec.sim.runner import run_all

app = typer.Typer(help="Discrete-event cluster simulator driving the real scheduler.")


@app.callback(invoke_without_command=True)
def sim(
    out: Path = typer.Option(Path("sim-report"), help="Report directory (markdown, JSON, PNG)"),
    hours: float = typer.Option(24.0, help="Simulated hours"),
    rate_scale: float = typer.Option(1.0, help="Scale of the 3M/day arrival rate"),
    nodes: int = typer.Option(0, help="Cluster size; 0 = sized for --utilisation"),
    utilisation: float = typer.Option(0.8, help="Target mean requested-CPU utilisation when sizing"),
    seed: int = typer.Option(1, help="Seed (same seed -> same report)"),
    policies: str = typer.Option("ours,random,least-loaded,k8s", help="Comma-separated policies"),
    images: int = typer.Option(500, help="Distinct images (Zipf popularity)"),
    jobs: int = typer.Option(1, help="Policies run in parallel processes (results identical)"),
) -> None:
    if hours <= 0 or rate_scale <= 0 or nodes < 0 or not 0 < utilisation <= 1.5:
        raise typer.BadParameter("need --hours > 0, --rate-scale > 0, --nodes >= 0, 0 < --utilisation <= 1.5")
    cfg = SimConfig(seed=seed, hours=hours, rate_scale=rate_scale, nodes=nodes or None,
                    target_utilisation=utilisation, images=images,
                    policies=[p.strip() for p in policies.split(",") if p.strip()])
    console = Console(stderr=True)
    try:
        if sys.stderr.isatty():
            with Progress(TextColumn("{task.description:>14}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                          TimeElapsedColumn(), console=console) as bar:
                tasks = {p: bar.add_task(p, total=1.0) for p in cfg.policies}
                meta, results = run_all(cfg, out, progress=lambda p, f: bar.update(tasks[p], completed=f),
                                        jobs=jobs)
        else:
            done: set[str] = set()

            def log(p: str, f: float) -> None:
                if f >= 1.0 and p not in done:
                    done.add(p)
                    console.print(f"{p}: done")
            meta, results = run_all(cfg, out, progress=log, jobs=jobs)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    table = Table(title=f"{meta['hours']} h, {meta['nodes']} nodes, ~{meta['arrivals_expected']:,.0f} creations")
    table.add_column("metric")
    for r in results:
        table.add_column(r["policy"], justify="right")
    for key, label, fmt in ROWS:
        table.add_row(label, *[_fmt(fmt, r.get(key, 0)) for r in results])
    Console().print(table)
    Console().print(f"report: {out / 'report.md'}")
