"""``dsec tenant add|ls|rm`` (admin token required; the local token is admin)."""

from __future__ import annotations

import typer
from rich.table import Table

from dsec.cli.common import client, handle_errors, human_bytes, out, print_json

app = typer.Typer(help="Manage tenants (admin).", no_args_is_help=True)


@app.command()
@handle_errors
def add(name: str, admin: bool = typer.Option(False, "--admin", help="May manage tenants and images"),
        max_sandboxes: int | None = typer.Option(None, help="Max concurrent sandboxes"),
        max_cpu: float | None = typer.Option(None, help="Max CPUs over live sandboxes"),
        max_memory: str | None = typer.Option(None, help="Max memory over live sandboxes, e.g. 64G"),
        image: list[str] | None = typer.Option(None, "--image", help="Allowed image glob (repeatable)"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Create a tenant and print its token (shown once; only its hash is stored)."""
    created = client().add_tenant(name, admin=admin, max_sandboxes=max_sandboxes, max_cpu=max_cpu,
                                  max_memory=max_memory, images=image)
    if as_json:
        print_json(created)
    else:
        print(created.token)


@app.command("ls")
@handle_errors
def ls(as_json: bool = typer.Option(False, "--json")) -> None:
    """List tenants and their quotas."""
    tenants = client().tenants()
    if as_json:
        print_json(tenants)
        return
    t = Table(box=None, header_style="bold")
    for col in ("NAME", "ADMIN", "MAX SANDBOXES", "MAX CPU", "MAX MEM", "IMAGES"):
        t.add_column(col)
    for x in tenants:
        t.add_row(x.name, "yes" if x.admin else "", str(x.max_sandboxes or "-"),
                  f"{x.max_cpu:g}" if x.max_cpu is not None else "-",
                  human_bytes(x.max_memory) if x.max_memory is not None else "-",
                  ",".join(x.images) if x.images is not None else "*")
    out.print(t)


@app.command()
@handle_errors
def rm(name: str) -> None:
    """Remove a tenant: its token stops working and its sandboxes are killed."""
    client().remove_tenant(name)
    out.print(f"removed tenant {name}")
