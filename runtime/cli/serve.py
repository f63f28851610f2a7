"""``dispach serve``: a node (or ``--workers N`` of them behind one port)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from runtime import config as config_module
from runtime.cli.store import log_errors

if TYPE_CHECKING:
    from runtime.config import Settings


@click.command()
@click.option("--host", help="Bind address (DISPACH_HOST). Non-loopback needs DISPACH_API_TOKEN.")
@click.option("--port", type=int, help="Port (DISPACH_PORT, default 7420).")
@click.option("--home", type=click.Path(), help="Data directory (DISPACH_HOME).")
@click.option("--agents", type=click.Path(), help="Directory of agent manifests (DISPACH_AGENTS).")
@click.option(
    "--workers",
    metavar="N|auto",
    help="Node processes sharing the port, Postgres and NATS: a number, or auto for one per core "
    "(DISPACH_WORKERS, default 1).",
)
def serve(
    host: str | None, port: int | None, home: str | None, agents: str | None, workers: str | None
) -> None:
    """Start a node: Postgres, NATS, the event store, actors and the HTTP API.

    With --workers N (N > 1) this process supervises N nodes that share its port, its Postgres and
    its NATS (runtime/workers.py); SIGTERM or Ctrl-C drains them all.
    """
    import structlog
    import uvloop

    from runtime import workers as workers_module
    from runtime.logs import configure
    from runtime.server import serve as serve_node

    with log_errors():
        settings = serve_settings(host, port, home, agents, workers)
        configure(settings.log_format, settings.log_level)
        sock = workers_module.inherited_socket()  # set when this process is one of N workers
        if sock is None and settings.workers > 1:
            status = workers_module.supervise(settings)
        else:
            if sock is not None:
                structlog.contextvars.bind_contextvars(node=settings.node_id)
            status = uvloop.run(serve_node(settings, sock))
    sys.exit(status)


def serve_settings(
    host: str | None, port: int | None, home: str | None, agents: str | None, workers: str | None
) -> Settings:
    """The settings of `serve`: the environment, overridden by the options given."""
    from pathlib import Path

    return config_module.from_env(
        host=host,
        port=port,
        home=Path(home).expanduser() if home else None,
        agents_dir=Path(agents).expanduser() if agents else None,
        workers=config_module.workers(workers) if workers is not None else None,
    )
