"""``GET /v1/openapi.json`` against the live server it describes.

Schemathesis reads the document the server serves and generates requests for every operation,
valid ones and deliberately invalid ones. No answer may be a 5xx, every error must be the envelope
(non-empty ``code``, ``message`` and ``hint``), and every answer must fit the status codes, media
types and schemas the document declares; valid requests must be accepted and invalid ones
refused. The two SSE operations never end on a valid request, so only their error paths (and the
stream of a turn that has already ended) are checked, with requests written here; the WebSocket
is not in the document.

Generation is derandomized (the same requests every run) and bounded (``EXAMPLES`` per operation
and mode). Every schemathesis call runs in a child process (``python -m tests.test_openapi
JOB``), not in a thread: the server is on this event loop, and schemathesis holds the GIL for
long stretches (Hypothesis' generation, jsonschema-rs compiling schemas), long enough to trip the
blocking check on the server's own callbacks.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypedDict

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NOT_SET
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

from gateways.http.app import create_app
from gateways.http.auth import OPEN_PATHS, WEBHOOK_PREFIX
from tests.conftest import ApiFactory, ApiServer
from tests.turns import wait_end

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = 30
STREAMS = frozenset({"/v1/agents/{agent}/turns/{turn_id}/stream", "/v1/events"})
# Not API v1: Prometheus, the WebSocket (docs/api.md), the console's files (docs/console.md).
UNDOCUMENTED = frozenset({"/metrics", "/v1/ws", "/", "/console", "/console/{path:path}"})
STOP = "POST /v1/agents/{agent}/turns/{turn_id}/stop"
RELOAD = "POST /v1/agents/{agent}/reload"
STOP_AGENT = "POST /v1/agents/{agent}/stop"
START_AGENT = "POST /v1/agents/{agent}/start"
PHASE = "POST /v1/agents/{agent}/sessions/{key}/phase"
# Not generated for; test_the_operations_v1_has_and_we_refuse sends them. An agent's reload,
# stop and start change the agent every other generated request is sent to (a generated stop
# would make the valid messages after it 409 agent_stopped; tests/test_live_agents.py tests
# them); a phase is valid only when the agent declares it, which the document cannot say for
# every agent (the default agent declares none), so generated "valid" phases are refused.
UNSUPPORTED = frozenset({RELOAD, STOP_AGENT, START_AGENT, PHASE})
MESSAGES = "POST /v1/agents/{agent}/messages"
FORK = "POST /v1/agents/{agent}/sessions/{key}/fork"
# Conformance of one answer, whatever produced the request.
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Plus, for generated requests: valid ones accepted, invalid ones refused.
CHECKS = [*CONFORMANCE, positive_data_acceptance, negative_data_rejection]
# Refusals of schema-valid requests that no schema could prevent: `before` must name a turn of
# this agent that exists; a delivery must name a channel the agent has; a schedule's expression
# must fire (a cron that never does, a duration's bounds, an `at` ten years ahead), and a zone
# may be one of the database's posix/ or right/ copies (gateways/http/openapi.py says the rest).
# (operation, error code, error field)
_SCHEDULE = "/v1/agents/{agent}/schedules"
_SCHEDULE_WRITES = (f"POST {_SCHEDULE}", f"PUT {_SCHEDULE}/{{schedule}}",
                    f"PATCH {_SCHEDULE}/{{schedule}}")  # fmt: skip
BY_DATA = frozenset(
    {
        ("GET /v1/agents/{agent}/turns", "turns_page_invalid", "before"),
        ("POST /v1/agents/{agent}/messages", "deliver_invalid", "deliver.channel"),
        # A webhook's URL must parse as one, and its host resolve to an address the node allows.
        *(
            ("POST /v1/webhooks", code, "url")
            for code in (
                "webhook_url_invalid",
                "webhook_target_unresolved",
                "webhook_target_refused",
            )
        ),
        # A fork names a new session: one an earlier generated fork made is taken.
        (FORK, "session_exists", "newKey"),
        # Usage: a date the pattern admits may not be on the calendar (02-30), `to` must come
        # after `from`, and each key of `by` comes once, which the patterns do not say.
        *(
            (label, code, field)
            for label in ("GET /v1/usage", "GET /v1/agents/{agent}/usage")
            for code, field in (
                ("usage_range_invalid", "from"),
                ("usage_range_invalid", "to"),
                ("usage_group_invalid", "by"),
            )
        ),
        *(
            (label, code, field)
            for label in _SCHEDULE_WRITES
            for code, field in (
                ("schedule_invalid", "expr"),
                ("schedule_invalid", "timezone"),
                ("schedule_invalid", "session"),
                ("schedule_invalid", "deliver"),
                ("schedule_invalid", "id"),
                ("schedule_invalid", "task"),
                ("deliver_invalid", "deliver.channel"),
            )
        ),
    }
)
# Operations no generated request can make succeed here: stop (the pinned turn has ended), a
# schedule's replacement (the body's id must be the path's: beyond a schema;
# test_schedule_writes_by_hand sends them), the
# channel webhook (the default agent has no channel in webhook mode), an approval's answer (no
# tool of the default agent asks; tests/test_approvals.py answers real ones).
NEEDS_DATA = frozenset({
    STOP,
    "POST /v1/agents/{agent}/approvals/{approval}",
    f"PUT {_SCHEDULE}/{{schedule}}",
    f"PATCH {_SCHEDULE}/{{schedule}}",
    "POST /v1/channels/{channel}/webhook/{agent}",
    "POST /v1/stream-tokens",  # the agent and its turn or session are in the body
    FORK,  # a turn of the pinned session (index 1, or its id), no other agent named, a new key
    "DELETE /v1/keys/{key_id}",  # a key that exists (tests/test_keys.py revokes real ones)
    # A subscription needs a URL that resolves to a public address (or an allowed one), and the
    # others a subscription that exists (tests/test_webhooks.py makes real ones).
    "POST /v1/webhooks",
    "GET /v1/webhooks/{webhook_id}",
    "GET /v1/webhooks/{webhook_id}/deliveries",
    "DELETE /v1/webhooks/{webhook_id}",
})  # fmt: skip
# The server ignores query parameters it does not know (as v1 clients expect), and the token is
# sent by the test (a token the generator made up can only be refused).
CONFIG = {"generation": {"allow-extra-parameters": False, "with-security-parameters": False}}

Operation = APIOperation[Any, Any, Any, Any]
AnyCase = Case[Operation]


def envelope_problem(status: int, body: bytes) -> str | None:
    """Why an answer is not the error envelope it must be (None: it is, or it is no error)."""
    if status < 400:
        return None
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} is not the error envelope: {body[:200]!r}"
    empty = [key for key in ("code", "message", "hint") if not error.get(key)]
    return f"{status} has an empty {', '.join(empty)}: {error}" if empty else None


# ---- the child process ---------------------------------------------------------------------


class Request(TypedDict, total=False):
    """A request written by hand: the operation's label and what to fill in."""

    label: str
    path: dict[str, str]
    query: dict[str, str]
    headers: dict[str, str]
    body: dict[str, Any]


class Job(TypedDict, total=False):
    kind: Literal["validate", "fuzz", "send"]
    url: str
    headers: dict[str, str]
    pinned: dict[str, str]
    """fuzz: path parameters to fix (the agent, turn and session that exist)."""
    requests: list[Request]
    """send: the requests to make, in order."""


class Report(TypedDict):
    problems: list[str]
    """One line a distinct problem, with the first request that showed it."""
    statuses: dict[str, dict[str, list[int]]]
    """fuzz: operation label -> generation mode -> statuses seen (sorted, distinct)."""
    answers: list[tuple[int, str]]
    """send: the status and body of each answer."""
    operations: list[str]
    """The labels of the operations schemathesis read from the document."""


def run_job(job: Job) -> Report:
    schema = schemathesis.openapi.from_url(
        job["url"] + "/v1/openapi.json", config=schemathesis.Config.from_dict(CONFIG)
    )
    report = Report(problems=[], statuses={}, answers=[], operations=[])
    operations: dict[str, Operation] = {}
    for result in schema.get_all_operations():
        if isinstance(result, Ok):
            operations[result.ok().label] = result.ok()
        else:
            report["problems"].append(f"unreadable operation: {result.err()}")
    report["operations"] = sorted(operations)
    match job["kind"]:
        case "validate":
            try:
                schema.validate()
            except Exception as e:  # the validation error, whatever its class, is the finding
                report["problems"].append(f"not valid OpenAPI: {e}")
        case "fuzz":
            fuzz(schema, operations, job, report)
        case "send":
            send(operations, job, report)
    return report


def fuzz(schema: BaseSchema, operations: dict[str, Operation], job: Job, report: Report) -> None:
    """Generated requests for every operation but the streams, valid and invalid ones. Problems
    are collected rather than raised, so one run reports every operation."""
    problems: dict[str, str] = {}
    statuses: dict[str, dict[str, set[int]]] = {}

    def found(case: AnyCase, what: str, answer: str) -> None:
        request = f"{case.method} {case.formatted_path} query={case.query} body={case.body!r}"
        problems.setdefault(f"{case.operation.label}: {what}", f"{request} -> {answer}")

    def check(case: AnyCase) -> None:
        try:
            response = case.call(base_url=job["url"], headers=job["headers"], timeout=10)
        except Exception as e:  # a transport failure is a finding, not a crash of the run
            found(case, "request failed", repr(e))
            return
        mode = case.meta.generation.mode.value if case.meta else "explicit"
        statuses.setdefault(case.operation.label, {}).setdefault(mode, set()).add(
            response.status_code
        )
        answer = f"{response.status_code} {response.content[:300]!r}"
        problem = envelope_problem(response.status_code, response.content)
        if problem is not None:
            found(case, problem, answer)
        try:
            case.validate_response(response, checks=CHECKS, headers=job["headers"])
        except FailureGroup as group:
            for failure in group.exceptions:
                if isinstance(failure, RejectedPositiveData) and refused_by_data(case, response):
                    continue
                # The hint names the extra properties it saw: one problem whatever they were.
                message = "\n".join(
                    line for line in failure.message.splitlines() if not line.startswith("Hint:")
                )
                found(case, f"{failure.title}: {message}", answer)

    for operation in operations.values():
        if operation.path in STREAMS or operation.label in UNSUPPORTED:
            continue
        names = {p.name for p in operation.path_parameters}
        pinned = {k: v for k, v in job["pinned"].items() if k in names} or None
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode, path_parameters=pinned)
            run: Callable[[], None] = settings(
                max_examples=EXAMPLES,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: report, don't minimise
                suppress_health_check=list(HealthCheck),
            )(given(strategy)(check))
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid: no parameters, no body
                assert mode is GenerationMode.NEGATIVE, operation.label
    report["problems"] += [f"{what}\n    e.g. {example}" for what, example in problems.items()]
    report["statuses"] = {
        label: {mode: sorted(seen) for mode, seen in modes.items()}
        for label, modes in statuses.items()
    }


def refused_by_data(case: AnyCase, response: schemathesis.Response) -> bool:
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (case.operation.label, error.get("code"), error.get("field")) in BY_DATA


def send(operations: dict[str, Operation], job: Job, report: Report) -> None:
    """Requests written by hand, each answer checked against the document."""
    for request in job["requests"]:
        operation = operations[request["label"]]
        case = operation.Case(
            path_parameters=request.get("path"),
            query=request.get("query"),
            body=request.get("body", NOT_SET),
        )
        headers = request.get("headers", {})
        response = case.call(base_url=job["url"], headers=headers, timeout=10)
        report["answers"].append((response.status_code, response.content.decode()))
        what = f"{request} -> {response.status_code} {response.content[:300]!r}"
        problem = envelope_problem(response.status_code, response.content)
        if problem is not None:
            report["problems"].append(f"{problem}\n    e.g. {what}")
        try:
            case.validate_response(response, checks=CONFORMANCE, headers=headers)
        except FailureGroup as group:
            report["problems"] += [
                f"{f.title}: {f.message}\n    e.g. {what}" for f in group.exceptions
            ]


# ---- the parent: the test process --------------------------------------------------------------


async def in_child(job: Job) -> Report:
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.test_openapi",
        json.dumps(job),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), 300)
    except TimeoutError:
        child.kill()  # not left running, nor its pipes open for a later test to find
        await child.communicate()
        raise
    assert child.returncode == 0, err.decode()
    report: Report = json.loads(out)
    return report


async def document(api: ApiServer) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url) as client:
        answer = await client.get("/v1/openapi.json")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    raw: dict[str, Any] = answer.json()
    return raw


async def finished_turn(api: ApiServer) -> tuple[str, str]:
    """A turn that ran the calculator and ended: its id and session key. Also a schedule
    (``fuzz-known``, far in the future) for the schedule operations to find."""
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        answer = await client.post(
            "/v1/agents/assistant/messages",
            json={"text": "calculate 6*7", "sessionKey": "fuzz:known"},
        )
        made = await client.post("/v1/agents/assistant/schedules", json={
            "id": "fuzz-known", "kind": "at", "expr": "2035-01-01T00:00:00Z", "task": "hi",
            "deliver": "none",
        })  # fmt: skip
    assert answer.status_code == 202, answer.text
    assert made.status_code in (201, 409), made.text
    turn_id: str = answer.json()["turnId"]
    await wait_end(api.node, turn_id)
    return turn_id, "fuzz:known"


def successes(report: Report) -> set[str]:
    """Operations that answered a valid request with a 2xx at least once."""
    return {
        label
        for label, modes in report["statuses"].items()
        if any(200 <= status < 300 for status in modes.get("positive", []))
    }


def fuzzed(report: Report) -> set[str]:
    """The operations requests are generated for: all but the streams and the refused ones."""
    return {
        label
        for label in report["operations"]
        if label.split(" ", 1)[1] not in STREAMS and label not in UNSUPPORTED
    }


# ---- the document ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_document_is_valid_openapi_3_1(api: ApiServer) -> None:
    raw = await document(api)
    report = await in_child(Job(kind="validate", url=api.url))
    assert report["problems"] == [], "\n".join(report["problems"])
    assert raw["openapi"] == "3.1.0"
    documented = {f"{m.upper()} {p}" for p, item in raw["paths"].items() for m in item}
    # schemathesis leaves out the operation that serves the document it reads
    assert set(report["operations"]) == documented - {"GET /v1/openapi.json"}


@pytest.mark.asyncio
async def test_every_route_is_in_the_document(api: ApiServer) -> None:
    raw = await document(api)
    in_document = {(path, method.upper()) for path, item in raw["paths"].items() for method in item}
    served = {
        (route.path, method)
        for route in create_app(api.node).routes
        if isinstance(route, Route) and route.path not in UNDOCUMENTED
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert served - in_document == set(), "served but not documented"
    assert in_document - served == set(), "documented but not served"


@pytest.mark.asyncio
async def test_open_paths_are_documented_without_security(api: ApiServer) -> None:
    paths = (await document(api))["paths"]
    for path in OPEN_PATHS & paths.keys():  # a path missing altogether fails the test above
        assert paths[path]["get"].get("security") == [], path


# ---- generated requests ---------------------------------------------------------------------


@pytest.mark.alone  # the fuzzing child takes a core for a minute or more
@pytest.mark.timeout(420)
@pytest.mark.asyncio
async def test_generated_requests_on_an_open_server(api: ApiServer) -> None:
    turn_id, key = await finished_turn(api)
    pinned = {"agent": "assistant", "turn_id": turn_id, "key": key, "schedule": "fuzz-known"}
    # The two runs go at once, a core each: the unpinned one's made-up names reach nothing the
    # pinned one reads (its requests for every operation without a path parameter are the
    # pinned one's, made twice).
    anywhere, known = await asyncio.gather(
        in_child(Job(kind="fuzz", url=api.url, headers={}, pinned={})),
        in_child(Job(kind="fuzz", url=api.url, headers={}, pinned=pinned)),
    )
    problems = anywhere["problems"] + known["problems"]
    assert problems == [], "\n".join(problems)
    # Pinned to an agent, a turn, a session and a schedule that exist, valid requests reach the
    # handlers: every operation succeeds at least once but those that need what no generator
    # can know (see NEEDS_DATA). On an open node, minting a key needs the boot claim it printed
    # (an anonymous caller would close the node to everyone else): 401 claim_required.
    open_needs = NEEDS_DATA | {"POST /v1/keys"}
    assert successes(known) == fuzzed(known) - open_needs, known["statuses"]


@pytest.mark.alone  # the fuzzing child takes a core for a minute or more
@pytest.mark.timeout(420)
@pytest.mark.asyncio
async def test_generated_requests_with_a_token(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=["fuzz-secret"])
    turn_id, key = await finished_turn(api)
    pinned = {"agent": "assistant", "turn_id": turn_id, "key": key, "schedule": "fuzz-known"}
    known = await in_child(Job(kind="fuzz", url=api.url, headers=api.headers, pinned=pinned))
    assert known["problems"] == [], "\n".join(known["problems"])
    assert successes(known) == fuzzed(known) - NEEDS_DATA, known["statuses"]


# ---- requests written by hand: the 401s and the streams --------------------------------------


@pytest.mark.asyncio
async def test_every_operation_refuses_a_missing_or_wrong_token(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=["fuzz-secret"])
    labels = (await in_child(Job(kind="validate", url=api.url)))["operations"]
    values = {"agent": "assistant", "turn_id": "t-nope", "key": "k", "schedule": "s",
              "channel": "telegram", "approval": "ap_nope", "key_id": "k",
              "webhook_id": "wh_nope"}  # fmt: skip
    requests: list[Request] = []
    for label in labels:
        path = label.split(" ", 1)[1]
        params = {name: value for name, value in values.items() if "{" + name + "}" in path}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            request = Request(label=label, path=params, headers=headers)
            if label == MESSAGES:
                request["body"] = {"text": "hi"}
            requests.append(request)
    report = await in_child(Job(kind="send", url=api.url, requests=requests))
    assert report["problems"] == [], "\n".join(report["problems"])
    statuses = {
        (request["label"], bool(request.get("headers"))): status
        for request, (status, _) in zip(requests, report["answers"], strict=True)
    }
    # The channel webhook is open (the provider sends no token; the channel checks its own
    # secret): for an agent without such a channel it is 404, token or not.
    assert statuses == {
        (label, wrong): 200
        if label.split(" ", 1)[1] in OPEN_PATHS
        else 404
        if label.split(" ", 1)[1].startswith(WEBHOOK_PREFIX)
        else 401
        for label in labels
        for wrong in (False, True)
    }


@pytest.mark.asyncio
async def test_the_streams_error_paths_and_an_ended_turn(api: ApiServer) -> None:
    turn_id, _ = await finished_turn(api)
    turn = "GET /v1/agents/{agent}/turns/{turn_id}/stream"
    firehose = "GET /v1/events"
    cases: list[tuple[Request, int]] = [
        (Request(label=turn, path={"agent": "nope", "turn_id": turn_id}), 404),
        (Request(label=turn, path={"agent": "assistant", "turn_id": "t-nope"}), 404),
        (
            Request(
                label=turn,
                path={"agent": "assistant", "turn_id": turn_id},
                query={"after": "not-a-cursor"},
            ),
            400,
        ),
        (
            Request(
                label=turn, path={"agent": "assistant", "turn_id": turn_id}, query={"types": "x"}
            ),
            400,
        ),
        (Request(label=firehose, query={"agentId": "nope"}), 404),
        (Request(label=firehose, query={"types": "turn.strat"}), 400),
        (Request(label=firehose, query={"after": "not-a-cursor"}), 400),
        # A turn that has ended: replay, its events, stream.ended, and the stream closes.
        (Request(label=turn, path={"agent": "assistant", "turn_id": turn_id}), 200),
    ]
    report = await in_child(
        Job(kind="send", url=api.url, requests=[request for request, _ in cases])
    )
    assert report["problems"] == [], "\n".join(report["problems"])
    assert [status for status, _ in report["answers"]] == [status for _, status in cases]
    assert "event: stream.ended" in report["answers"][-1][1]


@pytest.mark.asyncio
async def test_schedule_writes_by_hand(api: ApiServer) -> None:
    """The schedule operations no generator reaches, with valid requests, against the document."""
    create = f"POST {_SCHEDULE}"
    one = f"{_SCHEDULE}/{{schedule}}"
    path = {"agent": "assistant", "schedule": "by-hand"}
    spec = {"id": "by-hand", "kind": "every", "expr": "1h", "task": "hi", "deliver": "none"}
    cases: list[tuple[Request, int]] = [
        (Request(label=create, path={"agent": "assistant"}, body=spec), 201),
        (Request(label=create, path={"agent": "assistant"}, body=spec), 409),
        (Request(label=f"PUT {one}", path=path, body={**spec, "expr": "2h"}), 200),
        (Request(label=f"PATCH {one}", path=path, body={**spec, "enabled": False}), 200),
        (Request(label=f"GET {one}", path=path), 200),
        (Request(label=f"POST {one}/run", path=path), 202),
        (Request(label=f"DELETE {one}", path=path), 200),
        (Request(label=f"GET {one}", path=path), 404),
    ]
    report = await in_child(
        Job(kind="send", url=api.url, requests=[request for request, _ in cases])
    )
    assert report["problems"] == [], "\n".join(report["problems"])
    assert [status for status, _ in report["answers"]] == [status for _, status in cases]


@pytest.mark.asyncio
async def test_forks_by_hand(api: ApiServer) -> None:
    """The fork operation with the requests no generator makes succeed, against the document."""
    turn_id, key = await finished_turn(api)
    path = {"agent": "assistant", "key": key}
    cases: list[tuple[Request, int]] = [
        (Request(label=FORK, path=path, body={"atTurn": 1}), 201),
        (Request(label=FORK, path=path, body={"atTurn": turn_id, "newKey": "by-hand"}), 201),
        (Request(label=FORK, path=path, body={"atTurn": 1.0, "newKey": "by-hand"}), 409),
        (
            Request(
                label=FORK, path=path, body={"atTurn": 1, "agent": "assistant", "newKey": None}
            ),
            201,
        ),
        (Request(label=FORK, path=path, body={"atTurn": 2}), 404),
        (Request(label=FORK, path=path, body={"atTurn": 0}), 400),
    ]
    report = await in_child(
        Job(kind="send", url=api.url, requests=[request for request, _ in cases])
    )
    assert report["problems"] == [], "\n".join(report["problems"])
    assert [status for status, _ in report["answers"]] == [status for _, status in cases]


@pytest.mark.asyncio
async def test_the_operations_v1_has_and_we_refuse(api: ApiServer) -> None:
    """Reload, stop, start and a session's phase answer as the document says, with a status
    and a body it declares (400 for a phase the agent does not declare or of the wrong type);
    a message while the agent is stopped is the 409 the document names."""
    raw = await document(api)
    cases = [
        ("POST", "/v1/agents/assistant/reload", None, RELOAD, 200, None),
        ("POST", "/v1/agents/nobody/reload", None, RELOAD, 404, "agent_not_found"),
        ("POST", "/v1/agents/assistant/reload", {"by": 5}, RELOAD, 400, "request_body_invalid"),
        ("POST", "/v1/agents/assistant/stop", {"reason": "r"}, STOP_AGENT, 200, None),
        ("POST", "/v1/agents/assistant/messages", {"text": "hi"}, MESSAGES, 409,
         "agent_stopped"),
        ("POST", "/v1/agents/assistant/start", None, START_AGENT, 200, None),
        ("POST", "/v1/agents/nobody/stop", None, STOP_AGENT, 404, "agent_not_found"),
        ("POST", "/v1/agents/nobody/start", None, START_AGENT, 404, "agent_not_found"),
        ("POST", "/v1/agents/assistant/sessions/s1/phase", {"phase": "triage"}, PHASE, 400,
         "phase_invalid"),
        ("POST", "/v1/agents/assistant/sessions/s1/phase", {"phase": None}, PHASE, 400,
         "phase_invalid"),
        ("POST", "/v1/agents/assistant/sessions/s1/phase", {"phase": 3}, PHASE, 400,
         "phase_invalid"),
        ("POST", "/v1/agents/assistant/sessions/s1/phase", {}, PHASE, 400, "phase_invalid"),
    ]  # fmt: skip
    wrong = []
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        for method, path, body, label, status, code in cases:
            answer = await client.request(method, path, json=body)
            declared = raw["paths"][label.split(" ", 1)[1]]["post"]["responses"]
            response = declared.get(str(answer.status_code))
            fitting = response is not None and fits(
                raw, response["content"]["application/json"]["schema"], answer.json()
            )
            problem = envelope_problem(answer.status_code, answer.content)
            error = answer.json().get("error") if answer.status_code >= 400 else None
            got = (answer.status_code, error and error["code"], fitting, problem)
            if got != (status, code, True, None):
                wrong.append(f"{method} {path} {body} -> {got} {answer.text}")
    assert wrong == [], "\n".join(wrong)


def fits(raw: dict[str, Any], schema: dict[str, Any], value: object) -> bool:
    """Whether ``value`` is valid for ``schema`` (a part of the document ``raw``)."""
    validator = jsonschema.Draft202012Validator({**schema, "components": raw["components"]})
    return validator.is_valid(value)


def query_schema(raw: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    params = raw["paths"][path]["get"]["parameters"]
    schema: dict[str, Any] = next(p for p in params if p["name"] == name)["schema"]
    return schema


SPEC = {"id": "agree", "kind": "cron", "expr": "0 9 * * 1-5", "timezone": "Europe/Berlin",
        "task": "hi", "deliver": "none", "session": "shared:daily"}  # fmt: skip
# Schedule bodies the server refuses for what a schema can say, and ones it takes.
SCHEDULES: list[tuple[dict[str, Any], bool]] = [
    ({}, True),
    ({"timezone": None}, True),
    ({"timezone": "Mars/Olympus_Mons"}, False),
    ({"timezone": "localtime"}, False),
    ({"timezone": ""}, True),  # UTC, as null is
    ({"expr": "0 9 * *"}, False),
    ({"expr": "0 9 * * 1 2 3"}, False),
    ({"expr": "every day"}, False),
    ({"expr": "0 0 9 * * mon-fri"}, True),
    ({"expr": "0 0 L,LW * 5L,1#2"}, True),
    ({"expr": "a b c d e"}, False),
    ({"kind": "every", "expr": "1h30m"}, True),
    ({"kind": "every", "expr": "90x"}, False),
    ({"kind": "every", "expr": ""}, False),
    ({"kind": "every", "expr": "0d00h0s"}, False),
    ({"kind": "every", "expr": "0d1s"}, True),
    ({"kind": "at", "expr": "2030-01-31T09:00"}, True),
    ({"kind": "at", "expr": "tomorrow"}, False),
    ({"session": "isolated"}, True),
    ({"session": "shared: "}, False),
    ({"session": "shared:a/b"}, False),
    ({"session": "daily"}, False),
    ({"deliver": None}, False),
]


@pytest.mark.asyncio
async def test_the_document_refuses_what_the_server_refuses(api: ApiServer) -> None:
    """The constraints the document gives a schedule's fields and the streams' `types` and the
    turns list's `before` are the server's own checks, value by value."""
    raw = await document(api)
    turn_id, _ = await finished_turn(api)
    spec_schema = {"$ref": "#/components/schemas/ScheduleSpec"}
    disagree = []
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as client:
        for n, (change, valid) in enumerate(SCHEDULES):
            body = {**SPEC, "id": f"agree-{n}", **change}
            answer = await client.post("/v1/agents/assistant/schedules", json=body)
            if (answer.status_code == 201, fits(raw, spec_schema, body)) != (valid, valid):
                disagree.append(f"{change}: {answer.status_code} {answer.text}")
        types = query_schema(raw, "/v1/events", "types")
        stream = f"/v1/agents/assistant/turns/{turn_id}/stream"
        assert query_schema(raw, "/v1/agents/{agent}/turns/{turn_id}/stream", "types") == types
        for value, valid in [("turn.end", True), (" turn.end , model.chunk,", True),
                             ("turn.strat", False), ("turn.end,nope", False)]:  # fmt: skip
            answer = await client.get(stream, params={"types": value})
            if (answer.status_code == 200, fits(raw, types, value)) != (valid, valid):
                disagree.append(f"types={value!r}: {answer.status_code} {answer.text[:200]}")
        before = query_schema(raw, "/v1/agents/{agent}/turns", "before")
        for value, valid in [(turn_id, True), ("", True), ("nope", False), ("t_x", False),
                             ("a\x00", False)]:  # fmt: skip
            answer = await client.get("/v1/agents/assistant/turns", params={"before": value})
            if (answer.status_code == 200, fits(raw, before, value)) != (valid, valid):
                disagree.append(f"before={value!r}: {answer.status_code} {answer.text[:200]}")
    assert disagree == [], "\n".join(disagree)


# NUL cannot be stored by Postgres (neither in text nor in jsonb): a request that carries one is
# the caller's mistake, a 4xx, never a 503 that blames the database.
NUL_REQUESTS: list[tuple[str, str, dict[str, Any]]] = [
    ("GET", "/v1/agents/assistant/turns", {"params": {"sessionKey": "a\x00b"}}),
    ("GET", "/v1/agents/assistant/turns", {"params": {"before": "t\x00"}}),
    ("GET", "/v1/turns/t%00b", {}),
    ("GET", "/v1/agents/assistant/turns/t%00b", {}),
    ("GET", "/v1/agents/assistant/sessions/a%00b", {}),
    ("GET", "/v1/agents/assistant/sessions/a%00b/messages", {}),
    ("DELETE", "/v1/agents/assistant/sessions/a%00b", {}),
    ("POST", "/v1/agents/assistant/messages", {"json": {"text": "a\x00b"}}),
    ("POST", "/v1/agents/assistant/messages", {"json": {"text": "hi", "sessionKey": "a\x00"}}),
    ("POST", "/v1/agents/assistant/messages", {"json": {"text": "hi", "from": {"id": "u\x00"}}}),
    (
        "POST",
        "/v1/agents/assistant/messages",
        {"json": {"text": "hi", "deliver": {"channel": "c\x00", "to": "x"}}},
    ),
]


@pytest.mark.asyncio
async def test_a_nul_character_is_a_client_error(api: ApiServer) -> None:
    wrong = []
    async with httpx.AsyncClient(base_url=api.url) as client:
        for method, path, request_args in NUL_REQUESTS:
            response = await client.request(method, path, **request_args)
            problem = envelope_problem(response.status_code, response.content)
            if problem is not None or not 400 <= response.status_code < 500:
                wrong.append(
                    f"{method} {path} {request_args} -> {response.status_code} {response.text}"
                )
    assert wrong == [], "\n".join(wrong)


if __name__ == "__main__":
    print(json.dumps(run_job(json.loads(sys.argv[1]))))
