"""The ``dispach`` command."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from eventstore.errors import DispachError
from runtime import config as config_module

if TYPE_CHECKING:
    from eventstore import EventStore, Projection


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Dispach: an AI agent runtime on an append-only event log.

    Configuration comes from the environment: DISPACH_HOME (data directory, default ~/.dispach),
    DATABASE_URL and NATS_URL (unset: embedded Postgres and NATS are started under DISPACH_HOME),
    DISPACH_HOST / DISPACH_PORT (127.0.0.1:7420), DISPACH_API_TOKEN.
    """


@main.command()
@click.option("--host", help="Bind address (DISPACH_HOST). Non-loopback needs DISPACH_API_TOKEN.")
@click.option("--port", type=int, help="Port (DISPACH_PORT, default 7420).")
@click.option("--home", type=click.Path(), help="Data directory (DISPACH_HOME).")
@click.option("--agents", type=click.Path(), help="Directory of agent manifests (DISPACH_AGENTS).")
def serve(host: str | None, port: int | None, home: str | None, agents: str | None) -> None:
    """Start a node: Postgres, NATS, the event store, actors and the HTTP API."""
    from pathlib import Path

    import uvloop

    from runtime.logs import configure
    from runtime.node import serve as serve_node

    with _errors():
        settings = config_module.from_env(
            host=host,
            port=port,
            home=Path(home).expanduser() if home else None,
            agents_dir=Path(agents).expanduser() if agents else None,
        )
        configure(settings.log_format, settings.log_level)
        status = uvloop.run(serve_node(settings))
    sys.exit(status)


@main.group()
def events() -> None:
    """Read the event log."""


@events.command("show")
@click.argument("stream")
@click.option("--json", "as_json", is_flag=True, help="One public JSON envelope per line.")
@click.option("--full", is_flag=True, help="Include private fields (tool arguments, outputs).")
def events_show(stream: str, as_json: bool, full: bool) -> None:
    """Print every event of STREAM (e.g. turn-<turnId>) in version order."""
    from runtime import show

    with _errors(), _store() as (store, _):
        found = store.read_stream(stream)
        if not found:
            raise click.ClickException(
                f"stream {stream} has no events (stream names look like turn-<turnId>)"
            )
        for event in found:
            click.echo(show.as_json(event) if as_json else show.line(event, full=full))


@events.command("tail")
@click.option("--after", help="Start after this cursor (an event's `cursor`).")
@click.option("--from-start", is_flag=True, help="Start at the beginning of the log.")
@click.option("--category", "categories", multiple=True, help="Only these stream categories.")
@click.option("--type", "types", multiple=True, help="Only these event types.")
@click.option("--json", "as_json", is_flag=True, help="One public JSON envelope per line.")
@click.option("--full", is_flag=True, help="Include private fields (tool arguments, outputs).")
def events_tail(
    after: str | None,
    from_start: bool,
    categories: tuple[str, ...],
    types: tuple[str, ...],
    as_json: bool,
    full: bool,
) -> None:
    """Follow the log live (new events only, unless --from-start or --after)."""
    from eventstore import RecordedEvent
    from runtime import show
    from runtime.tail import check_types, tail

    def emit(event: RecordedEvent) -> None:
        click.echo(show.as_json(event) if as_json else show.line(event, full=full), nl=True)

    with _errors():
        check_types(set(types))
        with _store() as (store, nats_url), contextlib.suppress(KeyboardInterrupt):
            asyncio.run(tail(store, nats_url, after, from_start, set(categories), set(types), emit))


@main.group()
def projections() -> None:
    """Maintain the read models derived from the log."""


@projections.command("rebuild")
@click.argument("names", nargs=-1)
def projections_rebuild(names: tuple[str, ...]) -> None:
    """Empty projections and rebuild them from the log (all, or NAMES).

    Safe while a node runs: an inline projection is rebuilt under a lock its writers wait on;
    an asynchronous one is reset and caught up, and a running node's runner carries on from it.
    """
    from eventstore import ASYNC, INLINE, rebuild

    known = {p.name: (p, True) for p in INLINE} | {p.name: (p, False) for p in ASYNC}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.ClickException(
            f"no projection named {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    with _errors(), _store() as (store, _), store.pool.connection() as conn:
        for name in names or sorted(known):
            projection, inline = known[name]
            applied = rebuild(conn, projection, inline=inline)
            if inline:
                click.echo(f"{name}: rebuilt from {applied} events")
            else:
                applied = asyncio.run(_catch_up(store, projection))
                click.echo(f"{name}: reset, then caught up over {applied} events")


async def _catch_up(store: EventStore, projection: Projection) -> int:
    from eventstore import ProjectionRunner

    await store.apool.open()
    try:
        return await ProjectionRunner(store, projection).catch_up()
    finally:
        await store.apool.close()


@contextmanager
def _store() -> Iterator[tuple[EventStore, str | None]]:
    """The node's store (shared with a running node, or on services started for the command)."""
    from eventstore import INLINE, EventStore
    from runtime.embedded import services_for

    settings = config_module.from_env()
    with services_for(settings.home, settings.database_url, settings.nats_url) as (db, nats_url):
        store = EventStore(db, schema=settings.schema, inline=INLINE, pool_size=2)
        store.open()
        try:
            yield store, nats_url
        finally:
            store.close()


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except DispachError as e:
        raise click.ClickException(f"{e.code}: {e.message}\n  hint: {e.hint}") from e
