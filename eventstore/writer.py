"""The group-commit writer: appends from every caller of a node share transactions.

One thread owns one connection. It takes what is queued *now* (never waiting on a timer to fill a
batch: DESIGN.md 7), decides every command against the heads it reads, inserts all accepted events
with one statement, runs the inline projections, and commits. What arrives during that commit
forms the next batch. A batch never holds two commands for one stream, so each command is decided
against the committed head; a conflicting command fails alone and its neighbours commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import msgspec
import psycopg
import structlog
from psycopg import errors as pgerrors

from eventstore import bridge
from eventstore._sql import connect_kwargs, decode_row, load
from eventstore.decision import (
    AppendResult,
    Command,
    carry_of,
    chain,
    continues,
    decide,
    fenced_partitions,
)
from eventstore.envelope import NewEvent, RecordedEvent
from eventstore.errors import (
    Fenced,
    InvalidValue,
    StoreClosed,
    StoreError,
    StoreOverloaded,
    StoreUnavailable,
)
from eventstore.event import encode_data, type_name
from eventstore.fencing import Fence, OnFenced
from eventstore.health import PostgresHealth
from eventstore.metrics import (
    APPEND_ERROR,
    APPEND_OK,
    BATCH_COMMANDS,
    EVENTS_APPENDED,
    FENCE_REFUSALS,
)
from eventstore.partitions import Partitioning, ensure, needs_more
from eventstore.projector import Projection, run_statements, statements_for

log = structlog.get_logger("dispach.writer")

_JSON = msgspec.json.Encoder()
_RETRIES = 5
_RECONNECT_DEADLINE_S = 30.0


_STOP = object()
_running_loop = asyncio.events._get_running_loop


class _Row(msgspec.Struct):
    """One event of a batch as the append statement reads it (sql/append.sql)."""

    stream_id: str
    expected: int
    ord: int
    event_id: uuid.UUID
    type: str
    data: msgspec.Raw
    metadata: msgspec.Raw
    part: int | None
    epoch: int | None


OnCommit = Callable[[Sequence[RecordedEvent]], None]
Sync = Callable[[], None]
"""Ends a statement whose rows the writer reads in the middle of its transaction: the pipeline's
``sync`` there. psycopg would otherwise ask for the rows with a flush request, and a session
between a flush and the next statement is ``active`` to Postgres, where
``idle_in_transaction_session_timeout`` does not reach it: a node stopped there (SIGSTOP, a
frozen VM) kept its locks, its partitions' fence rows among them, until it ran again, and no
other node could raise the fences to take its partitions over. After a Sync it waits ``idle in
transaction`` and Postgres ends it after ``IDLE_IN_TRANSACTION_TIMEOUT`` (eventstore/_sql.py);
its node then finds the connection gone, and the fence refuses its retry. The same round trip
either way."""


def _unpipelined() -> None:
    """Outside a pipeline every statement is answered whole: nothing to end."""


class GroupCommitWriter:
    def __init__(
        self,
        conninfo: str,
        schema: str,
        *,
        inline: Sequence[Projection] = (),
        on_commit: OnCommit | None = None,
        queue_size: int = 10_000,
        max_batch: int = 512,
        health: PostgresHealth | None = None,
        on_fenced: OnFenced | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._health = health
        """Told when a reconnection fails (Postgres is down) and when a batch commits (up)."""
        self._schema = schema
        self._inline = tuple(inline)
        self._inline_types = frozenset(t for p in self._inline for t in p.types)
        self._backlog: deque[Command] = deque()  # decided later, ahead of the queue
        self._on_commit = on_commit
        self._on_fenced = on_fenced
        self._queue: queue.Queue[Command | object] = queue.Queue(queue_size)
        self._capacity = queue_size
        self._max_batch = max_batch
        self._conn: psycopg.Connection[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: bridge.Thread | None = None
        self._closed = False
        self._partitions: tuple[int, Partitioning] | None = None
        """The log's last partition bound and how it is cut, as this writer last made sure of
        (eventstore/partitions.py); None until it could."""
        self.batches = 0
        self.commands = 0

    def start(self) -> None:
        self._conn = self._connect()
        self._ensure_partitions(0)
        self._thread = bridge.start_thread(self._run, "dispach-writer")

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer the appends submitted on ``loop`` there, and call ``on_commit`` there: each
        batch crosses from the writer's thread to the loop once, whatever its size, instead of
        once per caller (DESIGN.md 5: one hop per writer batch, not per command)."""
        self._loop = loop

    def submit(
        self,
        stream: str,
        events: Sequence[NewEvent],
        expected: int,
        fence: Fence | None = None,
        *,
        blocking: bool = False,
    ) -> Future[AppendResult]:
        """Queue an append. ``blocking``: the caller will wait on the future in its own thread,
        so it is answered in the writer's thread even when that thread runs the store's loop
        (answered on the loop, a loop blocked on it would wait for itself)."""
        if self._closed:
            raise StoreClosed
        on_loop = not blocking and self._loop is not None and _running_loop() is self._loop
        command = Command(stream, events, expected, fence=fence, on_loop=on_loop)
        # Timed by the future itself, so every way an append is answered (settled, failed,
        # refused at stop) is observed once, in the thread that answers it.
        command.future.add_done_callback(partial(_observe_append, time.perf_counter()))
        try:
            self._queue.put_nowait(command)
        except queue.Full:
            raise StoreOverloaded(self._queue.qsize(), self._capacity) from None
        return command.future

    def stop(self, timeout: float = 10.0) -> None:
        """Commit what is queued, then stop. Appends submitted afterwards fail with StoreClosed."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP, timeout=timeout)
            self._thread.join(timeout)
        if self._conn is not None:
            self._conn.close()

    # --- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not (stopping and not self._backlog):
            batch, stopping = self._next_batch(stopping)
            if not batch:
                continue
            try:
                self._commit(batch)
            except Exception as e:
                # A bug, not a database answer: fail this batch, keep the writer alive.
                log.exception("writer_batch_failed")
                self._rollback()
                self._fail(batch, _internal(e))
        self._refuse_leftovers()

    def _next_batch(self, stopping: bool) -> tuple[list[Command], bool]:
        """What is queued now, at most one command per stream. A stream's next command that
        continues the one already in the batch (it expects the version that one leaves) is
        chained onto it: one command, one commit, instead of a commit each (a turn's appends
        queue behind each other while a commit is in flight). Any other second command of a
        stream waits in ``backlog``, in order. Blocks only while nothing at all is queued."""
        batch: list[Command] = []
        in_batch: dict[str, int] = {}
        carry: list[Command] = []
        while len(batch) < self._max_batch:
            item: Command | object
            if self._backlog:
                item = self._backlog.popleft()
            elif batch or stopping:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            else:
                item = self._queue.get()
            if item is _STOP:
                stopping = True
            elif isinstance(item, Command):
                at = in_batch.get(item.stream)
                if at is None and not any(c.stream == item.stream for c in carry):
                    in_batch[item.stream] = len(batch)
                    batch.append(item)
                elif (
                    at is not None
                    and not carry_of(carry, item.stream)
                    and continues(batch[at], item)
                ):
                    batch[at] = chain(batch[at], item)
                else:
                    carry.append(item)
        self._backlog.extendleft(reversed(carry))
        return batch, stopping

    def _refuse_leftovers(self) -> None:
        """Appends that raced with stop() and landed behind the stop marker are refused, not
        dropped: their callers get StoreClosed."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Command):
                self._answer([(item, StoreClosed())])

    def _commit(self, batch: list[Command]) -> None:
        deadline = time.monotonic() + _RECONNECT_DEADLINE_S
        attempt = 0
        careful = False
        while True:
            attempt += 1
            try:
                outcomes, committed, again = self._try(batch, careful=careful)
                break
            except pgerrors.UniqueViolation:
                # Another transaction appended to one of our streams after we read its head, or
                # an event id is already stored (a retried append): decide again, looking first.
                self._rollback()
                careful = True
                if attempt < _RETRIES:
                    continue
                return self._isolate(batch)
            except psycopg.OperationalError as e:
                # The connection broke, maybe after COMMIT reached the server. Retrying is safe:
                # stored event ids come back as duplicates with their original positions.
                if time.monotonic() > deadline:
                    return self._fail(batch, _unavailable(e))
                log.warning("writer_reconnect", error=str(e), attempt=attempt)
                time.sleep(min(0.05 * attempt, 1.0))
                self._reconnect()
            except Exception as e:  # noqa: BLE001 - every failure is reported to its caller
                self._rollback()
                if _no_partition(e) and attempt < _RETRIES:
                    # Positions ran past the last partition (another node's burst used the
                    # margin up): create the partitions, then insert again.
                    self._ensure_partitions(sum(len(c.events) for c in batch))
                    continue
                # Postgres refused something, or a projection has a bug: find the one command
                # that causes it by committing each alone; the others must not pay for it.
                if len(batch) == 1:
                    return self._fail(batch, _refused(e, batch[0]))
                return self._isolate(batch)
        # A command that became acceptable while the batch was decided goes first in the next.
        self._backlog.extendleft(reversed(again))
        self._settle([c for c in batch if c in outcomes], outcomes, committed)
        if committed:
            self._grow(max(e.position for e in committed) + 1)
        return None

    def _grow(self, next_position: int) -> None:
        """Make the partitions ahead of the log once its positions near the last one (no round
        trip until then): after a batch is answered, so its callers do not wait for it."""
        known = self._partitions
        if known is None or needs_more(known[0], next_position, known[1]):
            self._ensure_partitions(0)

    def _ensure_partitions(self, pending: int) -> None:
        """Create the partitions the log needs (eventstore/partitions.py). A failure is logged
        and tried again later: an insert that finds no partition comes back here first."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        try:
            self._partitions = ensure(conn, self._schema, pending)
        except psycopg.Error as e:
            self._rollback()
            log.warning("writer_partitions_failed", error=str(e))

    def _settle(
        self,
        batch: list[Command],
        outcomes: dict[Command, AppendResult | StoreError],
        committed: list[RecordedEvent],
    ) -> None:
        # Counted before the callers wake, so a caller that saw its append sees it counted.
        callers = sum(len(command.links or (command,)) for command in batch)  # chains count each
        BATCH_COMMANDS.observe(callers)
        EVENTS_APPENDED.inc(len(committed))
        fenced = [c for c in batch if isinstance(outcomes[c], Fenced)]
        if fenced:
            self._fenced(fenced)
        self.batches += 1
        self.commands += callers
        if self._health is not None:
            self._health.observe(True)
        self._answer([(command, outcomes[command]) for command in batch], committed)

    def _answer(
        self,
        answers: list[tuple[Command, AppendResult | StoreError]],
        committed: Sequence[RecordedEvent] = (),
    ) -> None:
        """Answer the callers, then tell ``on_commit``. The answers of callers on the store's
        loop and ``on_commit`` go to the loop together, in one hand-over; the others are
        answered here. A closed loop has nobody left to wake or tell: its callers are answered
        here and ``on_commit`` is not called."""
        loop = self._loop
        there = [a for a in answers if a[0].on_loop] if loop is not None else []
        here = [a for a in answers if not a[0].on_loop] if there else answers
        for command, outcome in here:
            _resolve(command, outcome)
        notify = committed if self._on_commit is not None else ()
        if loop is not None and (there or notify):
            if not bridge.deliver(loop, self._delivered, there, notify):  # the loop is closed
                for command, outcome in there:
                    _resolve(command, outcome)
            return
        if notify:
            self._committed(notify)

    def _delivered(
        self,
        answers: list[tuple[Command, AppendResult | StoreError]],
        committed: Sequence[RecordedEvent],
    ) -> None:
        """On the loop: one batch's answers, then its commit notice."""
        for command, outcome in answers:
            _resolve(command, outcome)
        if committed:
            self._committed(committed)

    def _committed(self, committed: Sequence[RecordedEvent]) -> None:
        assert self._on_commit is not None
        try:
            self._on_commit(committed)
        except Exception:
            log.exception("on_commit_failed")

    def _fenced(self, commands: list[Command]) -> None:
        """Count the fence's refusals and tell the node each partition it lost, before the
        callers wake: a caller that retries at once finds the node already told."""
        FENCE_REFUSALS.inc(sum(len(command.links or (command,)) for command in commands))
        if self._on_fenced is None:
            return
        for partition in sorted({c.fence.partition for c in commands if c.fence is not None}):
            try:
                self._on_fenced(partition)
            except Exception:
                log.exception("on_fenced_failed", partition=partition)

    def _isolate(self, batch: list[Command]) -> None:
        """Commit each command alone, so one bad command fails by itself."""
        for command in batch:
            self._commit([command])

    def _try(
        self, batch: list[Command], *, careful: bool
    ) -> tuple[dict[Command, AppendResult | StoreError], list[RecordedEvent], list[Command]]:
        """One attempt at a batch: ``(outcomes, committed events, commands to retry)``.

        The connection is in autocommit mode. Without inline projection work the insert is the
        whole transaction: one round trip. With it, one pipeline carries BEGIN with the insert,
        then the projection statements with the COMMIT: two round trips.
        """
        conn = self._conn
        assert conn is not None
        in_transaction = any(
            type_name(e.event) in self._inline_types for c in batch for e in c.events
        )
        with conn.cursor() as cur:
            if not in_transaction:
                return self._decide_and_insert(cur, batch, careful=careful, sync=_unpipelined)
            with conn.pipeline() as pipeline:
                cur.execute(b"BEGIN")
                outcomes, committed, again = self._decide_and_insert(
                    cur, batch, careful=careful, sync=pipeline.sync
                )
                run_statements(cur, statements_for(self._inline, committed))
                cur.execute(b"COMMIT")
        return outcomes, committed, again

    def _decide_and_insert(
        self, cur: psycopg.Cursor[Any], batch: list[Command], *, careful: bool, sync: Sync
    ) -> tuple[dict[Command, AppendResult | StoreError], list[RecordedEvent], list[Command]]:
        """Insert what the batch may append; ``sync`` ends each statement whose rows are read
        inside the transaction (see :data:`Sync`)."""
        outcomes: dict[Command, AppendResult | StoreError] = {}
        again: list[Command] = []
        committed: list[RecordedEvent] = []
        if careful:
            outcomes, _ = self._explain(cur, batch, careful=True, sync=sync)
        todo = [c for c in batch if c not in outcomes]
        stored = self._insert(cur, todo, sync) if todo else {}
        refused = [c for c in todo if c.events[0].event_id not in stored]
        if refused:
            explained, again = self._explain(cur, refused, careful=False, sync=sync)
            outcomes.update(explained)
        for command in todo:
            if command in outcomes or command in again:
                continue
            recorded = [
                _recorded(command.stream, new, stored[new.event_id]) for new in command.events
            ]
            outcomes[command] = AppendResult(command.stream, recorded)
            committed.extend(recorded)
        return outcomes, committed, again

    def _insert(
        self, cur: psycopg.Cursor[Any], commands: list[Command], sync: Sync
    ) -> dict[uuid.UUID, Any]:
        rows = [
            _Row(command.stream, command.expected, order, new.event_id, type_name(new.event),
                 msgspec.Raw(encode_data(new.event)), msgspec.Raw(_JSON.encode(new.metadata)),
                 None if fence is None else fence.partition,
                 None if fence is None else fence.epoch)
            for command in commands
            for fence in (command.fence,)
            for order, new in enumerate(command.events)
        ]  # fmt: skip
        cur.execute(
            load("append").encode(),
            {"rows": _JSON.encode(rows).decode(), "parts": fenced_partitions(commands)},
        )
        sync()
        return {row[0]: row[1:] for row in cur.fetchall()}

    def _explain(
        self, cur: psycopg.Cursor[Any], commands: list[Command], *, careful: bool, sync: Sync
    ) -> tuple[dict[Command, AppendResult | StoreError], list[Command]]:
        """Decide commands from the stored heads, ids and fences: a retry of stored events is
        answered with the originals, an epoch older than its partition's fence is refused, a
        stale expected version is a conflict. Returns those decisions and the commands that are
        acceptable now: when ``careful`` they are inserted next; otherwise the stream moved
        between the insert and this read, and they are simply retried. Fences only rise, so a
        command the insert refused for its epoch is refused here too."""
        cur.execute(load("heads").encode(), {"streams": [c.stream for c in commands]})
        sync()
        heads = {stream: (-1 if head is None else head) for stream, head in cur.fetchall()}
        cur.execute(
            load("existing").encode(), {"ids": [e.event_id for c in commands for e in c.events]}
        )
        sync()
        existing = {row[4]: decode_row(row) for row in cur.fetchall()}
        parts = fenced_partitions(commands)
        fences: dict[int, int] = {}
        if parts:  # unfenced commands spare the round trip
            cur.execute(load("fences").encode(), {"parts": parts})
            sync()
            fences = {partition: epoch for partition, epoch in cur.fetchall()}
        decided: dict[Command, AppendResult | StoreError] = {}
        acceptable: list[Command] = []
        for command in commands:
            fence_epoch = None if command.fence is None else fences.get(command.fence.partition)
            outcome = decide(command, heads[command.stream], existing, fence_epoch)
            if isinstance(outcome, int):
                acceptable.append(command)
            else:
                decided[command] = outcome
        return decided, acceptable

    def _fail(self, batch: list[Command], error: StoreError) -> None:
        self._answer([(command, error) for command in batch])

    def _connect(self) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True, **connect_kwargs(self._schema))
        except psycopg.OperationalError as e:
            raise _unavailable(e) from e
        # The batch statements have the same shape every time: plan them once (planning
        # otherwise costs more than executing a small batch).
        conn.execute(b"SET plan_cache_mode = force_generic_plan")
        return conn

    def _reconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
        try:
            self._conn = self._connect()
        except StoreUnavailable as e:
            log.warning("writer_reconnect_failed", error=e.message)
            if self._health is not None:
                self._health.observe(False, e.message)

    def _rollback(self) -> None:
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(psycopg.Error):
                self._conn.rollback()


def _resolve(command: Command, outcome: AppendResult | StoreError) -> None:
    if command.future.done():
        return  # the caller gave up waiting (e.g. a cancelled turn); a commit stays stored
    if isinstance(outcome, StoreError):
        command.future.set_exception(outcome)
    else:
        command.future.set_result(outcome)


def _observe_append(submitted: float, future: Future[AppendResult]) -> None:
    if future.cancelled():
        return  # the caller stopped waiting: there is no answer to time
    elapsed = time.perf_counter() - submitted
    (APPEND_OK if future.exception() is None else APPEND_ERROR).observe(elapsed)


def _no_partition(e: Exception) -> bool:
    """Postgres found no partition of the log for a row's position."""
    return isinstance(e, pgerrors.CheckViolation) and "no partition" in (
        e.diag.message_primary or ""
    )


def _unavailable(e: psycopg.Error) -> StoreUnavailable:
    return StoreUnavailable(
        f"cannot write to Postgres: {e}".strip(),
        "the append was not acknowledged; retry it with the same event ids (retries are "
        "idempotent)",
    )


def _recorded(stream: str, new: NewEvent, stored: tuple[Any, ...]) -> RecordedEvent:
    position, version, txid, at = stored
    return RecordedEvent(
        stream, version, position, int(txid), new.event_id, type_name(new.event), new.event,
        new.metadata, at,
    )  # fmt: skip


def _internal(e: Exception) -> StoreError:
    return StoreError(
        f"the writer failed on this batch: {type(e).__name__}: {e}",
        "this is a bug in Dispach; the batch was not committed and the node's log has the trace",
    )


def _refused(e: Exception, command: Command) -> StoreError:
    if not isinstance(e, psycopg.Error):
        log.error("writer_command_failed", stream=command.stream, exc_info=e)
        return _internal(e)
    diag = e.diag
    if isinstance(e, psycopg.DataError):
        return InvalidValue(
            f"Postgres refused a value of the append: {diag.message_primary or e}",
            "an event holds something Postgres cannot store (e.g. a NUL character in text)",
        )
    return StoreError(
        f"Postgres refused the append: {diag.message_primary or e}",
        diag.message_hint or "this is a bug in the caller or in a projection; see the node's log",
    )
