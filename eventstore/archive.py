"""Archiving whole partitions of the log, and bringing them back.

An archive is a directory ``<archive_id>/`` holding ``events.jsonl.gz`` (the partition's rows in
checkpoint order, one JSON object per line with every column; ``data`` and ``metadata`` are
their stored text, ``recorded_at`` in UTC) and ``manifest.json`` (the partition's name and
bounds, its position and transaction id range, its first and last ``recorded_at``, the event
count, each file's size and sha256, and ``rows_sha256``: the sha256 of the uncompressed lines,
which are the rows' canonical form: Postgres renders them, so a restored row that renders alike
is byte-identical).

Archiving, in order, so that a crash at any step loses nothing: export (streamed: COPY out, gzip,
hash; never a whole partition in memory), fsync the files and the directory, commit a
``log_archives`` row (from then on readers refuse to pass over the range:
eventstore/archive_ranges.py) with the streams whose head the partition holds (``archived_heads``:
appends continue their versions), verify the archive by reading it back while every store's cache
learns of the row (a failed check deletes the row again: the partition was never touched), and only
then detach the partition (``CONCURRENTLY``: appends and reads go on) and drop it. A run cut short
after the row is finished by the next (its files verified again).

Restoring: verify the file's checksum, load its lines into a new table (COPY), check that the
rows render to ``rows_sha256`` again, index it as the log's partitions are, attach it, and mark
the archive restored.

Which partitions may be archived is decided by :func:`refusal` from facts gathered by
:func:`facts`: never the newest partitions (positions are still handed out there), never one
with an event newer than the retention, never one holding events of a turn that has not ended
(its runner reads its stream again after a crash), and with ``keep_sessions_active`` never one
holding events of a session that had a turn within the retention (the notes tool and the context
replay read a session's stream from its first version).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

import msgspec
import psycopg
from isal import isal_zlib
from psycopg import sql

from eventstore import bridge
from eventstore._sql import check_schema_name
from eventstore.archive_ranges import GUARD_DELAY
from eventstore.errors import StoreError
from eventstore.partitions import Range, create_local_indexes, ranges

EVENTS_FILE = "events.jsonl.gz"
MANIFEST_FILE = "manifest.json"
FORMAT = "dispach-log-archive/1"
_GZIP_LEVEL = 1
"""ISA-L's level 1 (its gzip is a plain gzip file, ``gzip -d`` reads it): about 230 MB/s on
this machine, six times zlib's fastest level, and a smaller file; archival must keep pace with
the log (>= 50 MB/s)."""
_GZIP_WBITS = 31  # a gzip header and trailer (zlib's convention: 16 + a 32 kB window)
_CHUNK = 1 << 20
# isal's stubs declare ``error`` as an instance of Exception; it is the class it raises.
_INFLATE_ERROR = cast("type[Exception]", isal_zlib.error)

# The canonical form of a row: Postgres renders it (row_to_json of these columns, in this order),
# the same way at export and after restore. A line holds no raw newline (JSON escapes it) and no
# \x01 or \x02 (JSON escapes control characters), so COPY out in CSV mode with those as quote and
# delimiter passes it through as it is, unquoted and unescaped.
_COLUMNS = (
    "global_position, stream_id, stream_version, event_id, type, data, metadata, recorded_at,"
    " transaction_id"
)
_RAW_CSV = "(FORMAT csv, QUOTE E'\\x01', DELIMITER E'\\x02')"


class ArchiveError(StoreError):
    code = "archive_refused"


class Retention(NamedTuple):
    """What the log keeps (runtime/config.py ``retention``)."""

    turns_days: float
    keep_sessions_active: bool = True


class Facts(NamedTuple):
    """What :func:`refusal` decides on, about one partition."""

    name: str
    bounds: Range
    newest_partition: bool
    committed_until: int
    """The log's last committed position."""
    events: int
    last_recorded: datetime | None
    running_turns: int
    active_sessions: int


def refusal(facts: Facts, retention: Retention | None, now: datetime) -> str | None:
    """Why this partition may not be archived now, or None. Without ``retention`` (an archive a
    person asked for) only what would break the log is refused; with it, also what is newer
    than it keeps."""
    if facts.newest_partition or facts.bounds.upper > facts.committed_until:
        return f"partition {facts.name} may still receive positions (it is not behind the head)"
    if facts.events == 0:
        return f"partition {facts.name} holds no events"
    if facts.running_turns:
        return f"partition {facts.name} holds events of {facts.running_turns} turns not ended"
    if retention is None:
        return None
    assert facts.last_recorded is not None
    age_days = (now - facts.last_recorded).total_seconds() / 86400
    if age_days < retention.turns_days:
        return (f"partition {facts.name} holds events {age_days:.1f} days old "
                f"(retention keeps {retention.turns_days:g} days)")  # fmt: skip
    if retention.keep_sessions_active and facts.active_sessions:
        return f"partition {facts.name} holds events of {facts.active_sessions} active sessions"
    return None


Connection = psycopg.Connection[Any]


def connect(conninfo: str, schema: str) -> Connection:
    """An autocommit connection for archiving (no statement timeout: an export of a large
    partition takes longer than any request), in UTC so ``recorded_at`` renders alike."""
    return psycopg.connect(
        conninfo, autocommit=True, application_name="dispach-archive",
        options=f"-c search_path={check_schema_name(schema)} -c TimeZone=UTC",
    )  # fmt: skip


def facts(conn: Connection, name: str, retention: Retention | None) -> Facts:
    found = dict(ranges(conn))
    if name not in found:
        raise ArchiveError(
            f"the log has no partition {name}",
            "`dispach log stats` lists the tables; partitions are events_<first position>",
        )
    bounds = found[name]
    newest = max(r.upper for r in found.values())
    table = sql.Identifier(name)
    row = conn.execute(
        sql.SQL("SELECT count(*), max(recorded_at) FROM {}").format(table)
    ).fetchone()
    head = conn.execute("SELECT max(global_position) FROM events").fetchone()
    running = conn.execute(
        "SELECT count(*) FROM turns WHERE status = 'running' AND start_position < %s",
        [bounds.upper],
    ).fetchone()
    cutoff = None if retention is None else _cutoff(retention)
    active = conn.execute(
        sql.SQL(
            "SELECT count(DISTINCT (t.agent_id, t.session_key)) FROM turns t"
            " WHERE t.started_at >= %s AND EXISTS (SELECT 1 FROM {} e"
            "  WHERE e.metadata->>'agentId' = t.agent_id"
            "    AND e.metadata->>'sessionKey' = t.session_key LIMIT 1)"
        ).format(table),
        [cutoff or datetime.max.replace(tzinfo=UTC)],
    ).fetchone()
    assert row is not None and head is not None and running is not None and active is not None
    return Facts(name, bounds, bounds.upper == newest, int(head[0] or 0), int(row[0]), row[1],
                 int(running[0]), int(active[0]))  # fmt: skip


def _cutoff(retention: Retention) -> datetime:
    return datetime.fromtimestamp(time.time() - retention.turns_days * 86400, UTC)


def eligible(conn: Connection, retention: Retention) -> list[str]:
    """The partitions retention archives now, oldest first."""
    now = datetime.now(UTC)
    return [name for name, _ in ranges(conn)
            if refusal(facts(conn, name, retention), retention, now) is None]  # fmt: skip


def archive(conn: Connection, name: str, directory: Path, *,
            retention: Retention | None = None) -> dict[str, Any]:  # fmt: skip
    """Archive partition ``name`` into ``directory/<archive_id>/``, detach and drop it; returns
    the manifest. Refused (ArchiveError) as :func:`refusal` says. An archive of it that was cut
    short after its row was committed is finished (its files verified again)."""
    pending = conn.execute(
        "SELECT location FROM log_archives WHERE partition_name = %s AND restored_at IS NULL",
        [name],
    ).fetchone()
    if pending is not None:
        manifest = verify(Path(pending[0]))
        _detach_and_drop(conn, name)
        return manifest
    why = refusal(facts(conn, name, retention), retention, datetime.now(UTC))
    if why is not None:
        raise ArchiveError(why, "archive an older partition, or wait until this one is eligible")
    bounds = dict(ranges(conn))[name]
    archive_id = f"{name}-{datetime.now(UTC):%Y%m%dT%H%M%S.%fZ}"
    target = directory / archive_id
    target.mkdir(parents=True, exist_ok=False)
    table = sql.Identifier(name)
    events_path = target / EVENTS_FILE
    with events_path.open("wb") as raw:
        exported = _export(conn, table, raw)
        raw.flush()
        os.fsync(raw.fileno())
    summary = conn.execute(
        sql.SQL(
            "SELECT min(global_position), max(global_position), min(transaction_id)::text,"
            " max(transaction_id)::text, min(recorded_at), max(recorded_at) FROM {}"
        ).format(table)
    ).fetchone()
    assert summary is not None
    last_txid, last_position = _last_checkpoint(conn, table)
    manifest = {
        "format": FORMAT, "archiveId": archive_id, "partition": name,
        "bounds": {"from": bounds.lower, "to": bounds.upper},
        "positions": {"first": summary[0], "last": summary[1]},
        "transactionIds": {"first": summary[2], "last": summary[3]},
        "lastCheckpoint": {"txid": last_txid, "position": last_position},
        "recordedAt": {"first": summary[4].isoformat(), "last": summary[5].isoformat()},
        "events": exported.lines, "bytes": exported.raw_bytes,
        "rowsSha256": exported.rows_sha256,
        "files": {EVENTS_FILE: {"bytes": exported.file_bytes, "sha256": exported.file_sha256}},
    }  # fmt: skip
    _write_manifest(target, manifest)
    # Recorded first, then read back while the readers' caches learn of it (the wait costs
    # nothing then); nothing is detached before the archive proved whole.
    recorded = time.monotonic()
    with conn.transaction():
        conn.execute(
            "INSERT INTO log_archives (archive_id, partition_name, lower_bound, upper_bound,"
            " first_position, last_position, last_txid, event_count, location, manifest)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s::xid8, %s, %s, %s)",
            [archive_id, name, bounds.lower, bounds.upper, summary[0], last_position, last_txid,
             exported.lines, str(target), json.dumps(manifest)],
        )  # fmt: skip
        # A stream whose last event is in the partition keeps its head (its next append
        # continues the versions; a read of it knows what is missing).
        conn.execute(
            sql.SQL(
                "INSERT INTO archived_heads (stream_id, stream_version, archive_id)"
                " SELECT p.stream_id, max(p.stream_version), %s FROM {} p GROUP BY p.stream_id"
                " HAVING NOT EXISTS (SELECT 1 FROM events e WHERE e.stream_id = p.stream_id"
                "                       AND e.global_position >= %s)"
                " ON CONFLICT (stream_id) DO UPDATE SET stream_version = excluded.stream_version,"
                "     archive_id = excluded.archive_id"
                "  WHERE archived_heads.stream_version < excluded.stream_version"
            ).format(table),
            [archive_id, bounds.upper],
        )
    try:
        verify(target)
    except ArchiveError:
        with conn.transaction():  # the partition is still there: readable again
            conn.execute("DELETE FROM archived_heads WHERE archive_id = %s", [archive_id])
            conn.execute("DELETE FROM log_archives WHERE archive_id = %s", [archive_id])
        raise
    # Every store's cache holds the range now (eventstore/archive_ranges.py).
    time.sleep(max(0.0, GUARD_DELAY - (time.monotonic() - recorded)))
    _detach_and_drop(conn, name)
    return manifest


def _detach_and_drop(conn: Connection, name: str) -> None:
    """Detach without blocking appends and reads (CONCURRENTLY waits for the readers that may
    still see the partition), or finish a detach that was cut short; then drop it."""
    table = sql.Identifier(name)
    row = conn.execute(
        "SELECT i.inhdetachpending FROM pg_inherits i"
        " WHERE i.inhparent = 'events'::regclass AND i.inhrelid = to_regclass(%s)",
        [name],
    ).fetchone()
    if row is not None:
        how = "FINALIZE" if row[0] else "CONCURRENTLY"
        conn.execute(sql.SQL("ALTER TABLE events DETACH PARTITION {} " + how).format(table))
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


class _Exported(NamedTuple):
    lines: int
    raw_bytes: int
    rows_sha256: str
    file_bytes: int
    file_sha256: str


def _rows(conn: Connection, table: sql.Composable) -> Iterator[bytes]:
    """The table's rows in checkpoint order, rendered (see _COLUMNS), as COPY chunks."""
    query = sql.SQL(
        "COPY (SELECT row_to_json(r)::text FROM (SELECT {} FROM {}) r"
        " ORDER BY r.transaction_id, r.global_position) TO STDOUT {}"
    ).format(sql.SQL(_COLUMNS), table, sql.SQL(_RAW_CSV))
    with conn.cursor() as cur, cur.copy(query) as copy:
        for chunk in copy:
            yield bytes(chunk)


def _blocks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """COPY's chunks (one row each) joined into blocks of about ``_CHUNK`` bytes: compressing,
    hashing and handing over a block at a time costs a fraction of doing it row by row."""
    pending: list[bytes] = []
    size = 0
    for chunk in chunks:
        pending.append(chunk)
        size += len(chunk)
        if size >= _CHUNK:
            yield b"".join(pending)
            pending, size = [], 0
    if pending:
        yield b"".join(pending)


def _export(conn: Connection, table: sql.Composable, raw: IO[bytes]) -> _Exported:
    """Postgres renders the rows while this thread compresses the previous chunks: the COPY is
    read in a thread of its own (bounded queue), as ISA-L's gzip and sha256 run here without
    the GIL."""
    chunks: queue.Queue[bytes | BaseException | None] = queue.Queue(64)

    def produce() -> None:
        try:
            for block in _blocks(_rows(conn, table)):
                chunks.put(block)
            chunks.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            chunks.put(e)

    reader = bridge.start_thread(produce, "dispach-archive-export")
    file_sha, rows_sha = hashlib.sha256(), hashlib.sha256()
    compress = isal_zlib.compressobj(_GZIP_LEVEL, isal_zlib.DEFLATED, _GZIP_WBITS)
    lines = size = file_bytes = 0
    try:
        while (chunk := chunks.get()) is not None:
            if isinstance(chunk, BaseException):
                raise chunk
            rows_sha.update(chunk)
            lines += chunk.count(b"\n")
            size += len(chunk)
            out = compress.compress(chunk)
            file_sha.update(out)
            file_bytes += raw.write(out)
        out = compress.flush()
        file_sha.update(out)
        file_bytes += raw.write(out)
    finally:
        while reader.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                chunks.get(timeout=0.1)
        reader.join()
    return _Exported(lines, size, rows_sha.hexdigest(), file_bytes, file_sha.hexdigest())


def _last_checkpoint(conn: Connection, table: sql.Composable) -> tuple[str, int]:
    row = conn.execute(sql.SQL("SELECT transaction_id::text, global_position FROM {}"
                               " ORDER BY transaction_id DESC, global_position DESC LIMIT 1"
                               ).format(table)).fetchone()  # fmt: skip
    assert row is not None
    return str(row[0]), int(row[1])


def _write_manifest(target: Path, manifest: dict[str, Any]) -> None:
    path = target / MANIFEST_FILE
    with path.open("w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(where: Path) -> tuple[Path, dict[str, Any]]:
    """The archive directory and its manifest, from the directory or the manifest's path."""
    target = where.parent if where.name == MANIFEST_FILE else where
    try:
        manifest = json.loads((target / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ArchiveError(f"{target} holds no readable {MANIFEST_FILE}: {e}",
                           "pass the archive's directory or its manifest.json") from e  # fmt: skip
    if manifest.get("format") != FORMAT:
        raise ArchiveError(f"{target / MANIFEST_FILE} is not a {FORMAT} manifest",
                           "pass a directory `dispach log archive` wrote")  # fmt: skip
    return target, manifest


def verify(where: Path) -> dict[str, Any]:
    """Check an archive against its manifest: the file's size and sha256, and the sha256 and
    count of the lines it decompresses to. Returns the manifest."""
    target, manifest = read_manifest(where)
    expected = manifest["files"][EVENTS_FILE]
    file_sha, rows_sha = hashlib.sha256(), hashlib.sha256()
    size = lines = 0
    inflate = isal_zlib.decompressobj(_GZIP_WBITS)
    readable = True
    with _opened(target / EVENTS_FILE) as raw:  # one pass: the file and what it inflates to
        for block in iter(lambda: raw.read(_CHUNK), b""):
            file_sha.update(block)
            size += len(block)
            if readable:
                try:
                    out = inflate.decompress(block)
                except _INFLATE_ERROR:
                    readable = False  # damaged: the checksums below say so
                    continue
                rows_sha.update(out)
                lines += out.count(b"\n")
    if readable:
        out = inflate.flush()
        rows_sha.update(out)
        lines += out.count(b"\n")
    found = (size, file_sha.hexdigest(), rows_sha.hexdigest(), lines)
    wanted = (expected["bytes"], expected["sha256"], manifest["rowsSha256"], manifest["events"])
    if found != wanted:
        raise ArchiveError(
            f"archive {target} does not match its manifest (bytes, sha256, rows sha256, events: "
            f"{found} found, {wanted} expected)",
            "the archive is damaged; restore it from a copy",
        )
    return manifest


def _opened(path: Path) -> IO[bytes]:
    try:
        return path.open("rb")
    except OSError as e:
        raise ArchiveError(
            f"cannot read {path}: {e.strerror}",
            "pass the directory `dispach log archive` wrote, with its files",
        ) from e


class _Line(msgspec.Struct):
    """One archived row as :func:`_rows` rendered it; ``data`` and ``metadata`` kept as their
    exact text."""

    global_position: int
    stream_id: str
    stream_version: int
    event_id: str
    type: str
    data: msgspec.Raw
    metadata: msgspec.Raw
    recorded_at: str
    transaction_id: str


_DECODE_LINES = msgspec.json.Decoder(list[_Line])


def _lines(path: Path) -> Iterator[bytes]:
    """The archive's lines, decompressed, in blocks that end at a line's end."""
    rest = b""
    inflate = isal_zlib.decompressobj(_GZIP_WBITS)
    with _opened(path) as raw:
        while data := raw.read(_CHUNK):
            block = rest + inflate.decompress(data)
            cut = block.rfind(b"\n") + 1
            rest = block[cut:]
            if cut:
                yield block[:cut]
    rest += inflate.flush()
    if rest:
        yield rest


def _copy_rows(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """Archived lines as COPY text rows: decoded in bulk (one JSON array per block), ``data``
    and ``metadata`` passed through as they are (JSON holds no raw tab or newline; its
    backslashes are doubled for COPY)."""
    for block in blocks:
        rows = _DECODE_LINES.decode(b"[" + block.rstrip(b"\n").replace(b"\n", b",") + b"]")
        yield b"".join(
            b"%d\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n" % (
                r.global_position, _text(r.stream_id), r.stream_version, r.event_id.encode(),
                _text(r.type), bytes(r.data).replace(b"\\", b"\\\\"),
                bytes(r.metadata).replace(b"\\", b"\\\\"), r.recorded_at.encode(),
                r.transaction_id.encode(),
            )
            for r in rows
        )  # fmt: skip


def _text(value: str) -> bytes:
    """A text value in COPY's text format."""
    return (value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
            .replace("\r", "\\r").encode())  # fmt: skip


def restore(conn: Connection, where: Path) -> dict[str, Any]:
    """Load an archive back into the log as its partition again; returns the manifest."""
    manifest = verify(where)
    target, _ = read_manifest(where)
    name = manifest["partition"]
    if name in dict(ranges(conn)):
        raise ArchiveError(f"partition {name} is part of the log already",
                           "nothing to restore: its events are readable")  # fmt: skip
    table = sql.Identifier(name)
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))  # a restore cut short
    conn.execute(sql.SQL("CREATE TABLE {} (LIKE events INCLUDING CONSTRAINTS)").format(table))
    load = sql.SQL("COPY {} ({}) FROM STDIN").format(table, sql.SQL(_COLUMNS))
    with conn.transaction(), conn.cursor() as cur, cur.copy(load) as copy:
        for block in _copy_rows(_lines(target / EVENTS_FILE)):
            copy.write(block)
    rows_sha = hashlib.sha256()
    for block in _blocks(_rows(conn, table)):
        rows_sha.update(block)
    if rows_sha.hexdigest() != manifest["rowsSha256"]:
        conn.execute(sql.SQL("DROP TABLE {}").format(table))
        raise ArchiveError(
            f"the rows restored from {target} differ from the archived ones",
            "nothing was attached; this is a bug in Dispach (report it with the archive)",
        )
    create_local_indexes(conn, name)
    bounds = manifest["bounds"]
    lower = sql.SQL("MINVALUE") if bounds["from"] is None else sql.Literal(bounds["from"])
    with conn.transaction():
        conn.execute(sql.SQL("ALTER TABLE events ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})"
                             ).format(table, lower, sql.Literal(bounds["to"])))  # fmt: skip
        conn.execute("DELETE FROM archived_heads WHERE archive_id = %s", [manifest["archiveId"]])
        conn.execute("UPDATE log_archives SET restored_at = now() WHERE archive_id = %s",
                     [manifest["archiveId"]])  # fmt: skip
    return manifest
