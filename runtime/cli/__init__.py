"""The ``dispach`` command."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from runtime.config import Settings


def _print_version(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    """``--version``: the node's own version string (imported only when asked: it is heavy)."""
    if not value or ctx.resilient_parsing:
        return
    from gateways.http.app import VERSION

    click.echo(f"dispach {VERSION}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Print the version and exit.")  # fmt: skip
def main() -> None:
    """Dispach: an AI agent runtime on an append-only event log.

    Configuration comes from the environment: DISPACH_HOME (data directory, default ~/.dispach),
    DATABASE_URL and NATS_URL (unset: embedded Postgres and NATS are started under DISPACH_HOME),
    DISPACH_HOST / DISPACH_PORT (127.0.0.1:7420), DISPACH_API_TOKEN (a token or an API key).
    """


def _register() -> None:
    """The commands, each from the module of its kind (imported here, once ``main`` exists)."""
    from runtime.cli import keys, log, remote, serve, store

    for command in (serve.serve, store.events, store.projections, log.log, remote.send,
                    remote.chat, remote.mcp_command, remote.turns, remote.cluster, remote.agents,
                    remote.sessions, remote.approvals, keys.keys):  # fmt: skip
        main.add_command(command)


_register()


def serve_settings(
    host: str | None, port: int | None, home: str | None, agents: str | None, workers: str | None
) -> Settings:
    """The settings of ``serve`` (runtime/cli/serve.py)."""
    from runtime.cli.serve import serve_settings as settings_of

    return settings_of(host, port, home, agents, workers)
