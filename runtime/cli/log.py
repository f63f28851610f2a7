"""``dispach log``: the event log as storage (how big, how old, what fills it).

``log stats`` reads the node's database directly, in a read-only transaction, so it works with
or without a running node. It scans the events table once (one ``GROUP BY``): on a large log it
takes as long as reading the log, and holds no lock a writer waits on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from runtime import config as config_module

if TYPE_CHECKING:
    import psycopg

# Per (agent, type): events and bytes. A row's bytes are what it holds as stored (compressed
# values counted compressed): its whole-row ``pg_column_size``, with the tuple header, plus the
# 4-byte line pointer; ``data`` apart, the part a change of an event's shape moves. Events with
# no agent (none today) are counted under ''.
_BY_TYPE = """SELECT coalesce(metadata->>'agentId', '') AS agent, type, count(*),
                     sum(pg_column_size(e.*) + 4), sum(pg_column_size(data))
                FROM events e
               GROUP BY 1, 2
               ORDER BY 1, 4 DESC"""
_SPAN = "SELECT count(*), min(recorded_at), max(recorded_at) FROM events"
# Every table of the schema, a partitioned one (the log, migration 0014) as one table: its size
# is the sum over its partitions (a plain table has no partition tree: its own size).
_TABLES = """SELECT c.relname, coalesce((SELECT sum(pg_total_relation_size(p.relid))
                                            FROM pg_partition_tree(c.oid) p),
                                         pg_total_relation_size(c.oid))
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')
                AND NOT c.relispartition
              ORDER BY 2 DESC, 1"""
_ROWS = "SELECT count(*) FROM {}"
_TURNS = "turn.start"

"""Every turn has exactly one: the turns an agent's bytes are divided by."""


@click.group("log")
def log() -> None:
    """The event log as storage: its size, its span, what fills it."""


@log.command("stats")
@click.option("--json", "as_json", is_flag=True, help="The figures as one JSON document.")
def log_stats(as_json: bool) -> None:
    """Bytes per turn by event type and agent; rows and bytes of every table; the log's total
    size and its oldest and newest event.

    With --json: {"log": {...}, "tables": [...], "agents": [{..., "types": [...]}]}.
    """
    with _read_only() as conn:
        body = stats(conn)
    _echo(body, describe(body), as_json)


def stats(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """The figures of ``log stats`` (camelCase, as the API's bodies), from one snapshot."""
    from psycopg import sql

    from eventstore import INLINE

    count, oldest, newest = conn.execute(_SPAN).fetchone() or (0, None, None)
    tables = []
    for name, size in conn.execute(_TABLES).fetchall():
        rows = conn.execute(sql.SQL(_ROWS).format(sql.Identifier(name))).fetchone()
        tables.append({"table": name, "rows": int(rows[0]) if rows else 0, "bytes": int(size)})
    found = [(str(a), str(t), int(n), int(b), int(d)) for a, t, n, b, d in conn.execute(_BY_TYPE)]
    turns = sum(n for _, kind, n, _, _ in found if kind == _TURNS)
    # The log's rows and its read models', not the bookkeeping (migrations, fences, archives).
    written = {"events", *(table for p in INLINE for table in p.tables)}
    rows = sum(t["rows"] for t in tables if t["table"] in written)
    return {
        "log": {
            "events": int(count),
            "bytes": next((t["bytes"] for t in tables if t["table"] == "events"), 0),
            "rowBytes": sum(row[3] for row in found),
            "oldest": _iso(oldest),
            "newest": _iso(newest),
            "turns": turns,
            "eventsPerTurn": _per(int(count), turns),
            "rowsPerTurn": _per(rows, turns),
            "bytesPerTurn": _per(sum(row[3] for row in found), turns),
        },
        "tables": tables,
        "agents": per_agent(found),
    }


def per_agent(found: list[tuple[str, str, int, int, int]]) -> list[dict[str, Any]]:
    """(agent, type, events, row bytes, data bytes) rows as one entry per agent, its types by
    bytes, each with its bytes per turn (None for an agent with no turn: schedules only)."""
    agents: dict[str, list[tuple[str, int, int, int]]] = {}
    for agent, kind, count, size, data in found:
        agents.setdefault(agent, []).append((kind, count, size, data))
    out = []
    for agent, types in agents.items():
        turns = sum(count for kind, count, _, _ in types if kind == _TURNS)
        total = sum(size for _, _, size, _ in types)
        events = sum(c for _, c, _, _ in types)
        out.append({
            "agentId": agent, "turns": turns, "events": events,
            "eventsPerTurn": _per(events, turns), "bytes": total,
            "bytesPerTurn": _per(total, turns),
            "types": [{"type": kind, "events": count, "bytes": size, "dataBytes": data,
                       "bytesPerTurn": _per(size, turns)}
                      for kind, count, size, data in types],
        })  # fmt: skip
    return out


def describe(body: dict[str, Any]) -> list[str]:
    """``log stats`` for a person: the log, the tables, then each agent's types."""
    log_ = body["log"]
    lines = [
        f"log: {log_['events']:,} events, {_size(log_['bytes'])} on disk "
        f"({_size(log_['rowBytes'])} in rows), oldest {log_['oldest'] or '-'}, "
        f"newest {log_['newest'] or '-'}",
    ]
    if log_["turns"]:
        lines.append(f"per turn ({log_['turns']:,} turns): {log_['eventsPerTurn']:,.1f} events, "
                     f"{log_['rowsPerTurn']:,.1f} rows of the log and its projections, "
                     f"{log_['bytesPerTurn']:,.0f} B of events")  # fmt: skip
    lines.append("tables:")
    lines += [f"  {t['table']:<28} {t['rows']:>12,} rows {_size(t['bytes']):>10}"
              for t in body["tables"]]  # fmt: skip
    for agent in body["agents"]:
        per = agent["bytesPerTurn"]
        each = agent["eventsPerTurn"]
        lines.append(f"agent {agent['agentId'] or '(none)'}: {agent['turns']:,} turns, "
                     f"{agent['events']:,} events, {_size(agent['bytes'])}"
                     + (f", {each:,.1f} events and {per:,.0f} B per turn"
                        if per is not None and each is not None else ""))  # fmt: skip
        for t in agent["types"]:
            each = t["bytesPerTurn"]
            shown = f"{each:>10,.0f} B/turn" if each is not None else ""
            lines.append(f"  {t['type']:<22} {t['events']:>10,} events {_size(t['bytes']):>10}"
                         f" {shown}".rstrip())  # fmt: skip
    return lines


@log.command("archive")
@click.option("--partition", help="The partition to archive (events_<first position>).")
@click.option("--before", type=click.DateTime(), help="Archive every partition whose newest event "
              "is older than this date (ISO 8601), as retention would.")  # fmt: skip
@click.option(
    "--to",
    "to",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write it (default: DISPACH_ARCHIVE_DIR or <home>/archives).",
)
@click.option("--json", "as_json", is_flag=True, help="The manifests as one JSON document.")
def log_archive(partition: str | None, before: datetime | None, to: Path | None,
                as_json: bool) -> None:  # fmt: skip
    """Archive whole partitions of the log (compressed JSON Lines, a manifest with checksums),
    then detach and drop them. Never the newest ones, nor one a running turn (or, with
    --before and keep_sessions_active, an active session) still reads."""
    from eventstore import archive

    if (partition is None) == (before is None):
        raise click.UsageError("pass either --partition NAME or --before DATE")
    settings = config_module.from_env()
    directory = to or settings.archives_path
    with _writable(settings) as conn:
        if partition is not None:
            manifests = [archive.archive(conn, partition, directory)]
        else:
            assert before is not None
            at = before if before.tzinfo is not None else before.replace(tzinfo=UTC)
            days = max(0.0, (datetime.now(UTC) - at).total_seconds() / 86400)
            retention = archive.Retention(days, settings.retention_keep_sessions_active)
            manifests = [archive.archive(conn, name, directory, retention=retention)
                         for name in archive.eligible(conn, retention)]  # fmt: skip
    lines = [f"archived {m['partition']} as {directory / m['archiveId']}: {m['events']:,} events, "
             f"{_size(m['bytes'])} ({_size(m['files'][archive.EVENTS_FILE]['bytes'])} compressed)"
             for m in manifests] or ["nothing to archive"]  # fmt: skip
    _echo(manifests, lines, as_json)


@log.command("restore")
@click.argument("where", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="The manifest as JSON.")
def log_restore(where: Path, as_json: bool) -> None:
    """Bring an archive back into the log (its directory or its manifest.json): checksums
    verified, rows checked byte for byte against the manifest, the partition attached again."""
    from eventstore import archive

    with _writable(config_module.from_env()) as conn:
        manifest = archive.restore(conn, where)
    line = f"restored {manifest['partition']}: {manifest['events']:,} events readable again"
    _echo(manifest, [line], as_json)


@contextmanager
def _writable(settings: config_module.Settings) -> Iterator[psycopg.Connection[Any]]:
    """An archiving connection to the node's schema (eventstore/archive.py); a refusal or a
    driver error becomes the command's error."""
    import psycopg

    from eventstore.archive import connect
    from eventstore.errors import DispachError
    from runtime.embedded import services_for

    try:
        with (
            services_for(settings.home, settings.database_url, settings.nats_url) as (url, _),
            connect(url, settings.schema) as conn,
        ):
            yield conn
    except DispachError as e:
        raise click.ClickException(f"{e.code}: {e.message}\n  hint: {e.hint}") from e
    except psycopg.Error as e:
        raise click.ClickException(
            f"log_unwritable: {type(e).__name__}: {e}\n"
            "  hint: check DATABASE_URL and DISPACH_DB_SCHEMA (the node's database and schema)"
        ) from e


@contextmanager
def _read_only() -> Iterator[psycopg.Connection[Any]]:
    """A read-only transaction on the node's schema (shared with a running node's services, or
    on embedded ones started for the command); a driver error becomes the command's error."""
    import psycopg
    from psycopg import sql

    from runtime.embedded import services_for

    settings = config_module.from_env()
    try:
        with (
            services_for(settings.home, settings.database_url, settings.nats_url) as (url, _),
            psycopg.connect(url) as conn,
        ):
            conn.read_only = True
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(settings.schema)))
            yield conn
    except psycopg.Error as e:
        raise click.ClickException(
            f"log_unreadable: {type(e).__name__}: {e}\n"
            "  hint: check DATABASE_URL and DISPACH_DB_SCHEMA (the node's database and schema)"
        ) from e


def _echo(body: object, lines: list[str], as_json: bool) -> None:
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(body)))
        return
    for line in lines:
        click.echo(line)


def _per(total: int, turns: int) -> float | None:
    return total / turns if turns else None


def _iso(at: datetime | None) -> str | None:
    return at.isoformat().replace("+00:00", "Z") if at is not None else None


def _size(n: int) -> str:
    if n < 1024:
        return f"{n:,} B"
    size = float(n)
    for unit in ("kB", "MB", "GB"):
        size /= 1024
        if size < 1024 or unit == "GB":
            break
    return f"{size:,.1f} {unit}"
