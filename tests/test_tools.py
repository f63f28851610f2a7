"""The tool layer: schemas and validation, execution (threads, timeouts, cancellation, truncation,
parallel reads and ordered writes), the built-in tools, custom tools and session notes on the real
store."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from actors.tools import (
    BUILTINS,
    DuplicateTool,
    InvalidToolSchema,
    Notes,
    StoreNotes,
    ToolContext,
    ToolLoadError,
    ToolOutcome,
    ToolRegistry,
    ToolSpec,
    args_hash,
    calculator,
    current_time,
    execute,
    execute_calls,
    load_custom,
    session_notes,
)
from actors.tools._calculator import MAX_LENGTH
from actors.tools.notes import evolve, replay
from actors.tools.registry import json_path
from actors.tools.spec import Artifacts, PhaseSwitch
from eventstore import Event, Metadata, NewEvent, UnknownEvent, streams
from eventstore.catalogue import ModelChunk, SessionCleared, SessionNote
from tests import fixtures_tools
from tests.conftest import LiveStore

# --- helpers -----------------------------------------------------------------------------------


class NoNotes:
    """The notes of a context whose tools must not touch them."""

    async def read(self) -> list[str]:
        raise AssertionError("this tool must not read notes")

    async def append(self, text: str) -> None:
        raise AssertionError("this tool must not write notes")

    async def replace(self, text: str) -> None:
        raise AssertionError("this tool must not write notes")


class Bodies:
    """Tool results by id, as a session's log holds them."""

    def __init__(self, bodies: dict[str, str] | None = None) -> None:
        self.bodies = bodies or {}

    async def read(self, obs_id: str) -> str | None:
        return self.bodies.get(obs_id)


@dataclass(frozen=True)
class Ctx:
    notes: Notes
    artifacts: Artifacts = field(default_factory=Bodies)
    agent_id: str = "ag"
    session_key: str = "tg:1"
    turn_id: str = "t_1"
    call_id: str = "c_1"
    phases: PhaseSwitch | None = None


CTX = Ctx(NoNotes())
OBJECT: dict[str, Any] = {"type": "object"}


def tool(
    name: str,
    run: Callable[[dict[str, Any], ToolContext], str | Awaitable[str]],
    *,
    mutating: bool = False,
    schema: dict[str, Any] | None = None,
) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=f"the {name} tool",
        input_schema=OBJECT if schema is None else schema,
        mutating=mutating,
        run=run,
    )


def ok(args: dict[str, Any], ctx: ToolContext) -> str:
    return "ok"


async def run_one(spec: ToolSpec, args: dict[str, Any], *, ctx: Ctx = CTX) -> ToolOutcome:
    return await execute(spec, args, ctx, timeout_s=5, max_output_chars=10_000)


# --- registry: definitions and validation ------------------------------------------------------

ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "items"],
    "additionalProperties": False,
}


def order_registry() -> ToolRegistry:
    return ToolRegistry([tool("order", ok, schema=ORDER), tool("ping", ok)])


def test_validation_errors_name_the_path_and_come_in_a_stable_order() -> None:
    registry = order_registry()
    args = {
        "items": [{"name": "tea", "qty": 1}, {"name": "milk", "qty": 0}, {"qty": 2, "size": "L"}],
        "note": "fast",
    }
    expected = [
        "$: 'customer' is a required property",
        "$: Additional properties are not allowed ('note' was unexpected)",
        "items[1].qty: 0 is less than the minimum of 1",
        "items[2]: 'name' is a required property",
        "items[2]: Additional properties are not allowed ('size' was unexpected)",
    ]
    assert registry.validate("order", args) == expected
    reordered = {"note": "fast", "items": args["items"]}
    assert registry.validate("order", reordered) == expected


def test_a_wrong_type_and_a_valid_call() -> None:
    registry = order_registry()
    assert registry.validate("order", {"customer": 5, "items": []}) == [
        "customer: 5 is not of type 'string'"
    ]
    assert registry.validate("order", {"customer": "ann", "items": []}) == []
    assert registry.validate("order", ["not", "an", "object"]) == [
        "$: ['not', 'an', 'object'] is not of type 'object'"
    ]


def test_an_unknown_tool_is_one_error_listing_the_available_ones() -> None:
    assert order_registry().validate("refund", {}) == [
        "unknown tool 'refund'; available: order, ping"
    ]


@pytest.mark.parametrize(
    ("path", "rendered"),
    [
        ([], "$"),
        (["expression"], "expression"),
        (["items", 2, "name"], "items[2].name"),
        ([0, "a"], "[0].a"),
        (["odd key", "x"], '["odd key"].x'),
    ],
)
def test_json_paths(path: list[str | int], rendered: str) -> None:
    assert json_path(path) == rendered


def test_an_invalid_schema_is_refused_when_the_registry_is_built() -> None:
    bad = {"type": "object", "properties": {"when": {"type": "strin"}}}
    with pytest.raises(InvalidToolSchema) as caught:
        ToolRegistry([tool("ping", ok), tool("schedule", ok, schema=bad)])
    assert caught.value.code == "invalid_tool_schema"
    assert "'schedule'" in caught.value.message
    assert "properties.when.type:" in caught.value.message
    assert caught.value.field == "schedule"


def test_a_schema_must_describe_an_object() -> None:
    with pytest.raises(InvalidToolSchema, match="top level"):
        ToolRegistry([tool("echo", ok, schema={"type": "string"})])


def test_tool_names_are_unique() -> None:
    with pytest.raises(DuplicateTool) as caught:
        ToolRegistry([tool("ping", ok), tool("ping", ok)])
    assert caught.value.code == "duplicate_tool"


def test_definitions_keep_the_declared_order_and_are_built_once() -> None:
    schema = copy.deepcopy(ORDER)
    registry = ToolRegistry([tool("zeta", ok), tool("alpha", ok, schema=schema)])
    first = registry.definitions()
    assert [d["name"] for d in first] == ["zeta", "alpha"] == registry.names
    assert first[1] == {"name": "alpha", "description": "the alpha tool", "input_schema": ORDER}
    schema["required"] = ["changed after declaration"]
    assert registry.definitions() is first  # the same bytes in every prompt, no copy per call
    assert first[1]["input_schema"] == ORDER
    assert registry.get("alpha") is not None and registry.get("beta") is None


def test_args_hash_is_stable_and_does_not_carry_the_args() -> None:
    one = {"city": "Berlin", "days": [1, 2], "opts": {"unit": "C", "lang": "de"}}
    same = {"opts": {"lang": "de", "unit": "C"}, "days": [1, 2], "city": "Berlin"}
    assert args_hash(one) == args_hash(same)
    assert args_hash(one) != args_hash({**one, "city": "Bern"})
    assert args_hash({"days": [1, 2]}) != args_hash({"days": [2, 1]})
    # Pinned (FNV-1a of b'{}' and b'{"a":1}'): the hash is stored in the log, so it must never
    # change between releases.
    assert args_hash({}) == "5465b825"
    assert args_hash({"a": 1}) == "8b9e4511"
    assert "Berlin" not in args_hash(one) and len(args_hash(one)) == 8


def test_the_builtins_have_valid_schemas_that_refuse_bad_input() -> None:
    registry = ToolRegistry([factory() for factory in BUILTINS.values()])
    assert registry.names == ["current_time", "calculator", "session_notes", "artifact_read"]
    assert registry.validate("artifact_read", {"id": "toolu_1", "length": 0}) == [
        "length: 0 is less than the minimum of 1"
    ]
    assert registry.validate("calculator", {}) == ["$: 'expression' is a required property"]
    assert registry.validate("calculator", {"expression": "1" * (MAX_LENGTH + 1)}) == [
        f"expression: '{'1' * (MAX_LENGTH + 1)}' is too long"
    ]
    assert registry.validate("session_notes", {"action": "delete"}) == [
        "action: 'delete' is not one of ['read', 'append', 'replace']"
    ]
    assert registry.validate("current_time", {"tz": "UTC"}) == [
        "$: Additional properties are not allowed ('tz' was unexpected)"
    ]
    assert registry.validate("current_time", {}) == []


# --- execute ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_sync_tool_runs_in_a_worker_thread() -> None:
    loop_thread = threading.get_ident()

    def where(args: dict[str, Any], ctx: ToolContext) -> str:
        return "worker" if threading.get_ident() != loop_thread else "loop"

    outcome = await run_one(tool("where", where), {})
    assert outcome.ok and outcome.output == "worker" and outcome.error_code is None
    assert outcome.bytes == 6 and not outcome.truncated and outcome.latency_ms >= 0


@pytest.mark.asyncio
async def test_an_async_tool_runs_on_the_loop() -> None:
    async def greet(args: dict[str, Any], ctx: ToolContext) -> str:
        await asyncio.sleep(0)
        return f"hello {args['name']} from {ctx.call_id}"

    outcome = await run_one(tool("greet", greet), {"name": "ann"})
    assert outcome == ToolOutcome(
        ok=True, output="hello ann from c_1", truncated=False, bytes=18,
        latency_ms=outcome.latency_ms,
    )  # fmt: skip


@pytest.mark.asyncio
async def test_a_slow_async_tool_times_out() -> None:
    async def slow(args: dict[str, Any], ctx: ToolContext) -> str:
        await asyncio.sleep(30)
        return "late"

    started = time.perf_counter()
    outcome = await execute(tool("slow", slow), {}, CTX, timeout_s=0.05, max_output_chars=100)
    assert time.perf_counter() - started < 5
    assert not outcome.ok and outcome.error_code == "tool_timeout"
    assert outcome.output == "the tool did not finish within 0.05 s"


@pytest.mark.asyncio
async def test_a_slow_sync_tool_times_out_and_its_thread_is_left_to_finish() -> None:
    release = threading.Event()

    def stuck(args: dict[str, Any], ctx: ToolContext) -> str:
        release.wait(10)
        return "late"

    try:
        outcome = await execute(tool("stuck", stuck), {}, CTX, timeout_s=0.05, max_output_chars=100)
    finally:
        release.set()
    assert outcome.error_code == "tool_timeout" and not outcome.ok


@pytest.mark.asyncio
async def test_a_timeout_error_of_the_tool_itself_is_a_failure_not_a_timeout() -> None:
    def connect(args: dict[str, Any], ctx: ToolContext) -> str:
        raise TimeoutError("connect to db:5432 timed out")

    outcome = await run_one(tool("connect", connect), {})
    assert outcome.error_code == "tool_failed"
    assert outcome.output == "TimeoutError: connect to db:5432 timed out"


@pytest.mark.asyncio
async def test_an_exception_is_a_failed_outcome_the_model_can_read() -> None:
    async def broken(args: dict[str, Any], ctx: ToolContext) -> str:
        raise KeyError("city")

    def empty(args: dict[str, Any], ctx: ToolContext) -> str:
        raise RuntimeError

    outcome = await run_one(tool("broken", broken), {})
    assert (outcome.ok, outcome.error_code, outcome.output) == (
        False, "tool_failed", "KeyError: 'city'",
    )  # fmt: skip
    assert (await run_one(tool("empty", empty), {})).output == "RuntimeError"


@pytest.mark.asyncio
async def test_a_tool_that_returns_no_str_fails() -> None:
    def number(args: dict[str, Any], ctx: ToolContext) -> str:
        return 42  # type: ignore[return-value]  # the mistake under test

    outcome = await run_one(tool("number", number), {})
    assert not outcome.ok and outcome.error_code == "tool_failed"
    assert outcome.output == "the tool returned int, not the str a tool must return"


@pytest.mark.asyncio
async def test_long_output_keeps_head_and_tail_and_counts_bytes_before_the_cut() -> None:
    text = "<" + "é" * 998 + ">"

    outcome = await execute(
        tool("big", lambda a, c: text), {}, CTX, timeout_s=5, max_output_chars=100
    )
    assert outcome.ok and outcome.truncated
    assert outcome.bytes == 1 + 998 * 2 + 1
    assert outcome.output == (
        "<" + "é" * 74 + "\n…[truncated: 900 of 1000 characters omitted]…\n" + "é" * 24 + ">"
    )


@pytest.mark.asyncio
async def test_output_at_the_limit_is_kept_whole() -> None:
    outcome = await execute(
        tool("fits", lambda a, c: "x" * 100), {}, CTX, timeout_s=5, max_output_chars=100
    )
    assert outcome.output == "x" * 100 and not outcome.truncated and outcome.bytes == 100


@pytest.mark.asyncio
async def test_cancelling_the_turn_cancels_the_tool_and_propagates() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow(args: dict[str, Any], ctx: ToolContext) -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    task = asyncio.create_task(run_one(tool("slow", slow), {}))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()


# --- execute_calls ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_read_only_calls_run_at_the_same_time() -> None:
    # Each call waits for the other: run one after the other, the first would time out.
    barrier = asyncio.Barrier(2)
    threads = threading.Barrier(2, timeout=5)

    async def meet(args: dict[str, Any], ctx: ToolContext) -> str:
        await barrier.wait()
        return f"met {args['n']}"

    def meet_in_thread(args: dict[str, Any], ctx: ToolContext) -> str:
        threads.wait()
        return f"met in thread {args['n']}"

    a, b = tool("a", meet), tool("b", meet_in_thread)
    calls: list[tuple[ToolSpec, dict[str, Any], ToolContext]] = [
        (a, {"n": 1}, CTX), (b, {"n": 2}, CTX), (a, {"n": 3}, CTX), (b, {"n": 4}, CTX),
    ]  # fmt: skip
    outcomes = await execute_calls(calls, timeout_for=lambda s: 5, max_output_chars=100)
    assert [o.output for o in outcomes] == ["met 1", "met in thread 2", "met 3", "met in thread 4"]
    assert all(o.ok for o in outcomes)


@pytest.mark.asyncio
async def test_mutating_calls_run_one_at_a_time_in_order_after_the_reads() -> None:
    log: list[str] = []

    async def write(args: dict[str, Any], ctx: ToolContext) -> str:
        log.append(f"start {args['n']}")
        await asyncio.sleep(0.01 if args["n"] == 1 else 0)  # the first is the slowest
        log.append(f"end {args['n']}")
        return f"wrote {args['n']}"

    def read(args: dict[str, Any], ctx: ToolContext) -> str:
        log.append(f"read {args['n']}")
        return f"read {args['n']}"

    w, r = tool("write", write, mutating=True), tool("read", read)
    calls: list[tuple[ToolSpec, dict[str, Any], ToolContext]] = [
        (w, {"n": 1}, CTX), (r, {"n": 2}, CTX), (w, {"n": 3}, CTX), (w, {"n": 4}, CTX),
    ]  # fmt: skip
    outcomes = await execute_calls(calls, timeout_for=lambda s: 5, max_output_chars=100)
    assert [o.output for o in outcomes] == ["wrote 1", "read 2", "wrote 3", "wrote 4"]
    assert log == ["read 2", "start 1", "end 1", "start 3", "end 3", "start 4", "end 4"]


@pytest.mark.asyncio
async def test_each_call_gets_its_own_timeout() -> None:
    async def nap(args: dict[str, Any], ctx: ToolContext) -> str:
        await asyncio.sleep(args["s"])
        return "rested"

    quick = ToolSpec(
        name="quick", description="", input_schema=OBJECT, mutating=False, run=nap, timeout_s=0.02
    )
    calls: list[tuple[ToolSpec, dict[str, Any], ToolContext]] = [
        (quick, {"s": 10}, CTX), (tool("nap", nap), {"s": 0}, CTX),
    ]  # fmt: skip
    outcomes = await execute_calls(
        calls, timeout_for=lambda s: s.timeout_s or 5, max_output_chars=100
    )
    assert [o.error_code for o in outcomes] == ["tool_timeout", None]


@pytest.mark.asyncio
async def test_cancelling_a_step_cancels_every_parallel_call() -> None:
    running = asyncio.Semaphore(0)
    cancelled: list[int] = []

    async def slow(args: dict[str, Any], ctx: ToolContext) -> str:
        running.release()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(args["n"])
            raise
        return "late"

    s = tool("slow", slow)
    calls: list[tuple[ToolSpec, dict[str, Any], ToolContext]] = [
        (s, {"n": 1}, CTX),
        (s, {"n": 2}, CTX),
    ]
    task = asyncio.create_task(execute_calls(calls, timeout_for=lambda s: 30, max_output_chars=100))
    async with asyncio.timeout(5):
        await running.acquire()
        await running.acquire()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(cancelled) == [1, 2]


# --- calculator --------------------------------------------------------------------------------


def calc(expression: str) -> str:
    result = calculator().run({"expression": expression}, CTX)
    assert isinstance(result, str)
    return result


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(17 + 3) * 2 / 8", "5.0"),
        ("2**64 - 1", "18446744073709551615"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("sqrt(16)", "4.0"),
        ("round(pi, 4)", "3.1416"),
        ("max(1, 5, 3) - min(4, 2)", "3"),
        ("floor(2.7) + ceil(2.1) + abs(-1)", "6"),
        ("log(8, 2)", "3.0"),
        ("exp(0) + cos(0) + sin(0) + tan(0)", "2.0"),
        (" 1e3 ", "1000.0"),
        ("-" * 20 + "1", "1"),
        ("2**10000 % 7", "2"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calc(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("2 +", "not an expression"),
        ("x + 1", "unknown name 'x'"),
        ("open('f')", "unknown function 'open'"),
        ("pi.real", "'pi.real' is not supported"),
        ("().__class__", "not supported"),
        ("'a' * 3", "'a' is not a number"),
        ("1 < 2", "'1 < 2' is not supported"),
        ("x = 1", "not an expression"),
        ("1; 2", "not an expression"),
        ("sqrt(-1)", "math domain error"),
        ("exp(1000)", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("9**9**9", "the power is too large"),
        ("2**10001", "the power is too large"),
        ("(2**6000) * (2**6000)", "the product is too large"),
        ("-" * 60 + "1", "nested too deeply"),
        ("abs(" * 60 + "1" + ")" * 60, "nested too deeply"),
        ("1" * (MAX_LENGTH + 1), "at most 500"),
    ],
)
def test_calculator_refusals(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        calc(expression)


@pytest.mark.asyncio
async def test_a_calculator_error_is_a_failed_outcome() -> None:
    outcome = await run_one(calculator(), {"expression": "1/0"})
    assert (outcome.ok, outcome.output) == (False, "ValueError: division by zero")


# --- current_time ------------------------------------------------------------------------------


def at_fixed_time(zone: str | None) -> str:
    spec = current_time(lambda: datetime(2026, 11, 29, 19, 4, 5, 123456, tzinfo=UTC))
    result = spec.run({} if zone is None else {"timezone": zone}, CTX)
    assert isinstance(result, str)
    return result


def test_current_time_in_utc_and_in_a_zone() -> None:
    assert at_fixed_time(None) == "2026-11-29T19:04:05+00:00 (Sunday)"
    assert at_fixed_time("Europe/Berlin") == "2026-11-29T20:04:05+01:00 (Sunday)"
    assert at_fixed_time("Pacific/Auckland") == "2026-11-30T08:04:05+13:00 (Monday)"


@pytest.mark.parametrize("zone", ["Mars/Olympus_Mons", "../../etc/passwd", "not a zone"])
def test_current_time_refuses_an_unknown_zone_with_an_example(zone: str) -> None:
    with pytest.raises(ValueError, match=r"unknown time zone .* such as 'Europe/Berlin'"):
        at_fixed_time(zone)


def test_current_time_reads_the_real_clock_by_default() -> None:
    result = current_time().run({}, CTX)
    assert isinstance(result, str)
    assert result.startswith(str(datetime.now(UTC).year)) and "+00:00 (" in result


# --- custom tools ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_custom_tool_is_loaded_and_runs() -> None:
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    loud = load_custom("shout", "tests.fixtures_tools:shout", "Shout.", schema, False, 2.5)
    quiet = load_custom("whisper", "tests.fixtures_tools:whisper", "Whisper.", schema, True)
    assert loud.run is fixtures_tools.shout and loud.timeout_s == 2.5 and not loud.mutating
    assert quiet.mutating and quiet.timeout_s is None
    assert (await run_one(loud, {"text": "hi"})).output == "HI"
    assert (await run_one(quiet, {"text": "HI"})).output == "hi"
    assert ToolRegistry([loud, quiet]).names == ["shout", "whisper"]


@pytest.mark.parametrize(
    ("module_path", "message", "hint"),
    [
        ("tests.no_such_module:run", "cannot import module 'tests.no_such_module'", "PYTHONPATH"),
        ("tests.fixtures_tools:missing", "has no attribute 'missing'", "after the colon"),
        ("tests.fixtures_tools:NOT_CALLABLE", "is a int, not a function", "(args, ctx)"),
        ("tests.fixtures_tools.shout", "does not say which function", "module:function"),
        (":shout", "does not say which function", "module:function"),
    ],
)
def test_a_custom_tool_that_cannot_load(module_path: str, message: str, hint: str) -> None:
    with pytest.raises(ToolLoadError) as caught:
        load_custom("mine", module_path, "Mine.", OBJECT, False, None)
    assert caught.value.code == "tool_load_failed"
    assert message in caught.value.message and "'mine'" in caught.value.message
    assert hint in caught.value.hint


# --- artifact_read ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_artifact_read_pages_through_a_whole_result() -> None:
    body = "".join(f"line {i}\n" for i in range(3000))  # 28,890 characters
    ctx = Ctx(NoNotes(), Bodies({"toolu_1": body}))
    spec = BUILTINS["artifact_read"]()
    first = await execute(spec, {"id": "toolu_1"}, ctx, timeout_s=5, max_output_chars=20_000)
    header, page = first.output.split("\n", 1)
    assert (
        header == "[toolu_1: characters 0-12000 of 28890; 16890 more: call again with offset 12000]"
    )
    assert page == body[:12000]
    last = await execute(spec, {"id": "toolu_1", "offset": 24000, "length": 12000}, ctx,
                         timeout_s=5, max_output_chars=20_000)  # fmt: skip
    header, page = last.output.split("\n", 1)
    assert header == "[toolu_1: characters 24000-28890 of 28890]" and page == body[24000:]
    missing = await execute(spec, {"id": "toolu_2"}, ctx, timeout_s=5, max_output_chars=20_000)
    assert not missing.ok and "no tool result 'toolu_2' in this session" in missing.output


# --- session notes -----------------------------------------------------------------------------

ADD_A = SessionNote(action="append", text="a")
ADD_B = SessionNote(action="append", text="b")


@pytest.mark.parametrize(
    ("events", "notes"),
    [
        ([], []),
        ([ADD_A, ADD_B], ["a", "b"]),
        ([ADD_A, SessionNote(action="replace", text="c"), ADD_B], ["c", "b"]),
        ([ADD_A, SessionNote(action="replace", text="")], []),
        ([ADD_A, SessionNote(action="replace")], []),
        ([ADD_A, SessionCleared(by="user"), ADD_B], ["b"]),
        ([ADD_A, SessionNote(action="append", text=""), SessionNote(action="append")], ["a"]),
        ([ADD_A, ModelChunk(delta="x")], ["a"]),
    ],
)
def test_notes_replay(events: list[Event | UnknownEvent], notes: list[str]) -> None:
    assert replay(events) == notes


def test_an_unknown_event_leaves_the_notes() -> None:
    assert evolve(("a",), UnknownEvent("session.future", msgspec.Raw(b"{}"))) == ("a",)


@pytest.mark.asyncio
async def test_store_notes_append_replace_and_clear(live: LiveStore) -> None:
    notes = StoreNotes(live.store, "ag", "tg:1", "t_1")
    assert await notes.read() == []
    await notes.append("likes tea")
    await notes.append("lives in Berlin")
    assert await notes.read() == ["likes tea", "lives in Berlin"]
    await notes.replace("only this")
    assert await notes.read() == ["only this"]
    await notes.replace("")
    assert await notes.read() == []

    stored = await live.store.aread_stream(streams.session("ag", "tg:1"))
    assert [e.type for e in stored] == ["session.note"] * 4
    assert stored[0].data == SessionNote(action="append", text="likes tea", turn_id="t_1")
    assert stored[3].data == SessionNote(action="replace", text="", turn_id="t_1")
    assert {e.metadata for e in stored} == {
        Metadata(agent_id="ag", session_key="tg:1", turn_id="t_1")
    }
    assert await StoreNotes(live.store, "ag", "tg:2", "t_2").read() == []


@pytest.mark.asyncio
async def test_clearing_the_session_clears_its_notes(live: LiveStore) -> None:
    notes = StoreNotes(live.store, "ag", "tg:1", "t_1")
    await notes.append("before")
    stream = streams.session("ag", "tg:1")
    await live.store.aappend(stream, [NewEvent(event=SessionCleared(by="user"))])
    assert await notes.read() == []
    await StoreNotes(live.store, "ag", "tg:1", "t_2").append("after")
    assert await notes.read() == ["after"]


@pytest.mark.asyncio
async def test_store_notes_read_a_stream_longer_than_one_page(live: LiveStore) -> None:
    stream = streams.session("ag", "tg:1")
    many = [NewEvent(event=SessionNote(action="append", text=str(i))) for i in range(1001)]
    await live.store.aappend(stream, many)
    notes = await StoreNotes(live.store, "ag", "tg:1", "t_1").read()
    assert len(notes) == 1001 and notes[-1] == "1000"


@pytest.mark.asyncio
async def test_the_session_notes_tool(live: LiveStore) -> None:
    ctx = Ctx(StoreNotes(live.store, "ag", "tg:1", "t_1"))
    spec = session_notes()
    assert spec.mutating

    async def call(**args: Any) -> ToolOutcome:
        return await run_one(spec, args, ctx=ctx)

    assert (await call(action="read")).output == "(no notes)"
    assert (await call(action="append", text="likes tea")).output == "note added"
    await call(action="append", text="lives in Berlin")
    assert (await call(action="read")).output == "1. likes tea\n2. lives in Berlin"
    assert (await call(action="replace", text="moved to Rome")).output == "notes replaced"
    assert (await call(action="read")).output == "1. moved to Rome"
    assert (await call(action="replace", text="")).output == "notes cleared"
    assert (await call(action="read")).output == "(no notes)"

    missing = await call(action="append")
    assert (missing.ok, missing.output) == (False, "ValueError: action 'append' needs `text`")
    empty = await call(action="append", text="")
    assert empty.output == "ValueError: action 'append' needs a `text` that is not empty"
    assert await ctx.notes.read() == []
