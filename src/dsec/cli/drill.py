"""``dsec drill``: fault-injection drill of episode recovery (needs root: mounts, chroot)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dsec.cli.common import err, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("drill")(drill)


@handle_errors
def drill(
    episodes: int = typer.Option(8, help="Concurrent episodes per round"),
    steps: int = typer.Option(30, help="Steps per episode"),
    faults: int = typer.Option(100, help="Faults to inject in total (rounds repeat until reached)"),
    seed: int = typer.Option(1, help="Seed: same seed, same scripts and fault sequence"),
    interval: float = typer.Option(0.2, help="Mean seconds between faults"),
    kinds: str = typer.Option(",".join(["kill_server", "restart_server", "kill_sandbox", "fill_disk",
                                        "corrupt_replica", "cut_write"]), help="Fault kinds (comma-separated)"),
    tmpfs: str = typer.Option("256M", help="Size of the tmpfs used as the second checkpoint replica"),
    out_dir: Path = typer.Option(Path("drill-report"), "--out", help="Report directory (md, json, png)"),
    work: Path = typer.Option(None, help="Scratch dir (default: a new temp dir)"),
    host: str = typer.Option("node", help="Where episodes run: 'node' (real runc sandboxes via the node "
                                          "agent) or 'dir' (overlay+chroot, no isolation; engine-only drills)"),
) -> None:
    """Run scripted episodes under random faults, resume them all, verify against a fault-free run."""
    from dsec.bench.drill import FAULT_KINDS
    from dsec.bench.drill_run import DrillConfig, run_drill, write_report
    from dsec.config import parse_bytes
    chosen = tuple(k.strip() for k in kinds.split(",") if k.strip())
    bad = [k for k in chosen if k not in FAULT_KINDS]
    if bad:
        err.print(f"[red]error[/red]: unknown fault kinds {bad}; choose from {', '.join(FAULT_KINDS)}")
        raise typer.Exit(2)
    cfg = DrillConfig(work=work or Path(tempfile.mkdtemp(prefix="dsec-drill-")) / "work", episodes=episodes,
                      steps=steps, faults=faults, seed=seed, fault_interval_s=interval, kinds=chosen,
                      tmpfs_bytes=parse_bytes(tmpfs), host_kind=host)
    if host not in ("dir", "node"):
        err.print(f"[red]error[/red]: --host must be 'dir' or 'node', got {host!r}")
        raise typer.Exit(2)
    if sys.stderr.isatty():
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err) as prog:
            task = prog.add_task("drill", total=faults)
            res = run_drill(cfg, lambda phase, done, total: prog.update(task, description=phase, completed=done))
    else:
        res = run_drill(cfg, lambda phase, done, total: err.print(f"{phase}: {done}/{total} faults"))
    s = write_report(out_dir, cfg, res)
    out.print((out_dir / "drill.md").read_text())
    if s["episodes_verified"] != s["episodes"] or s["steps_reexecuted"]:
        raise typer.Exit(1)
