"""``dsec node ls``: the DSec nodes of a Ray cluster as their agents report them;
``dsec node drain ID [--migrate]``: ask the running ``dsec serve --cluster`` (admin) to stop
placing on a node, and optionally move its sandboxes elsewhere; ``dsec node undrain ID``:
a draining node takes placements again."""

from __future__ import annotations

import os
from typing import Any

import typer
from rich.table import Table

from dsec.cli.common import handle_errors, human_bytes, out, print_json

app = typer.Typer(help="Cluster nodes: id, address, state, agent, sandboxes, allocation, images.",
                  no_args_is_help=True)


def cluster_address(explicit: str | None) -> str:
    """--cluster, else DSEC_CLUSTER, else the local cluster `dsec cluster up` recorded."""
    if explicit:
        return explicit
    if os.environ.get("DSEC_CLUSTER"):
        return os.environ["DSEC_CLUSTER"]
    from dsec.cli.cluster import default_dir
    from dsec.cluster.local import read_state
    from dsec.errors import InvalidArgument

    c = read_state(default_dir())
    if c is None:
        raise InvalidArgument("no cluster given: pass --cluster ray://HEAD:PORT, set DSEC_CLUSTER, or start one "
                              "with `dsec cluster up`", field="cluster")
    return c.address


def _server_view() -> list[dict[str, Any]] | None:
    """GET /v1/nodes of the API server DSEC_URL names (draining / lost as the control plane
    sees them); None without a server or when it does not answer as an admin."""
    if not os.environ.get("DSEC_URL"):
        return None
    import httpx

    url = os.environ["DSEC_URL"].split(",")[0].rstrip("/")
    try:
        r = httpx.get(f"{url}/v1/nodes", headers={"authorization": f"Bearer {os.environ.get('DSEC_TOKEN', '')}"},
                      timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


@app.command("ls")
@handle_errors
def ls(cluster: str | None = typer.Option(None, "--cluster", help="ray://HEAD:PORT (default: DSEC_CLUSTER)"),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """List the cluster's DSec nodes."""
    import asyncio

    from dsec.cluster.nodes import merge_server_states, node_rows

    rows: list[dict[str, Any]] = asyncio.run(node_rows(cluster_address(cluster)))
    rows = merge_server_states(rows, _server_view())
    if as_json:
        print_json(rows)
        return
    t = Table(box=None, header_style="bold")
    from dsec.cluster.nodes import pulls_text

    for col in ("ID", "ADDRESS", "STATE", "AGENT PID", "SANDBOXES", "CPU ALLOC/BOUND", "MEM ALLOC/BOUND", "IMAGES",
                "PULLS"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["id"], r["address"], r["state"], str(r["agent_pid"] or "-"), str(r["sandboxes"]),
                  f"{r['cpu_allocated']:g}/{r['cpu_bound']:g}",
                  f"{human_bytes(r['memory_allocated'])}/{human_bytes(r['memory_bound'])}",
                  ",".join(r["images"]) or "-", pulls_text(r.get("pulls", [])))
    out.print(t)


@app.command("drain")
@handle_errors
def drain(node_id: str = typer.Argument(..., help="Node id as `dsec node ls` shows it"),
          migrate: bool = typer.Option(False, "--migrate", help="Checkpoint its running sandboxes and restore "
                                       "them on other nodes (same ids)"),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """Stop new placements on NODE_ID (through the API server: DSEC_URL, admin token)."""
    from dsec.cli.common import client
    from dsec.sdk._core import Call

    res = client()._run(Call("POST", f"/v1/nodes/{node_id}/drain", lambda r: r.json(),
                             json={"migrate": migrate}, idempotent=False))
    if as_json:
        print_json(res)
        return
    out.print(f"node {res['node']}: {res['previous']} -> {res['state']}")
    for m in res["migrated"]:
        out.print(f"  migrated {m['sandbox_id']} -> {m['to_node']} (checkpoint {m['checkpoint_id']})")
    for sid, why in res["failed"].items():
        out.print(f"  NOT moved {sid}: {why}")


@app.command("undrain")
@handle_errors
def undrain(node_id: str = typer.Argument(..., help="Node id as `dsec node ls` shows it"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Cancel a drain: NODE_ID (draining) takes placements again (through the API server)."""
    from dsec.cli.common import client
    from dsec.sdk._core import Call

    res = client()._run(Call("POST", f"/v1/nodes/{node_id}/undrain", lambda r: r.json(), json={},
                             idempotent=True))
    if as_json:
        print_json(res)
        return
    out.print(f"node {res['node']}: {res['previous']} -> {res['state']}")
