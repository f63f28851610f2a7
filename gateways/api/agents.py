"""The agents of API v1: the list a token may reach, one agent, its tools and skills, its
reload, stop and start; and the cluster the node reads (``GET /v1/cluster``)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors.messages import ClusterStatus, Refused
from gateways.api.common import (
    AgentChange,
    ApiError,
    agent,
    decode_body,
    not_ready,
    principal,
    read_body,
    refused,
    runtime,
)
from gateways.api.schemas import (
    AgentChangeBody,
    AgentDetail,
    AgentInfo,
    AgentState,
    SkillList,
    ToolInfo,
)
from gateways.http.errors import json_response
from gateways.http.operation import AGENT, Operation, answer, array


async def list_agents(request: Request) -> Response:
    who = principal(request)
    agents = [
        AgentInfo(
            id=a.id,
            name=a.name,
            status=a.status,
            model=a.model,
            provider=a.provider,
            phase=a.phase,
            version=a.version,
            disabled_at=a.disabled_at,
            disabled_by=a.disabled_by,
            reason=a.reason,
            addressable=a.addressable,
            member_of=a.member_of,
        )
        for a in runtime(request).agent_details().values()
        if who.sees(a.id)
    ]
    return json_response(agents)


LIST_AGENTS = Operation(
    "GET",
    "/v1/agents",
    list_agents,
    "Agents this token can reach",
    {"200": answer(array(AgentInfo), "Agents")},
    errors=("401",),
)


async def cluster(request: Request) -> Response:
    """``GET /v1/cluster``: nodes, the partitions each holds, epochs and lease ages."""
    status = runtime(request).cluster_status()
    if status is None:
        raise not_ready()
    return json_response(status)


CLUSTER = Operation(
    "GET",
    "/v1/cluster",
    cluster,
    "The cluster: nodes, the partitions each owns, lease epochs and ages",
    {"200": answer(ClusterStatus, "The lease bucket as this node reads it")},
    errors=("401", "503"),
)


async def get_agent(request: Request) -> Response:
    return json_response(agent(request))


GET_AGENT = Operation(
    "GET", "/v1/agents/{agent}", get_agent, "One agent", {"200": answer(AgentDetail, "The agent")},
    params=[AGENT],
)  # fmt: skip


async def agent_tools(request: Request) -> Response:
    """``GET …/tools``: the agent's tools as v1 lists them, with their policy and timeout."""
    return json_response(agent(request).tool_list)


AGENT_TOOLS = Operation(
    "GET",
    "/v1/agents/{agent}/tools",
    agent_tools,
    "The agent's tools, in the order the model reads them",
    {"200": answer(array(ToolInfo), "Tools")},
    params=[AGENT],
)


async def agent_skills(request: Request) -> Response:
    """``GET …/skills``: the agent's skills as this node loaded them, and how a turn selects
    them (``supported: true``: v1 0.1.0 answered false, having none)."""
    found = agent(request)
    skills = runtime(request).skills(found.id)
    if skills is None:  # loaded a moment ago and gone since: answered as any unknown agent
        raise ApiError(404, "agent_not_found", f"no agent {found.id!r} on this node",
                       "GET /v1/agents lists the agents", "agent")  # fmt: skip
    return json_response(skills)


AGENT_SKILLS = Operation(
    "GET",
    "/v1/agents/{agent}/skills",
    agent_skills,
    "The agent's skills (id, title, description, tokens) and how each turn selects them and "
    "recalls the session's notes",
    {"200": answer(SkillList, "Skills and their selection")},
    params=[AGENT],
)


async def reload_agent(request: Request) -> Response:
    """``POST …/reload``: the manifest read again from the disk of the node asked, validated
    (a broken one is ``400`` with the manifest's error, and nothing changes), recorded as
    ``agent.reloaded`` and swapped in for new turns on every node; running turns finish on the
    version they started with."""
    return await _change(request, "reload")


async def stop_agent(request: Request) -> Response:
    """``POST …/stop``: disable the agent on every node, durably (``agent.stopped``): new
    messages on every door are refused ``409 agent_stopped``; running turns finish."""
    return await _change(request, "stop")


async def start_agent(request: Request) -> Response:
    """``POST …/start``: a stopped agent takes messages again (``agent.started``)."""
    return await _change(request, "start")


async def _change(request: Request, kind: AgentChange) -> Response:
    found = agent(request)
    body: AgentChangeBody = decode_body(await read_body(request), AgentChangeBody)
    if runtime(request).commands is None:
        raise not_ready()
    result = await runtime(request).change_agent(kind, found.id, body.by or "api", body.reason)
    if isinstance(result, Refused):
        raise refused(result)
    return json_response(result)


def _operation(kind: AgentChange, handler: Any, summary: str, ok: str) -> Operation:
    return Operation(
        "POST",
        f"/v1/agents/{{agent}}/{kind}",
        handler,
        summary,
        {"200": answer(AgentState, ok)},
        params=[AGENT],
        body=AgentChangeBody,
        body_required=False,
        errors=("400", "401", "404", "503"),
    )


RELOAD_AGENT = _operation(
    "reload",
    reload_agent,
    "Read the agent's manifest again and run it for new turns on every node (running turns "
    "finish on theirs)",
    "Reloaded: `agent.reloaded` is in the log",
)
STOP_AGENT = _operation(
    "stop",
    stop_agent,
    "Disable the agent on every node: new messages get `409 agent_stopped`",
    "Stopped (or already stopped: `changed: false`)",
)
START_AGENT = _operation(
    "start", start_agent, "Enable a stopped agent on every node", "Started (or already taking "
    "messages)",
)  # fmt: skip
