"""The ``dsec`` command. Sub-commands live in their own modules and are registered here."""

from __future__ import annotations

import typer

app = typer.Typer(name="dsec", help="DSec: fast, secure, recoverable sandboxes for AI agents.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)

# Sub-command registrations (one line per module; keep this list sorted).
from dsec.cli.bench import app as bench_app; app.add_typer(bench_app, name="bench")  # noqa: E402,E702
from dsec.cli.demo import register as _reg_demo; _reg_demo(app)  # noqa: E402,E702
from dsec.cli.drill import register as _reg_drill; _reg_drill(app)  # noqa: E402,E702
from dsec.cli.episode import app as episode_app; app.add_typer(episode_app, name="episode")  # noqa: E402,E702
from dsec.cli.image import app as image_app; app.add_typer(image_app, name="image")  # noqa: E402,E702
from dsec.cli.pool import app as pool_app, register as _reg_sched; app.add_typer(pool_app, name="pool"); _reg_sched(app)  # noqa: E402,E702
from dsec.cli.sandbox import register as _reg_sandbox; _reg_sandbox(app)  # noqa: E402,E702 run/exec/ps/kill/logs
from dsec.cli.serve import register as _reg_serve; _reg_serve(app)  # noqa: E402,E702
from dsec.cli.sim import app as sim_app; app.add_typer(sim_app, name="sim")  # noqa: E402,E702
from dsec.cli.tenant import app as tenant_app; app.add_typer(tenant_app, name="tenant")  # noqa: E402,E702
