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
              cluster: str | None = typer.Option(None, "--cluster", help="Run sandboxes on this Ray cluster's "
                                                 "DSec nodes: ray://HEAD:PORT (default DSEC_CLUSTER)"),
              state: str | None = typer.Option(None, "--state", help="Shared state store: redis://HOST:PORT/DB "
                                               "(several API servers on one Redis) or sqlite:///PATH "
                                               "(default DSEC_STATE_URL, else DSEC_HOME/state.db)"),
              log_level: str = typer.Option("info", "--log-level")) -> None:
        """Run the DSec server (state under DSEC_HOME; Ctrl-C shuts down gracefully).

        Checks the host first (the `dsec doctor` checks) and refuses to start with the
        problem and the command that fixes it, instead of a traceback later."""
        from dsec.cli.doctor import serve_preflight

        over: dict[str, object] = {}
        if home is not None:
            over["home"] = home
        if cluster is not None:
            over["cluster"] = cluster
        if state is not None:
            over["state_url"] = state
        settings = load_settings(**over)
        bind_host, bind_port = host or settings.host, settings.port if port is None else port
        _raise_nofile()
        serve_preflight(settings, bind_host, bind_port, echo=lambda m: typer.echo(m, err=True))
        from dsec.api.server import serve as run

        run(settings, bind_host, bind_port, log_level)


def _raise_nofile() -> None:
    """A server holds sockets and files per sandbox: use the whole hard open-file limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass  # the doctor check reports the limit
