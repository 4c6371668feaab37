"""``dsec image``: import, build, ls, inspect, export, push, pull, rm, gc, verify, ensure-stock."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from dsec.config import get_settings
from dsec.errors import DSecError

app = typer.Typer(help="Manage node-local images (OCI layouts, docker-save archives, builds).",
                  no_args_is_help=True)
_err = Console(stderr=True)


def _store():  # type: ignore[no-untyped-def]
    from dsec.images import ImageStore

    s = get_settings()
    return ImageStore(s.home / "images", s)


def _fail(exc: DSecError) -> None:
    _err.print(f"[red]error[/red] ({exc.code}): {exc.message}")
    raise typer.Exit(1)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@app.command("import")
def import_(path: Path, name: str | None = typer.Option(None, "--name", help="NAME:TAG to give the image")) -> None:
    """Import an OCI image layout (dir or tar) or a `docker save` archive."""
    from dsec.images.progress import progress_reporter

    try:
        with progress_reporter(f"import {path.name}") as prog:
            info = _store().import_archive(path, name=name, progress=prog)
    except DSecError as exc:
        _fail(exc)
    typer.echo(f"imported {', '.join(info.names)} {info.id}")


@app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="Machine-readable output")) -> None:
    """List images: name:tag, id, layers, size, last used."""
    images = _store().list()
    if as_json:
        typer.echo(json.dumps([i.model_dump() for i in images], indent=2))
        return
    t = Table("NAME", "ID", "LAYERS", "SIZE", "LAST USED")
    for i in images:
        last = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.last_used)) if i.last_used else "never"
        for n in i.names or ["<none>"]:
            t.add_row(n, i.id[7:19], str(len(i.layers)), _human(i.size), last)
    Console().print(t)


@app.command()
def inspect(ref: str) -> None:
    """Show an image's metadata, layers and config as JSON."""
    try:
        store = _store()
        info = store.resolve(ref)
        cfg = json.loads(store.content.read_bytes(info.id))
    except DSecError as exc:
        _fail(exc)
    typer.echo(json.dumps({"image": info.model_dump(), "config": cfg}, indent=2))


@app.command()
def rm(refs: list[str]) -> None:
    """Remove images (by NAME:TAG untags; by id removes the image)."""
    store = _store()
    for ref in refs:
        try:
            typer.echo("removed " + ", ".join(store.remove(ref)))
        except DSecError as exc:
            _fail(exc)


@app.command()
def gc(unused_s: float | None = typer.Option(None, help="Override settings.image_gc_unused_s")) -> None:
    """Delete unreferenced blobs/layers unused for a while; apply the cache budget."""
    report = _store().gc(unused_s)
    typer.echo(report.model_dump_json(indent=2))


@app.command()
def export(ref: str, path: Path, tag: str | None = typer.Option(None, help="Tag in the layout index"),
           compression: str | None = typer.Option(
               None, help="Re-encode layers as gzip|zstd|tar (umoci 0.4.7 needs gzip); default: as stored")) -> None:
    """Write an image as an OCI image layout (PATH dir, or PATH.tar)."""
    try:
        _store().export(ref, path, tag, compression)
    except DSecError as exc:
        _fail(exc)
    typer.echo(f"exported {ref} to {path}")


@app.command()
def verify(ref: str, deep: bool = typer.Option(False, help="Also check every unpacked file's content")) -> None:
    """Check an image's blobs and unpacked layers against their digests."""
    try:
        result = _store().verify(ref, deep=deep)
    except DSecError as exc:
        _fail(exc)
    bad = {k: v for k, v in result.items() if v}
    for k, v in result.items():
        typer.echo(f"{k}: {'ok' if not v else v}")
    if bad:
        raise typer.Exit(1)


@app.command()
def build(file: Path = typer.Option(..., "-f", "--file", help="Build spec (YAML)"),  # noqa: B008
          tag: str = typer.Option(..., "-t", "--tag", help="NAME:TAG of the result"),
          backend: str = typer.Option("unshare", help="RUN-step backend: unshare | manager")) -> None:
    """Build an image from a base image plus steps (docs/images.md)."""
    from dsec.images.build import Builder, load_spec, make_runner

    try:
        store = _store()
        spec = load_spec(file)
        result = Builder(store, make_runner(backend, store)).build(spec, tag, context=file.parent,
                                                                   log=lambda m: typer.echo(m, err=True))
    except DSecError as exc:
        _fail(exc)
    typer.echo(f"built {tag} {result.image.id} ({result.cached} cached, {result.built} built steps)")


def _creds(username: str | None, password_stdin: bool):  # type: ignore[no-untyped-def]
    from dsec.images.registry_ops import Credentials

    password = sys.stdin.readline().rstrip("\r\n") if password_stdin else None
    return Credentials(username, password)


_INSECURE_HELP = "Allow plain http (and unverified TLS) to a non-loopback registry (loopback may use http anyway)"


@app.command()
def push(image: str, ref: str,
         insecure: bool = typer.Option(False, "--insecure", help=_INSECURE_HELP),
         username: str | None = typer.Option(None, "--username", "-u", help="Registry user (else registry_username)"),
         password_stdin: bool = typer.Option(False, "--password-stdin", help="Read the password from stdin")) -> None:
    """Push a local IMAGE to an OCI registry as REF (HOST[:PORT]/REPO[:TAG]); blobs are sent byte for byte."""
    from dsec.images.progress import progress_reporter
    from dsec.images.registry_ops import push as _push

    try:
        creds = _creds(username, password_stdin)
        t0 = time.monotonic()
        with progress_reporter(f"push {ref}") as prog:
            digest = _push(_store(), image, ref, insecure=insecure, creds=creds, progress=prog)
    except DSecError as exc:
        _fail(exc)
    typer.echo(f"pushed {image} to {ref} {digest} ({time.monotonic() - t0:.1f}s)")


@app.command()
def pull(ref: str, name: str | None = typer.Option(None, "--name", help="Local NAME:TAG (default: REF itself)"),
         insecure: bool = typer.Option(False, "--insecure", help=_INSECURE_HELP),
         username: str | None = typer.Option(None, "--username", "-u", help="Registry user (else registry_username)"),
         password_stdin: bool = typer.Option(False, "--password-stdin", help="Read the password from stdin"),
         unpack: bool = typer.Option(True, "--unpack/--no-unpack", help="Unpack the layers now (else on first use)"),
         ) -> None:
    """Pull REF (HOST[:PORT]/REPO[:TAG|@sha256:...]) from an OCI registry; every blob is digest-verified."""
    from dsec.images.progress import progress_reporter
    from dsec.images.registry_ops import pull as _pull

    try:
        creds = _creds(username, password_stdin)
        t0 = time.monotonic()
        with progress_reporter(f"pull {ref}") as prog:
            info = _pull(_store(), ref, name=name, insecure=insecure, creds=creds, progress=prog, unpack=unpack)
    except DSecError as exc:
        _fail(exc)
    typer.echo(f"pulled {', '.join(info.names)} {info.id} ({len(info.layers)} layers, {_human(info.size)}, "
               f"{time.monotonic() - t0:.1f}s)")


@app.command("ensure-stock")
def ensure_stock(only: list[str] | None = typer.Option(None, "--only", help="busybox and/or python")) -> None:  # noqa: B008
    """Build the stock images offline if missing (idempotent, fast when present)."""
    from dsec.images.stock import ensure_stock as _ensure

    try:
        out = _ensure(_store(), only, log=lambda m: typer.echo(m, err=True))
    except DSecError as exc:
        _fail(exc)
    for name, info in out.items():
        typer.echo(f"{name}: {info.id} ({len(info.layers)} layers)")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
