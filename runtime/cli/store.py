"""The commands that read or maintain the log itself: ``events`` and ``projections``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from eventstore.errors import DispachError
from runtime import config as config_module

if TYPE_CHECKING:
    from eventstore import EventStore


@click.group()
def events() -> None:
    """Read the event log."""


@events.command("show")
@click.argument("stream")
@click.option("--json", "as_json", is_flag=True, help="One public JSON envelope per line.")
@click.option("--full", is_flag=True, help="Include private fields (tool arguments, outputs).")
def events_show(stream: str, as_json: bool, full: bool) -> None:
    """Print every event of STREAM (e.g. turn-<turnId>) in version order."""
    from runtime.cli import show

    with log_errors(), _store() as (store, _):
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
    from runtime.cli import show
    from runtime.cli.tail import check_types, tail

    def emit(event: RecordedEvent) -> None:
        click.echo(show.as_json(event) if as_json else show.line(event, full=full), nl=True)

    with log_errors():
        check_types(set(types))
        with _store() as (store, nats_url), contextlib.suppress(KeyboardInterrupt):
            asyncio.run(tail(store, nats_url, after, from_start, set(categories), set(types), emit))


@click.group()
def projections() -> None:
    """Maintain the read models derived from the log."""


@projections.command("rebuild")
@click.argument("names", nargs=-1)
@click.option("--page", type=click.IntRange(min=1), metavar="N",
              help="Events replayed per transaction (a few thousand by default).")  # fmt: skip
def projections_rebuild(names: tuple[str, ...], page: int | None) -> None:
    """Rebuild projections from the log (all, or NAMES) into new tables, then swap them in.

    Safe while a node runs: the log is replayed beside the live tables in short transactions;
    the swap then locks the live tables only to apply the last events and move the new tables
    in (writers wait for that alone: its lock time is printed). An asynchronous projection's
    checkpoint moves with its tables, and a running node's runner carries on from it. A rebuild
    that is stopped leaves the live tables as they were; run it again.
    """
    from eventstore import ASYNC, INLINE, rebuild
    from eventstore.rebuild import REBUILD_PAGE

    known = {p.name: (p, True) for p in INLINE} | {p.name: (p, False) for p in ASYNC}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.ClickException(
            f"no projection named {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    with log_errors(), _store() as (store, _):
        for name in names or sorted(known):
            projection, inline = known[name]
            progress = _every_second(f"{name}: {{}} events applied so far")
            done = rebuild(
                store, projection, inline=inline, page=page or REBUILD_PAGE, progress=progress
            )
            retried = f", at attempt {done.attempts}" if done.attempts > 1 else ""
            click.echo(
                f"{name}: rebuilt from {done.events} events; the swap held its tables' writers "
                f"for {done.lock_ms:.1f} ms ({done.tail} events applied under the lock{retried})"
            )


def _every_second(line: str) -> Callable[[int], None]:
    """A progress report that prints ``line`` with the count at most once a second."""
    last = time.monotonic()

    def report(count: int) -> None:
        nonlocal last
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            click.echo(line.format(count))

    return report


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
def log_errors() -> Iterator[None]:
    try:
        yield
    except DispachError as e:
        raise click.ClickException(f"{e.code}: {e.message}\n  hint: {e.hint}") from e
