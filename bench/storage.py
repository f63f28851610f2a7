"""Benchmark of storage: the bytes one turn leaves in the database, by table and by event type.

    .venv/bin/python bench/storage.py [--turns 40] [--save FILE] [--compare FILE] [--keep]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). The node works in its own schema ``bench_<hex>``.

An in-process ``runtime.node.Node`` serves one agent, ``storage``, with the offline scripted
model. Its script makes the reply a size the bench chooses, so that every copy of it shows:

  - plain: ``plain <n>`` is answered with a text of ``n`` characters, no tools (1 model call);
  - tool: ``tool <n>`` calls ``lookup`` (a tool of this module) that returns a line of ``n``
    characters; the model then reports it (2 model calls, a reply of about ``n`` characters).

For 400 and 4,000 characters each, ``--turns`` turns run (4 sessions at a time, 10 turns per
session, as history and per-session rows grow in real use); then plain 4,000-character turns
whose reply also goes to a webhook channel (tests/fakes/webhook_receiver.py, in this process),
measured once the outbox has sent it all. Between scenarios the bench measures:

  - by table (every table of the schema): the change of ``pg_total_relation_size`` (heap, TOAST,
    indexes, free and dead space: what the disk holds, in 8 kB pages) and of the live rows'
    ``pg_column_size(row)`` plus the 4-byte line pointer (what the rows themselves hold,
    compressed as stored, without indexes), per turn;
  - by event type: ``pg_column_size(data)``, ``pg_column_size(metadata)`` and the whole row, per
    turn;
  - where the reply's text is: the characters of every event field and projection column that
    holds it, per turn (1.00 copies: one whole copy), and what ``model.result`` would weigh
    without a ``text`` that repeats its content's text (stored again in a temporary table, so
    that the figure is compressed as the log's rows are).

The texts are prose-like (words drawn from a fixed vocabulary, seeded), so Postgres's compression
of values over ~2 kB works on them as on real replies. ``--save`` writes the figures as JSON;
``--compare`` reads such a file (a run of another checkout: copy this file into it) and prints
before, after and their ratio.
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import Ends, drop_schemas, node_settings, print_rows, run_loop, section, servers

# isort: split
import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg import sql

from actors.messages import Refused
from eventstore import EventStore
from eventstore.catalogue import Deliver, TurnEnd
from gateways.ingress import IngressMessage, request
from runtime.node import Node
from tests.fakes.webhook_receiver import WebhookReceiver

AGENT = "storage"
SIZES = (400, 4000)
SESSIONS = 4
SECRET = "bench-storage-webhook-secret-0123"
TURNS_PER_SESSION = 10
_VOCABULARY = (
    "the of and to in is that it for on with as was at by this be from are or an have not which "
    "one you had all were their there can more if will would about when so what some out other "
    "into time only new could these two may first then do any like now my over such our man even "
    "most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know while "
    "last might great old year off come since against go came right used take three himself few "
    "house use during without again place around however home small found thought went say part "
    "once general high upon school every does got united left number course war until always away "
    "something fact though water less public put think almost hand enough far took head yet "
    "government system better set told nothing night end why called eyes find going look asked "
    "later knew point next city business give group toward young let room president side social"
)
_WORDS = _VOCABULARY.split()


def prose(size: int, seed: int) -> str:
    """``size`` characters of word salad on one line: compressible as text, not as a repeat."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:size]


def lookup(args: dict[str, Any], ctx: object) -> str:
    """The tool of the tool turns: one line of ``size`` characters (the model reports the first
    line of a result, so the reply carries it all)."""
    return prose(int(args["size"]), 2)


def manifest(receiver_url: str) -> str:
    rules: list[dict[str, Any]] = [{"match": f"^plain {n}$", "reply": prose(n, 1)} for n in SIZES]
    rules.append({"match": r"^tool (\d+)$", "tool": "lookup", "input": {"size": "{1}"}})
    doc = {
        "id": AGENT,
        "name": "Storage benchmark agent",
        "model": {"provider": "scripted", "script": rules},
        "channels": [{"id": "hooks", "type": "webhook", "url": receiver_url}],
        "tools": [{
            "name": "lookup", "module": "storage:lookup", "description": "A text of a size.",
            "input_schema": {"type": "object", "properties": {"size": {"type": "string"}},
                             "required": ["size"]},
        }],
    }  # fmt: skip
    return json.dumps(doc)  # JSON is YAML


@dataclass(frozen=True)
class Scenario:
    kind: str
    size: int
    delivered: bool = False
    """The reply goes to the webhook channel too (an outbox item per chunk of it)."""

    @property
    def name(self) -> str:
        return f"{self.kind} {self.size}" + (" delivered" if self.delivered else "")


SCENARIOS = (
    *(Scenario(kind, n) for kind in ("plain", "tool") for n in SIZES),
    Scenario("plain", SIZES[-1], delivered=True),
)


# --- measuring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    disk: dict[str, int]
    """table -> pg_total_relation_size."""
    rows: dict[str, tuple[int, int]]
    """table -> (live rows, sum of pg_column_size(row) + line pointers)."""
    position: int
    """The log's last global position."""


_TABLES = """SELECT c.relname, coalesce((SELECT sum(pg_total_relation_size(p.relid))
                                            FROM pg_partition_tree(c.oid) p),
                                         pg_total_relation_size(c.oid))
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = %s AND c.relkind IN ('r', 'p') AND NOT c.relispartition
              ORDER BY c.relname"""
"""Every table, a partitioned one (the log) as one: its size summed over its partitions."""
_ROWS = "SELECT count(*), coalesce(sum(pg_column_size(t.*) + 4), 0) FROM {} t"
_BY_TYPE = """SELECT type, count(*), sum(pg_column_size(data)), sum(pg_column_size(metadata)),
                     sum(pg_column_size(e.*) + 4)
                FROM events e WHERE global_position > %s AND global_position <= %s
               GROUP BY type"""


def measure(conn: psycopg.Connection[Any], schema: str) -> Sizes:
    disk = {str(r[0]): int(r[1] or 0) for r in conn.execute(_TABLES, [schema])}
    rows: dict[str, tuple[int, int]] = {}
    for table in disk:
        count = conn.execute(sql.SQL(_ROWS).format(sql.Identifier(schema, table))).fetchone()
        rows[table] = (int(count[0]), int(count[1])) if count else (0, 0)
    head = conn.execute(
        sql.SQL("SELECT coalesce(max(global_position), 0) FROM {}").format(
            sql.Identifier(schema, "events"))).fetchone()  # fmt: skip
    return Sizes(disk, rows, int(head[0]) if head else 0)


def by_type(conn: psycopg.Connection[Any], after: int, through: int) -> dict[str, list[int]]:
    """type -> [events, data bytes, metadata bytes, row bytes] appended in (after, through]."""
    found = conn.execute(_BY_TYPE, [after, through]).fetchall()
    return {str(r[0]): [int(r[1]), int(r[2]), int(r[3]), int(r[4])] for r in found}


# Where the reply's text is: the characters of each place that holds it (or, for a tool turn, the
# tool's output it reports), over the events appended in (after, through] and the rows of their
# turns. ``text_of(blocks)`` is the text of content blocks, as the turn runner joins it.
_TEXT_OF = """(SELECT coalesce(string_agg(b->>'text', '' ORDER BY i), '')
                 FROM jsonb_array_elements(CASE jsonb_typeof({0}) WHEN 'array' THEN {0}
                                                ELSE jsonb_build_array({0}) END)
                      WITH ORDINALITY AS x(b, i)
                WHERE b->>'type' = 'text')"""
_EVENTS = "FROM events WHERE global_position > %(after)s AND global_position <= %(through)s"
_TURNS = f"SELECT metadata->>'turnId' {_EVENTS} AND type = 'turn.start'"
_COPIES = {
    "model.chunk delta (kind text)": f"SELECT sum(octet_length(data->>'delta')) {_EVENTS}"
    " AND type = 'model.chunk' AND data->>'kind' = 'text'",
    "model.result text": f"SELECT sum(octet_length(data->>'text')) {_EVENTS}"
    " AND type = 'model.result'",
    "model.result content (private)": "SELECT sum(octet_length("
    + _TEXT_OF.format("data->'content'")
    + f")) {_EVENTS} AND type = 'model.result'",
    "tool.result output (private)": f"SELECT sum(octet_length(data->>'output')) {_EVENTS}"
    " AND type = 'tool.result'",
    "delivery.enqueued text": f"SELECT sum(octet_length(data->>'text')) {_EVENTS}"
    " AND type = 'delivery.enqueued'",
    "turn.end text": f"SELECT sum(octet_length(data->>'text')) {_EVENTS} AND type = 'turn.end'",
    "turns.text": f"SELECT sum(octet_length(text)) FROM turns WHERE turn_id IN ({_TURNS})",
    "messages (assistant rows)": "SELECT sum(octet_length("
    + _TEXT_OF.format("content")
    + f")) FROM messages WHERE role = 'assistant' AND turn_id IN ({_TURNS})",
    "messages (tool rows)": "SELECT sum(octet_length(content->>'content')) FROM messages"
    f" WHERE role = 'tool' AND turn_id IN ({_TURNS})",
    "outbox.body": f"SELECT sum(octet_length(body)) FROM outbox WHERE turn_id IN ({_TURNS})",
}
# What model.result would weigh without a ``text`` equal to its content's text (the turn runner
# writes it so): the events' data stored again without it, in a temporary table, so that Postgres
# compresses and toasts the values as it does in the log (a computed value is measured
# uncompressed).
_WITHOUT_TEXT = (
    "CREATE TEMPORARY TABLE without_text AS SELECT pg_column_size(data) AS stored,"
    " CASE WHEN data->>'text' = "
    + _TEXT_OF.format("coalesce(data->'content', '[]')")
    + " THEN data - 'text' ELSE data END AS data"
    f" {_EVENTS} AND type = 'model.result'"
)
_SAVED = "SELECT coalesce(sum(stored - pg_column_size(data)), 0) FROM without_text"
SAVED = "(model.result without text: saves, bytes)"


def copies(conn: psycopg.Connection[Any], after: int, through: int) -> dict[str, int]:
    """place -> characters of the reply (or the tool output) it holds, in all; and ``SAVED``."""
    params = {"after": after, "through": through}
    found = {}
    for place, query in _COPIES.items():
        row = conn.execute(query, params).fetchone()
        found[place] = int(row[0] or 0) if row else 0
    conn.execute(_WITHOUT_TEXT, params)
    try:
        row = conn.execute(_SAVED).fetchone()
        found[SAVED] = int(row[0]) if row else 0
    finally:
        conn.execute("DROP TABLE without_text")
    return found


@dataclass(frozen=True)
class Figures:
    """Per turn, for one scenario."""

    turns: int
    disk: dict[str, float]
    rows: dict[str, float]
    """table -> bytes of the live rows it gained, per turn."""
    row_counts: dict[str, float]
    types: dict[str, list[float]]
    """type -> [events, data, metadata, row] per turn."""
    copies: dict[str, float]
    """place -> characters of the reply it holds, per turn (and ``SAVED``, in bytes)."""

    def to_json(self) -> dict[str, Any]:
        return {"turns": self.turns, "disk": self.disk, "rows": self.rows,
                "row_counts": self.row_counts, "types": self.types,
                "copies": self.copies}  # fmt: skip

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Figures:
        return Figures(doc["turns"], doc["disk"], doc["rows"], doc["row_counts"], doc["types"],
                       doc.get("copies", {}))  # fmt: skip


def figures(
    before: Sizes, after: Sizes, types: dict[str, list[int]], found: dict[str, int], turns: int
) -> Figures:
    tables = sorted(set(before.disk) | set(after.disk))
    return Figures(
        turns,
        {t: (after.disk.get(t, 0) - before.disk.get(t, 0)) / turns for t in tables},
        {t: (after.rows.get(t, (0, 0))[1] - before.rows.get(t, (0, 0))[1]) / turns
         for t in tables},
        {t: (after.rows.get(t, (0, 0))[0] - before.rows.get(t, (0, 0))[0]) / turns
         for t in tables},
        {k: [v / turns for v in values] for k, values in types.items()},
        {k: v / turns for k, v in found.items()},
    )  # fmt: skip


# --- running turns -------------------------------------------------------------------------------


async def watch(store: EventStore, ends: Ends) -> None:
    head = await asyncio.to_thread(store.head)
    async for event in store.subscribe(head, types=("turn.end",)):
        if event.metadata.turn_id is not None and isinstance(event.data, TurnEnd):
            ends.seen(event.metadata.turn_id, event.data)


async def run_scenario(node: Node, ends: Ends, scenario: Scenario, turns: int, tag: str) -> None:
    """``turns`` turns of the scenario, ``SESSIONS`` sessions at a time, each turn awaited."""
    assert node.nc is not None
    nc = node.nc
    text = f"{scenario.kind} {scenario.size}"

    async def session_worker(index: int) -> None:
        for n in range(index, turns, SESSIONS):
            key = f"storage:{tag}:{scenario.kind}{scenario.size}:{index}:{n // TURNS_PER_SESSION}"
            deliver = Deliver(channel="hooks", to="bench") if scenario.delivered else None
            sent = IngressMessage(text=text, session_key=key, deliver=deliver)
            result = await request(nc, AGENT, sent)
            match result:
                case Refused(code=code, message=message):
                    raise RuntimeError(f"the node refused a bench message: {code}: {message}")
            seen = await ends.wait(result.turn_id, 60.0)
            if seen.end.reason != "final":
                raise RuntimeError(f"a bench turn ended {seen.end.reason}: {seen.end.error}")

    await asyncio.gather(*(session_worker(i) for i in range(SESSIONS)))


def settle(conn: psycopg.Connection[Any]) -> None:
    """Wait until the outbox has sent every item (its rows, and their events, are the turn's)."""
    deadline = time.monotonic() + 60
    while (found := conn.execute(_UNSETTLED).fetchone()) and found[0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{found[0]} outbox items still unsent after 60 s")
        time.sleep(0.05)


_UNSETTLED = "SELECT count(*) FROM outbox WHERE status IN ('pending', 'inflight')"


async def bench(url: str, nats_url: str, turns: int, keep: bool) -> dict[str, Figures]:
    schema = f"bench_{secrets.token_hex(4)}"
    receiver = WebhookReceiver(SECRET)
    receiver.start()
    # The node reads channel secrets from the process's environment (this process's own).
    os.environ["DISPACH_WEBHOOK_SECRET"] = SECRET
    settings, root = node_settings(url, nats_url, schema, AGENT, manifest(receiver.url))
    node = Node(settings)
    results: dict[str, Figures] = {}
    watcher: asyncio.Task[None] | None = None
    conn: psycopg.Connection[Any] = await asyncio.to_thread(psycopg.connect, url, autocommit=True)
    try:
        await node.start()
        assert node.store is not None
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        print(f"schema: {schema}  turns per scenario: {turns}")
        ends = Ends()
        watcher = asyncio.create_task(watch(node.store, ends), name="bench-ends")
        # Turns before any measurement: the first writes create rows once per node or agent.
        await run_scenario(node, ends, Scenario("plain", SIZES[0]), SESSIONS, "warm")
        for scenario in SCENARIOS:
            before = await asyncio.to_thread(measure, conn, schema)
            await run_scenario(node, ends, scenario, turns, "run")
            await asyncio.to_thread(settle, conn)
            after = await asyncio.to_thread(measure, conn, schema)
            types = await asyncio.to_thread(by_type, conn, before.position, after.position)
            found = await asyncio.to_thread(copies, conn, before.position, after.position)
            results[scenario.name] = figures(before, after, types, found, turns)
            print(f"{scenario.name}: {turns} turns, {after.position - before.position} events")
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await node.stop()
        receiver.stop()
        conn.close()
        if not keep:
            await asyncio.to_thread(drop_schemas, url, (schema,))
        shutil.rmtree(root, ignore_errors=True)
    return results


# --- reporting -----------------------------------------------------------------------------------


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(after: float, before: float | None) -> str:
    return "-" if not before else f"{after / before:.2f}x"


def print_tables(name: str, ours: Figures, base: Figures | None) -> None:
    section(f"{name}: bytes per turn by table")
    rows: list[tuple[str, ...]] = []
    for table in sorted(ours.disk, key=lambda t: -ours.rows[t]):
        if not (ours.rows[table] or ours.disk[table] or (base and base.rows.get(table))):
            continue
        was = base.rows.get(table) if base else None
        rows.append((table, f"{ours.row_counts[table]:.2f}", _bytes(ours.rows[table]), _bytes(was),
                     _ratio(ours.rows[table], was), _bytes(ours.disk[table]),
                     _bytes(base.disk.get(table) if base else None)))  # fmt: skip
    total, was_total = sum(ours.rows.values()), sum(base.rows.values()) if base else None
    disk, was_disk = sum(ours.disk.values()), sum(base.disk.values()) if base else None
    rows.append(("(all tables)", "", _bytes(total), _bytes(was_total), _ratio(total, was_total),
                 _bytes(disk), _bytes(was_disk)))  # fmt: skip
    print_rows(("table", "rows/turn", "row bytes", "before", "ratio", "disk Δ", "disk before"),
               rows, {1, 2, 3, 4, 5, 6})  # fmt: skip

    section(f"{name}: bytes per turn by event type (events table)")
    rows = []
    for kind in sorted(ours.types, key=lambda k: -ours.types[k][3]):
        count, data, meta, row = ours.types[kind]
        old = base.types.get(kind) if base else None
        was_row = old[3] if old else None
        rows.append((kind, f"{count:.2f}", _bytes(data), _bytes(meta), _bytes(row),
                     _bytes(was_row), _ratio(row, was_row)))  # fmt: skip
    total = sum(v[3] for v in ours.types.values())
    was_sum = sum(v[3] for v in base.types.values()) if base else None
    rows.append(("(all types)", f"{sum(v[0] for v in ours.types.values()):.2f}", "", "",
                 _bytes(total), _bytes(was_sum), _ratio(total, was_sum)))  # fmt: skip
    print_rows(("type", "events/turn", "data", "metadata", "row", "before", "ratio"),
               rows, {1, 2, 3, 4, 5, 6})  # fmt: skip


def print_copies(name: str, ours: Figures, base: Figures | None) -> None:
    reply = ours.copies.get("turn.end text") or 1.0
    section(f"{name}: where the reply's text is (characters per turn; the reply: {reply:,.0f})")
    rows = [(place, _bytes(chars), _bytes(base.copies.get(place) if base else None),
             "-" if place == SAVED else f"{chars / reply:.2f}")
            for place, chars in ours.copies.items()]  # fmt: skip
    print_rows(("place", "chars/turn", "before", "copies"), rows, {1, 2, 3})


def print_summary(ours: dict[str, Figures], base: dict[str, Figures] | None) -> None:
    section("summary: bytes per turn (live rows, all tables; events table alone)")
    rows = []
    for name, f in ours.items():
        b = base.get(name) if base else None
        total, events = sum(f.rows.values()), f.rows.get("events", 0.0)
        was_total = sum(b.rows.values()) if b else None
        was_events = b.rows.get("events") if b else None
        rows.append((name, _bytes(total), _bytes(was_total), _ratio(total, was_total),
                     _bytes(events), _bytes(was_events), _ratio(events, was_events),
                     _bytes(sum(f.disk.values()))))  # fmt: skip
    print_rows(("scenario", "all rows", "before", "ratio", "events", "before", "ratio",
                "disk Δ"), rows, {1, 2, 3, 4, 5, 6, 7})  # fmt: skip

    section("summary: rows per turn (live rows gained, all tables) and events per turn")
    rows = []
    for name, f in ours.items():
        b = base.get(name) if base else None
        count, was = sum(f.row_counts.values()), sum(b.row_counts.values()) if b else None
        events = f.row_counts.get("events", 0.0)
        was_events = b.row_counts.get("events") if b else None
        rows.append((name, f"{count:.2f}", "-" if was is None else f"{was:.2f}",
                     _ratio(count, was), f"{events:.2f}",
                     "-" if was_events is None else f"{was_events:.2f}",
                     _ratio(events, was_events)))  # fmt: skip
    print_rows(("scenario", "rows", "before", "ratio", "events", "before", "ratio"), rows,
               {1, 2, 3, 4, 5, 6})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--turns", type=int, default=40, help="turns per scenario")
    parser.add_argument("--save", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--compare", type=Path, help="figures of another run (--save) to compare")
    parser.add_argument("--keep", action="store_true", help="keep the bench schema afterwards")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with servers() as found:
        ours = run_loop(bench(found.database_url, found.nats_url, args.turns, args.keep))
    base: dict[str, Figures] | None = None
    if args.compare is not None:
        doc = json.loads(args.compare.read_text())
        base = {name: Figures.from_json(f) for name, f in doc.items()}
    for scenario in SCENARIOS:
        f, b = ours[scenario.name], base.get(scenario.name) if base else None
        print_tables(scenario.name, f, b)
        print_copies(scenario.name, f, b)
    print_summary(ours, base)
    if args.save is not None:
        args.save.write_text(json.dumps({n: f.to_json() for n, f in ours.items()}, indent=1))
        print(f"\nfigures written to {args.save}")


if __name__ == "__main__":
    main()
