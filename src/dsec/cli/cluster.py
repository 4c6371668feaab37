"""``dsec cluster up|down``: a local Ray cluster of separate DSec nodes on this machine.

For many machines, start Ray as Ray documents (``ray start --head`` / ``ray start
--address``) with each machine's DSEC_* settings and the resource ``dsec_node_<ID>``;
``dsec cluster up`` does exactly that N times on one box (see ``dsec.cluster.local``).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from dsec.cli.common import handle_errors, out, print_json

app = typer.Typer(help="A local Ray cluster whose nodes are separate DSec nodes (try the cluster on one machine).",
                  no_args_is_help=True)


def default_dir() -> Path:
    """Where `cluster up` keeps its nodes' homes and its record (DSEC_HOME/cluster)."""
    return Path(os.environ.get("DSEC_HOME", "/var/lib/dsec")) / "cluster"


DirOpt = typer.Option(None, "--dir", help="Cluster dir (node homes, cluster.json); default DSEC_HOME/cluster")


@app.command("up")
@handle_errors
def up(nodes: int = typer.Option(3, "--nodes", help="Number of DSec nodes (the Ray head is node n0)"),
       images: str = typer.Option("busybox", "--images", help="Stock images each node gets (comma-separated; "
                                  "'' for none)"),
       dir: Path | None = DirOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Start head + N-1 nodes (`ray start`), one DSec node agent per node; print the address."""
    from dsec.cluster import local

    log = (lambda _m: None) if as_json else (lambda m: out.print(m, highlight=False))
    c = local.up(dir or default_dir(), nodes, [i for i in images.split(",") if i], log=log)
    if as_json:
        print_json({"address": c.address, "nodes": [n.node_id for n in c.nodes], "dir": c.dir,
                    "env": local.shared_env(c)})
        return
    env = " ".join(f"{k}='{v}'" for k, v in local.shared_env(c).items())
    out.print(f"cluster of {len(c.nodes)} nodes is up: {c.address}")
    out.print(f"next: {env} dsec serve --cluster {c.address}   (stop it with `dsec cluster down`)", highlight=False)


@app.command("down")
@handle_errors
def down(dir: Path | None = DirOpt,
         keep_data: bool = typer.Option(False, "--keep-data", help="Keep node homes (layer caches)"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Destroy the cluster's sandboxes and stop every process `cluster up` started."""
    from dsec.cluster import local

    log = (lambda _m: None) if as_json else (lambda m: out.print(m, highlight=False))
    c = local.down(dir or default_dir(), keep_data=keep_data, log=log)
    if as_json:
        print_json({"stopped": c is not None, "address": c.address if c else None})
    elif c is None:
        out.print("no local cluster recorded there; nothing to stop")
    else:
        out.print(f"stopped {c.address} ({len(c.nodes)} nodes)")
