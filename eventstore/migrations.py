"""Schema migrations, applied at start: numbered ``migrations/NNNN_name.sql`` files, each once.

Several nodes may start at once against one database, so the whole run holds a session advisory
lock keyed by the schema; a migration file that changed after it was applied is refused.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import psycopg
from psycopg import sql

from eventstore._sql import check_schema_name
from eventstore.errors import MigrationError, StoreUnavailable


def available() -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` of every migration shipped with this code, in order."""
    found = []
    for entry in resources.files("eventstore").joinpath("migrations").iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append((int(number), rest.removesuffix(".sql"), entry.read_text()))
    return sorted(found)


def migrate(conninfo: str, schema: str) -> list[str]:
    """Bring ``schema`` up to date; returns the names of the migrations applied now."""
    check_schema_name(schema)
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            return _migrate(conn, schema)
    except psycopg.OperationalError as e:
        raise StoreUnavailable(
            f"cannot reach Postgres to migrate: {e}".strip(),
            "check DATABASE_URL, or unset it to use the embedded Postgres",
        ) from e


def _migrate(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> list[str]:
    conn.execute("SELECT pg_advisory_lock(hashtext(%s))", [f"dispach.migrate.{schema}"])
    try:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
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
        for version, name, text in available():
            checksum = hashlib.sha256(text.encode()).hexdigest()
            if version in done:
                if done[version] != checksum:
                    raise MigrationError(
                        f"migration {version:04d}_{name} changed after it was applied",
                        "never edit an applied migration; add a new numbered file instead",
                    )
                continue
            with conn.transaction():
                conn.execute(text.encode())
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    [version, name, checksum],
                )
            applied.append(f"{version:04d}_{name}")
        return applied
    finally:
        conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", [f"dispach.migrate.{schema}"])
