"""``dsec serve``: API server + control plane + node agent in one process."""

from __future__ import annotations

from pathlib import Path

import typer

from dsec.cli.common import handle_errors
from dsec.config import load_settings


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def serve(host: str | None = typer.Option(None, "--host", help="Bind address (default Settings.host)"),
              port: int | None = typer.Option(None, "--port", help="Port (default Settings.port; 0 = any)"),
              home: Path | None = typer.Option(None, "--home", help="Data dir (default DSEC_HOME)"),
              log_level: str = typer.Option("info", "--log-level")) -> None:
        """Run the DSec server (state under DSEC_HOME; Ctrl-C shuts down gracefully)."""
        from dsec.api.server import serve as run

        over: dict[str, object] = {}
        if home is not None:
            over["home"] = home
        settings = load_settings(**over)
        run(settings, host or settings.host, settings.port if port is None else port, log_level)
