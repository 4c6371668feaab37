"""``dsec pool ls|set`` and ``dsec sched``: warm pools and the scheduler's state (admin)."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from dsec.cli.common import client, handle_errors, human_bytes, out, print_json
from dsec.sdk._core import Call

app = typer.Typer(help="Warm pools of pre-created sandboxes (admin).", no_args_is_help=True)


def _call(method: str, path: str, body: Any = None) -> Any:
    return client()._run(Call(method, path, lambda r: r.json(), json=body, idempotent=True))


def _pool_table(pools: list[dict[str, Any]]) -> Table:
    t = Table(box=None, header_style="bold")
    for col in ("IMAGE", "ISOLATION", "CPU", "MEM", "DISK", "NET", "FLOOR", "TARGET", "READY", "CREATING"):
        t.add_column(col)
    for p in pools:
        t.add_row(p["image"], p["isolation"], f"{p['cpu']:g}", human_bytes(p["memory"]), human_bytes(p["disk"]),
                  "yes" if p["network"] else "no", str(p["floor"]), str(p["target"]), str(p["ready"]),
                  str(p["creating"]))
    return t


@app.command("ls")
@handle_errors
def ls(as_json: bool = typer.Option(False, "--json")) -> None:
    """Pools per shape: declared floor, current target (demand), ready and creating members."""
    pools = _call("GET", "/v1/pools")["pools"]
    if as_json:
        print_json(pools)
    else:
        out.print(_pool_table(pools))


@app.command("set")
@handle_errors
def set_(image: str, size: int = typer.Option(..., help="Members to keep ready (0: demand-driven only)"),
         cpu: float | None = typer.Option(None, help="CPU cap of the shape (as at create)"),
         memory: str | None = typer.Option(None, help="Memory of the shape, e.g. 512M"),
         disk: str | None = typer.Option(None, help="Disk quota of the shape"),
         isolation: str | None = typer.Option(None, help="container or gvisor"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Keep SIZE sandboxes of this shape warm; creates of the same shape are hand-overs."""
    spec = {k: v for k, v in {"image": image, "cpu": cpu, "memory": memory, "disk": disk,
                              "isolation": isolation}.items() if v is not None}
    pools = _call("PUT", "/v1/pools", {"spec": spec, "size": size})["pools"]
    if as_json:
        print_json(pools)
    else:
        out.print(_pool_table(pools))


def register(root: typer.Typer) -> None:
    @root.command("sched")
    @handle_errors
    def sched(as_json: bool = typer.Option(False, "--json")) -> None:
        """Scheduler state (admin): node allocation vs the overcommit bound, queue, counters."""
        st = _call("GET", "/v1/scheduler")
        if as_json:
            print_json(st)
            return
        t = Table(box=None, header_style="bold")
        for col in ("NODE", "CPU ALLOC/BOUND", "MEM ALLOC/TOTAL", "SANDBOXES", "CREATING", "WARM", "LOAD"):
            t.add_column(col)
        for n in st["nodes"]:
            t.add_row(n["node_id"], f"{n['cpu_allocated']:g}/{n['cpu_bound']:g}",
                      f"{human_bytes(n['memory_allocated'])}/{human_bytes(n['memory'])}", str(n["sandboxes"]),
                      str(n["creating"]), str(n["warm"]), f"{n['predicted_load']:.0%}")
        out.print(t)
        s = st["stats"]
        out.print(f"queue {st['queue_depth']}/{st['queue_capacity']}"
                  f"{' (backpressure)' if st['backpressure'] else ''}; warm hits {s['warm_hits']}, "
                  f"misses {s['warm_misses']}; preemptions {s['preemptions']}; retries {s['retries']}; "
                  f"rejected: overload {s['rejected_overload']}, quota {s['rejected_quota']}, "
                  f"invalid {s['rejected_invalid']}")
