"""``dsec demo``: N concurrent scripted coding-agent episodes on the local server, live.

Starts (or reuses) the local server, ensures the stock image, runs the episodes with a
live rich view, prints a summary (episodes, tool calls, start and exec latency
percentiles, failures) and writes a JSON + markdown report.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import typer
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dsec.cli.common import err, handle_errors, out, percentile
from dsec.cli.demo_tasks import EPISODE_SHAPE, EpisodeResult, run_episode
from dsec.config import Settings, load_settings
from dsec.errors import DSecError


def _server_up() -> bool:
    from dsec.sdk import Client

    try:
        with Client(retries=0, timeout=5) as c:
            c.health()
        return True
    except DSecError:
        return False


def _ensure_image(settings: Settings, image: str) -> None:
    from dsec.images import ImageStore
    from dsec.images.stock import STOCK, ensure_stock

    name = image.split(":")[0]
    if name not in STOCK:
        return  # a user image: the server reports a clear 404 if it is missing
    with err.status(f"ensuring stock image {name!r} (first time builds it; cached afterwards)") as status:
        ensure_stock(ImageStore(settings.home / "images", settings), only=[name],
                     log=lambda m: status.update(f"image {name}: {m}"))


async def _admin(method: str, path: str, body: Any = None) -> Any:
    """One admin call to the local server; None when it does not apply (the server places
    without the scheduler: 404, or the token is not an admin's: 403)."""
    import httpx

    from dsec.sdk._config import resolve_config

    cfg = resolve_config()
    async with httpx.AsyncClient(base_url=cfg.url, headers={"authorization": f"Bearer {cfg.token}"},
                                 timeout=60) as http:
        r = await http.request(method, path, json=body)
        if r.status_code in (403, 404):
            return None
        r.raise_for_status()
        return r.json()


async def _set_pool(image: str, size: int) -> dict[str, Any] | None:
    """Declare (size > 0) or drop (0) a warm pool of the episodes' shape."""
    got = await _admin("PUT", "/v1/pools", {"spec": {"image": image, **EPISODE_SHAPE}, "size": size})
    return got["pools"][0] if got else None


async def _warm_hits() -> int | None:
    """The scheduler's warm hand-over counter (admin view), to report hits, not hopes."""
    got = await _admin("GET", "/v1/scheduler")
    return int(got["stats"]["warm_hits"]) if got else None


async def _warm_pool(image: str, n: int, live: bool, timeout_s: float = 180) -> dict[str, Any] | None:
    """Keep n sandboxes of the episodes' shape warm and wait until they are (this is how a
    rollout runs in production: its shape is declared before the episodes start). The
    warm-up is cold creation and is reported on its own line, never hidden."""
    t0 = time.perf_counter()
    pool = await _set_pool(image, n)
    if pool is None:
        return None
    shape = {k: pool[k] for k in ("image", "isolation", "cpu", "memory", "disk", "network")}
    progress = Progress(TextColumn("[bold]warming pool"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, disable=not live, transient=True)
    with progress:
        task = progress.add_task("warm", total=n)
        while pool["ready"] < n and time.perf_counter() - t0 < timeout_s:
            await asyncio.sleep(0.1)
            pools = (await _admin("GET", "/v1/pools") or {}).get("pools", [])
            pool = next((p for p in pools if all(p[k] == v for k, v in shape.items())), pool)
            progress.update(task, completed=min(n, pool["ready"]))
    return {"size": n, "ready": pool["ready"], "seconds": round(time.perf_counter() - t0, 2),
            "hits_before": await _warm_hits()}


async def _run_all(n: int, image: str, run_id: str, live: bool) -> tuple[list[EpisodeResult], float]:
    from dsec.sdk import AsyncClient

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), disable=not live)
    episodes = progress.add_task("episodes", total=n, info="")
    calls = progress.add_task("tool calls", total=None, info="")
    started = 0

    def on_step(_: int, what: str) -> None:
        nonlocal started
        if what == "create":
            started += 1
            progress.update(episodes, info=f"{started} sandboxes started")
        else:
            progress.advance(calls)

    async with AsyncClient() as client:
        t0 = time.perf_counter()
        with Live(Panel(progress, title=f"dsec demo · {n} agent episodes · image {image}"), console=err,
                  refresh_per_second=8, transient=False) if live else _Null():
            async def one(i: int) -> EpisodeResult:
                r = await run_episode(i, image, run_id, client, on_step)
                progress.advance(episodes)
                if not live:
                    err.print(f"episode {i} {r.task}: {'passed' if r.passed else 'FAILED'} "
                              f"({r.tool_calls} tool calls, {r.wall_s:.2f}s){' ' + r.error if r.error else ''}")
                return r
            results = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
        leftover = await client.list({"demo": run_id})
        if leftover:
            await client.kill_by_labels({"demo": run_id})
    return list(results), wall


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def summarize(results: list[EpisodeResult], wall: float, image: str, run_id: str) -> dict[str, Any]:
    starts = [r.start_s for r in results if r.start_s is not None]
    execs = [x for r in results for x in r.exec_s]
    calls = sum(r.tool_calls for r in results)
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    return {
        "run_id": run_id, "image": image, "episodes": len(results),
        "passed": sum(r.passed for r in results), "failed": sum(not r.passed for r in results),
        "fixed_after_failing_test": sum(r.passed and r.attempts > 1 for r in results),
        "tool_calls": calls, "wall_s": round(wall, 3),
        "tool_calls_per_s": round(calls / wall, 1) if wall else 0.0,
        "start_ms": {f"p{q}": ms(percentile(starts, q)) for q in (50, 95, 99)} | {"max": ms(max(starts, default=0))},
        "exec_ms": {f"p{q}": ms(percentile(execs, q)) for q in (50, 95, 99)} | {"max": ms(max(execs, default=0))},
        "errors": [{"episode": r.index, "task": r.task, "error": r.error} for r in results if r.error],
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "episodes_detail": [r.as_dict() for r in results],
    }


def _markdown(s: dict[str, Any]) -> str:
    lines = [f"# dsec demo report ({s['finished_at']})", "",
             f"{s['episodes']} concurrent coding-agent episodes in `{s['image']}` sandboxes on "
             f"{s['host']['cpus']} CPUs (kernel {s['host']['kernel']}).", "",
             "| metric | value |", "| --- | --- |"]
    rows = [("episodes passed", f"{s['passed']}/{s['episodes']}"),
            ("fixed after a failing test", s["fixed_after_failing_test"]),
            ("tool calls", s["tool_calls"]), ("wall time", f"{s['wall_s']} s"),
            ("tool calls / s", s["tool_calls_per_s"]),
            ("sandbox start p50 / p95 / p99", "{p50} / {p95} / {p99} ms".format(**s["start_ms"])),
            ("exec p50 / p95 / p99", "{p50} / {p95} / {p99} ms".format(**s["exec_ms"])),
            ("failed episodes", s["failed"])]
    wp = s.get("warm_pool")
    rows.append(("warm pool before the episodes", f"{wp['ready']}/{wp['size']} ready in {wp['seconds']} s (cold "
                 f"creates); {wp['hits']} of {s['episodes']} starts were warm hand-overs" if wp else
                 "none (every start above is a cold create)"))
    lines += [f"| {k} | {v} |" for k, v in rows]
    if s["errors"]:
        lines += ["", "## Failures", ""] + [f"- episode {e['episode']} ({e['task']}): {e['error']}"
                                            for e in s["errors"]]
    return "\n".join(lines) + "\n"


def _report_dir(explicit: Path | None, settings: Settings) -> Path:
    for d in ([explicit] if explicit else [Path.cwd() / "reports", settings.home / "reports"]):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise DSecError("no writable report directory; pass --report-dir")


def _summary_table(s: dict[str, Any]) -> Table:
    t = Table(title="dsec demo summary", header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("episodes (passed/total)", f"{s['passed']}/{s['episodes']}")
    t.add_row("fixed after a failing test", str(s["fixed_after_failing_test"]))
    t.add_row("tool calls", str(s["tool_calls"]))
    t.add_row("wall time", f"{s['wall_s']:.2f} s ({s['tool_calls_per_s']} calls/s)")
    t.add_row("start latency p50/p95/p99", "{p50} / {p95} / {p99} ms".format(**s["start_ms"]))
    t.add_row("exec latency p50/p95/p99", "{p50} / {p95} / {p99} ms".format(**s["exec_ms"]))
    wp = s.get("warm_pool")
    t.add_row("warm pool (before episodes)", f"{wp['ready']}/{wp['size']} in {wp['seconds']} s; "
              f"{wp['hits']}/{s['episodes']} starts warm" if wp else "none: cold starts")
    t.add_row("failed episodes", str(s["failed"]), style="red" if s["failed"] else None)
    return t


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def demo(episodes: Optional[int] = typer.Option(None, "-n", "--episodes", help="Concurrent episodes"),
             image: Optional[str] = typer.Option(None, help="Image (default Settings.demo_image)"),
             report_dir: Optional[Path] = typer.Option(None, help="Where to write the report"),
             as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON"),
             warm: bool = typer.Option(True, "--warm/--cold",
                                       help="Declare a warm pool of the episodes' shape first (production "
                                            "path) or create every sandbox cold")) -> None:
        """Run concurrent scripted coding-agent episodes on the local server and report latencies."""
        settings = load_settings()
        n = episodes or settings.demo_episodes
        img = image or settings.demo_image
        if n < 1:
            raise typer.BadParameter("--episodes must be >= 1")
        srv = None
        if not _server_up():
            from dsec.api.launch import start_serve
            from dsec.cli.doctor import check_home

            home = check_home(settings.home)  # the serve pre-flight cannot report it: its log lives there
            if home.status == "fail":
                from dsec.errors import InvalidArgument

                raise InvalidArgument(f"{home.detail}; fix: {home.fix}")

            err.print("[dim]no server running: starting `dsec serve` for the demo[/dim]")
            srv = start_serve(settings.home, log_name="demo-serve.log")
        try:
            _ensure_image(settings, img)
            run_id = "demo-" + uuid.uuid4().hex[:8]
            live = sys.stderr.isatty() and not as_json
            pool = asyncio.run(_warm_pool(img, n, live)) if warm else None
            if pool is not None and not live:
                err.print(f"warm pool: {pool['ready']}/{pool['size']} sandboxes ready in {pool['seconds']} s")
            try:
                results, wall = asyncio.run(_run_all(n, img, run_id, live=live))
            finally:
                if pool is not None:
                    after = asyncio.run(_warm_hits())
                    before = pool.pop("hits_before")
                    pool["hits"] = after - before if after is not None and before is not None else None
                    asyncio.run(_set_pool(img, 0))
        finally:
            if srv is not None:
                srv.stop()
        summary = summarize(results, wall, img, run_id)
        summary["warm_pool"] = pool
        d = _report_dir(report_dir, settings)
        stem = d / f"{run_id}"
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=2))
        stem.with_suffix(".md").write_text(_markdown(summary))
        if as_json:
            print(json.dumps({k: v for k, v in summary.items() if k != "episodes_detail"}, indent=2))
        else:
            out.print(_summary_table(summary))
            out.print(f"report: {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
        if summary["failed"]:
            raise typer.Exit(1)
