"""Schema migrations, applied at start: numbered ``migrations/NNNN_name.sql`` files, each once.

Several nodes may start at once against one database, so the whole run holds a session advisory
lock keyed by the schema; a migration file that changed after it was applied is refused.

A migration runs in one transaction with its ``schema_migrations`` row, unless its first line is
``-- dispach:no-transaction``: statements Postgres refuses inside a transaction block (``CREATE
INDEX CONCURRENTLY``, ``DROP INDEX CONCURRENTLY``) then run one at a time in autocommit, still
under the lock, and the row is inserted once the last of them succeeded. The file is split into
statements by one rule, not by parsing SQL: a statement ends at a line whose text ends with
``;`` (a ``--`` comment line never ends one; put comments on lines of their own). Such a file
therefore holds plain statements, no function bodies or ``DO`` blocks, whose inner ``;`` would
cut them (Postgres then refuses the pieces, and the migration fails before its row is written).
A failure leaves the statements before it applied, so every statement must be safe to run again:
a crash or a cancel during a concurrent build leaves an INVALID index behind, which ``CREATE INDEX
CONCURRENTLY IF NOT EXISTS`` would keep; drop the index (``DROP INDEX CONCURRENTLY IF EXISTS``)
before building it. A concurrent build also waits for every transaction of the database older
than it: a session left idle in a transaction holds the migration, and the node's start, until
it ends.

Migrations run on a connection of their own, without the store's statement and lock timeouts
(``_sql.connect_kwargs``): an index build on a large log may take longer than any of them. Its
``search_path`` is set for the session, so it holds for the statements run outside a transaction
as for the others.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from importlib import resources
from typing import NamedTuple

import psycopg
from psycopg import sql

from eventstore._sql import check_schema_name
from eventstore.errors import MigrationError, StoreUnavailable

NO_TRANSACTION = "-- dispach:no-transaction"

LOCK_POLL = 0.1
"""Seconds between two attempts at the migration lock. A runner waiting inside
``pg_advisory_lock`` holds a snapshot for as long as it waits, and ``CREATE INDEX CONCURRENTLY``
waits for every older snapshot of the database to end: the holder would wait for the waiter that
waits for it (Postgres ends it as a deadlock). Between two short ``pg_try_advisory_lock`` calls
the waiter holds none."""


class Migration(NamedTuple):
    version: int
    name: str
    text: str

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def available() -> list[Migration]:
    """Every migration shipped with this code, in order."""
    found = []
    for entry in resources.files("eventstore").joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    return sorted(found)


def outside_transaction(text: str) -> bool:
    """Whether a migration carries the no-transaction marker (on its first line only)."""
    return text.partition("\n")[0].strip() == NO_TRANSACTION


def statements(text: str) -> list[str]:
    """A no-transaction migration's statements, by the rule of the module docstring. Text after
    the last ``;`` is one more statement unless it is only comments and blank lines (Postgres
    then runs or refuses it, rather than it being dropped unseen)."""
    found, lines = [], []
    for line in text.splitlines():
        lines.append(line)
        stripped = line.strip()
        if stripped.endswith(";") and not stripped.startswith("--"):
            found.append("\n".join(lines).strip())
            lines = []
    if any(line.strip() and not line.strip().startswith("--") for line in lines):
        found.append("\n".join(lines).strip())
    return found


def migrate(conninfo: str, schema: str, migrations: Sequence[Migration] | None = None) -> list[str]:
    """Bring ``schema`` up to date with ``migrations`` (by default those shipped); returns the
    labels (``NNNN_name``) of the migrations applied now."""
    check_schema_name(schema)
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            return _migrate(conn, schema, available() if migrations is None else migrations)
    except psycopg.OperationalError as e:
        raise StoreUnavailable(
            f"cannot reach Postgres to migrate: {e}".strip(),
            "check DATABASE_URL, or unset it to use the embedded Postgres",
        ) from e


_Connection = psycopg.Connection[tuple[object, ...]]


def _migrate(conn: _Connection, schema: str, migrations: Sequence[Migration]) -> list[str]:
    key = f"dispach.migrate.{schema}"
    while not _try_lock(conn, key):
        time.sleep(LOCK_POLL)
    try:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        # Session level (autocommit): every statement after it, in or outside a transaction.
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        conn.execute(
            """CREATE TABLE IF NOT EXISTS schema_migrations (
                   version    integer     PRIMARY KEY,
                   name       text        NOT NULL,
                   checksum   text        NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        done = {
            version: checksum
            for version, checksum in conn.execute("SELECT version, checksum FROM schema_migrations")
        }
        applied = []
        for migration in migrations:
            if migration.version in done:
                if done[migration.version] != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.label} changed after it was applied",
                        "never edit an applied migration; add a new numbered file instead",
                    )
                continue
            if outside_transaction(migration.text):
                _apply_outside_transaction(conn, migration)
            else:
                _apply(conn, migration)
            applied.append(migration.label)
        return applied
    finally:
        if not conn.broken:
            conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", [key])


def _apply(conn: _Connection, migration: Migration) -> None:
    try:
        with conn.transaction():
            conn.execute(migration.text.encode())
            _record(conn, migration)
    except psycopg.Error as e:
        if conn.broken:
            raise
        raise MigrationError(
            f"migration {migration.label} failed: {_reason(e)}",
            "nothing of it was applied; fix the cause and start again",
        ) from e


def _apply_outside_transaction(conn: _Connection, migration: Migration) -> None:
    steps = statements(migration.text)
    for number, statement in enumerate(steps, 1):
        try:
            conn.execute(statement.encode())
        except psycopg.Error as e:
            if conn.broken:
                raise
            raise MigrationError(
                f"migration {migration.label} failed at statement {number} of {len(steps)}: "
                f"{_reason(e)}",
                "it runs outside a transaction, so the statements before it stay applied; fix "
                "the cause and start again: it is run again from its first statement",
            ) from e
    _record(conn, migration)


def _record(conn: _Connection, migration: Migration) -> None:
    conn.execute(
        "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
        [migration.version, migration.name, migration.checksum],
    )


def _try_lock(conn: _Connection, key: str) -> bool:
    row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))", [key]).fetchone()
    return row is not None and bool(row[0])


def _reason(e: psycopg.Error) -> str:
    return e.diag.message_primary or str(e)
