"""``dsec episode``: inspect, export and garbage-collect episode checkpoints."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.table import Table

from dsec.cli.common import client, err, handle_errors, out

app = typer.Typer(help="Episodes: logged, checkpointed, resumable agent runs.", no_args_is_help=True)


def _store():
    from dsec.blobs import open_checkpoint_store
    from dsec.config import get_settings
    return open_checkpoint_store(get_settings())


def _episode_key(tenant: str, episode_id: str) -> str:
    """The store key of ``tenant``'s episode: keyed by the tenant's uid (read from the state DB)."""
    import asyncio

    from dsec.config import get_settings
    from dsec.errors import NotFound
    from dsec.state import state_for
    from dsec.state.keys import episode_key

    async def lookup():  # -> TenantRecord | None
        settings = get_settings()
        state = state_for(settings.state_url, settings.home)  # the server's store (DSEC_STATE_URL)
        try:
            await state.open()
            return await state.get_tenant(tenant)
        finally:
            await state.close()

    rec = asyncio.run(lookup())
    if rec is None:
        raise NotFound(f"tenant {tenant!r} not found in this DSEC_HOME's state; list tenants with `dsec tenant ls`")
    return episode_key(rec.uid, episode_id)


@app.command("export")
@handle_errors
def export(episode_id: str = typer.Argument(..., help="Episode id"),
           output: Path = typer.Option(None, "-o", "--output", help="File (default: stdout)"),
           tenant: str = typer.Option(None, help="Read the checkpoint store directly for this tenant "
                                                 "(no server needed) instead of asking the API"),
           jsonl: bool = typer.Option(False, "--jsonl", help="Decompress to plain JSON lines")) -> None:
    """Write the episode's trajectory (zstd-compressed JSONL; `--jsonl` for plain)."""
    if tenant:
        from dsec.checkpoints.engine import EpisodeEngine
        data = EpisodeEngine.export_from(_store(), _episode_key(tenant, episode_id))
    else:
        from dsec.models.episode import EpisodeInfo
        from dsec.sdk.episode import Episode
        data = Episode(EpisodeInfo(id=episode_id, steps=0, seq=0, sandbox_id=None, fs_digest="",
                                   has_context=False), client()).export()
    if jsonl:
        import io

        import zstandard
        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    if output:
        output.write_bytes(data)
        err.print(f"wrote {len(data)} bytes to {output}")
    else:
        sys.stdout.buffer.write(data)


@app.command("show")
@handle_errors
def show(episode_id: str = typer.Argument(..., help="Episode id as stored (<tenant uid>--<id>; see `dsec episode ls`)")) -> None:
    """List the checkpoint units of an episode and whether each is complete."""
    from dsec.checkpoints.unit import list_unit_keys, load_meta, parts_present
    store = _store()
    t = Table("seq", "kind", "steps", "created", "fs layers", "complete", "fs digest")
    for seq, key in list_unit_keys(store, episode_id):
        m = load_meta(store, key)
        if m is None:
            t.add_row(str(seq), "?", "?", "?", "?", "[red]corrupt metadata[/red]", "")
            continue
        ok = parts_present(store, m)
        t.add_row(str(seq), m.kind, str(m.steps), time.strftime("%H:%M:%S", time.localtime(m.created_at)),
                  str(len(m.fs_chain)), "[green]yes[/green]" if ok else "[red]missing parts[/red]",
                  m.fs_digest[:19])
    out.print(t)


@app.command("ls")
@handle_errors
def ls() -> None:
    """Episodes that have checkpoints in the configured store."""
    from dsec.checkpoints.unit import episode_ids
    for ep in episode_ids(_store()):
        if not ep.startswith("sbckpt."):  # plain-sandbox checkpoints: `GET /v1/checkpoints`
            out.print(ep)


@app.command("gc")
@handle_errors
def gc(grace: float = typer.Option(None, help="Only collect blobs older than this many seconds "
                                               "(default: checkpoint_gc_grace_s)")) -> None:
    """Delete checkpoint blobs no unit of any episode references."""
    from dsec.checkpoints.unit import collect_garbage
    from dsec.config import get_settings
    n = collect_garbage(_store(), grace if grace is not None else get_settings().checkpoint_gc_grace_s)
    out.print(f"collected {n} blobs")
