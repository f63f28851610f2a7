"""``/v1/agents/{agent}/schedules``: list, create, read, replace, delete, and run now.

Definitions are checked when they are written (a bad cron expression, a missing delivery, an
unknown channel: 400 with the field and a hint); the scheduler actor appends them. Schedules a
manifest declares belong to the manifest (409 ``schedule_manifest_owned``): edit the file.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.actor import ask
from actors.messages import Accepted, DefineSchedule, RemoveSchedule, RunSchedule
from actors.schedule.plan import ScheduleSpec, next_due, problems
from eventstore import NO_STREAM, StoreError, WrongExpectedVersion
from eventstore.catalogue import Deliver
from gateways.api.common import (
    ApiError,
    agent,
    decode_body,
    fetch,
    not_addressable,
    read_body,
    refused,
    runtime,
    store_error,
)
from gateways.api.schemas import AcceptedBody, AgentDetail
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, Operation, answer, param

_ASK_TIMEOUT = 10.0


class ScheduleResource(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    id: str
    kind: str
    expr: str
    timezone: str | None
    task: str
    deliver: Deliver | Literal["none"] | None
    session: str
    enabled: bool
    owner: str
    next_due: str | None
    last_due: str | None
    last_fired_at: str | None
    last_turn_id: str | None
    fired: int
    skipped: int
    created_at: str
    updated_at: str


class ScheduleList(msgspec.Struct, frozen=True):
    schedules: list[ScheduleResource]


class Deleted(msgspec.Struct, frozen=True):
    deleted: str


async def list_schedules(request: Request) -> Response:
    target = agent(request)
    rows = await _rows(request, target.id, None)
    if request.query_params.get("enabled") == "true":
        rows = [r for r in rows if r.enabled]
    return json_response(ScheduleList([r.resource for r in rows]))


SCHEDULE = param("schedule", "path", "Schedule id")
LIST_SCHEDULES = Operation(
    "GET",
    "/v1/agents/{agent}/schedules",
    list_schedules,
    "Schedules of the agent (manifest and API), with their next due time",
    {"200": answer(ScheduleList, "Schedules")},
    params=[AGENT, param("enabled", "query", "`true`: only enabled ones", required=False)],
)


async def get_schedule(request: Request) -> Response:
    target = agent(request)
    return json_response(await _one(request, target.id, request.path_params["schedule"]))


GET_SCHEDULE = Operation(
    "GET",
    "/v1/agents/{agent}/schedules/{schedule}",
    get_schedule,
    "One schedule",
    {"200": answer(ScheduleResource, "The schedule")},
    params=[AGENT, SCHEDULE],
)


async def create_schedule(request: Request) -> Response:
    target = _addressable(request)
    spec = _checked(request, target.id, await read_body(request))
    if await _rows(request, target.id, spec.id):
        again = f"PUT /v1/agents/{target.id}/schedules/{spec.id} replaces it"
        raise ApiError(409, "schedule_exists", f"schedule {spec.id!r} exists", again, "id")
    await _change(request, DefineSchedule(agent_id=target.id, spec=spec, owner="api",
                                          expected=NO_STREAM))  # fmt: skip
    return json_response(await _one(request, target.id, spec.id), 201)


CREATE_SCHEDULE = Operation(
    "POST",
    "/v1/agents/{agent}/schedules",
    create_schedule,
    "Create a schedule (checked now: expression, time zone, delivery)",
    {"201": answer(ScheduleResource, "Created")},
    params=[AGENT],
    body=ScheduleSpec,
    errors=("400", "401", "403", "404", "409", "503"),
)


async def replace_schedule(request: Request) -> Response:
    target = _addressable(request)
    sid = request.path_params["schedule"]
    await _writable(request, target.id, sid)
    spec = _checked(request, target.id, await read_body(request), sid)
    await _change_current(request, target.id, sid, lambda version: DefineSchedule(
        agent_id=target.id, spec=spec, owner="api", expected=version))  # fmt: skip
    return json_response(await _one(request, target.id, sid))


REPLACE_SCHEDULE = Operation(
    "PUT",
    "/v1/agents/{agent}/schedules/{schedule}",
    replace_schedule,
    "Replace an API-made schedule (its whole definition)",
    {"200": answer(ScheduleResource, "Replaced")},
    params=[AGENT, SCHEDULE],
    body=ScheduleSpec,
    errors=("400", "401", "403", "404", "409", "503"),
)
# The same operation: a whole definition either way.
PATCH_SCHEDULE = dataclasses.replace(REPLACE_SCHEDULE, method="PATCH")


async def delete_schedule(request: Request) -> Response:
    target = agent(request)
    sid = request.path_params["schedule"]
    await _change_current(request, target.id, sid, lambda version: RemoveSchedule(
        agent_id=target.id, schedule_id=sid, expected=version))  # fmt: skip
    return json_response(Deleted(sid))


DELETE_SCHEDULE = Operation(
    "DELETE",
    "/v1/agents/{agent}/schedules/{schedule}",
    delete_schedule,
    "Delete an API-made schedule",
    {"200": answer(Deleted, "Deleted")},
    params=[AGENT, SCHEDULE],
    errors=("401", "404", "409", "503"),
)


async def run_schedule(request: Request) -> Response:
    target = _addressable(request)
    sid = request.path_params["schedule"]
    await _one(request, target.id, sid)
    run = RunSchedule(agent_id=target.id, schedule_id=sid)
    running = await ask(_scheduler(request), run, _ASK_TIMEOUT)  # the run's task
    result = await asyncio.wait_for(running, _ASK_TIMEOUT)
    if not isinstance(result, Accepted):
        raise refused(result)
    return json_response(AcceptedBody(turn_id=result.turn_id, session_key=result.session_key),
                         202)  # fmt: skip


RUN_SCHEDULE = Operation(
    "POST",
    "/v1/agents/{agent}/schedules/{schedule}/run",
    run_schedule,
    "Fire the schedule now, out of band (its clock is not moved)",
    {"202": answer(AcceptedBody, "Accepted")},
    params=[AGENT, SCHEDULE],
    errors=("400", "401", "403", "404", "503"),
)


# --- helpers -----------------------------------------------------------------------------------


def _addressable(request: Request) -> AgentDetail:
    """The path's agent, refused (403 agent_not_addressable) when it takes work only from its
    team's supervisor: a tick of its schedule would be skipped every time (actors/schedule/)."""
    target = agent(request)
    if (problem := not_addressable(target)) is not None:
        raise refused(problem)
    return target


class _Row(msgspec.Struct, frozen=True):
    resource: ScheduleResource
    owner: str
    version: int

    @property
    def enabled(self) -> bool:
        return self.resource.enabled


def _checked(
    request: Request, agent_id: str, raw: bytes, path_id: str | None = None
) -> ScheduleSpec:
    spec: ScheduleSpec = decode_body(raw, ScheduleSpec)
    if path_id is not None and spec.id != path_id:
        raise ApiError(400, "schedule_invalid", f"the body's id {spec.id!r} is not {path_id!r}",
                       "a schedule keeps its id; create a new one for a new id", "id")  # fmt: skip
    problem = problems(spec, now=datetime.now(UTC))
    if problem is not None:
        raise ApiError(400, problem.code, problem.message, problem.hint, problem.field)
    deliver = spec.deliver
    if not isinstance(deliver, Deliver):
        return spec
    channel = runtime(request).channel(agent_id, deliver.channel)
    if channel is None:
        raise ApiError(400, "deliver_invalid", f"agent {agent_id!r} has no channel "
                       f"{deliver.channel!r}", "name a channel the agent's manifest declares, or "
                       'set deliver to "none"', "deliver.channel")  # fmt: skip
    problem_text = channel.target_problem(deliver.to, deliver.thread)
    if problem_text is not None:
        hint = f"name a recipient the {channel.type} channel can reach"
        raise ApiError(400, "deliver_invalid", problem_text, hint, "deliver.to")
    return spec


async def _writable(request: Request, agent_id: str, sid: str) -> _Row:
    rows = await _rows(request, agent_id, sid)
    if not rows:
        raise _not_found(agent_id, sid)
    if rows[0].owner == "manifest":
        raise ApiError(409, "schedule_manifest_owned", f"schedule {sid!r} is declared in the "
                       "agent's manifest", f"edit schedules: in agents/{agent_id}.yaml and "
                       "restart the node")  # fmt: skip
    return rows[0]


async def _change(request: Request, change: DefineSchedule | RemoveSchedule) -> None:
    committed = await ask(_scheduler(request), change, _ASK_TIMEOUT)  # the change's task
    try:
        await asyncio.wait_for(committed, _ASK_TIMEOUT)
    except WrongExpectedVersion as e:
        raise ApiError(409, "schedule_conflict", "the schedule changed while this request ran",
                       "read it again and retry") from e  # fmt: skip
    except StoreError as e:
        raise store_error(e) from e


async def _change_current(
    request: Request,
    agent_id: str,
    sid: str,
    change: Callable[[int], DefineSchedule | RemoveSchedule],
) -> None:
    """Replace or remove a schedule as it is now. A tick of its clock appends to the same stream
    (schedule.fired), which moves the version without changing the definition: the change is
    made again on a fresh read rather than refused."""
    for attempt in range(3):
        current = await _writable(request, agent_id, sid)
        try:
            await _change(request, change(current.version))
        except ApiError as e:
            if e.code != "schedule_conflict" or attempt == 2:
                raise
        else:
            return


def _scheduler(request: Request) -> Any:
    scheduler = runtime(request).scheduler
    if scheduler is None:
        raise ApiError(503, "not_ready", "the scheduler is not running yet", "retry shortly")
    return scheduler


async def _one(request: Request, agent_id: str, sid: str) -> ScheduleResource:
    rows = await _rows(request, agent_id, sid)
    if not rows:
        raise _not_found(agent_id, sid)
    return rows[0].resource


async def _rows(request: Request, agent_id: str, sid: str | None) -> list[_Row]:
    found = await fetch(request, "schedules", {"agent": agent_id, "id": sid})
    now = datetime.now(UTC)
    out = []
    for (schedule_id, spec_text, owner, created, updated, last_due, last_fired, last_turn,
         fired, skipped, version) in found:  # fmt: skip
        spec = msgspec.json.decode(spec_text, type=ScheduleSpec)
        after = max(now, last_due) if last_due is not None else now
        upcoming = next_due(spec, after, anchor=created) if spec.enabled else None
        out.append(_Row(ScheduleResource(
            id=schedule_id, kind=spec.kind, expr=spec.expr, timezone=spec.timezone,
            task=spec.task, deliver=spec.deliver, session=spec.session, enabled=spec.enabled,
            owner=owner, next_due=_iso(upcoming), last_due=_iso(last_due),
            last_fired_at=_iso(last_fired), last_turn_id=last_turn, fired=fired,
            skipped=skipped, created_at=_iso(created) or "", updated_at=_iso(updated) or "",
        ), owner, version))  # fmt: skip
    return out


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _not_found(agent_id: str, sid: str) -> ApiError:
    return ApiError(404, "schedule_not_found", f"no schedule {sid!r} on agent {agent_id!r}",
                    f"GET /v1/agents/{agent_id}/schedules lists them")  # fmt: skip
