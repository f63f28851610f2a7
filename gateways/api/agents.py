"""The agents of API v1: the list a token may reach, one agent, its tools and skills, the
refused reload; and the cluster the node reads (``GET /v1/cluster``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from actors.messages import ClusterStatus
from gateways.api.common import ApiError, agent, not_ready, principal, runtime
from gateways.api.schemas import AgentDetail, AgentInfo, SkillList, ToolInfo
from gateways.http.errors import ErrorEnvelope, json_response
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
    """``POST …/reload``: refused, as v1 0.1.0 refuses it. An agent is built once per node
    start; its pinned prompt prefix (instructions, tools) must stay byte-stable for the
    provider's cache and for every session's turns, so a live reload would change a
    conversation under it. A restart (or a rolling restart of the cluster) loads the manifest."""
    found = agent(request)
    raise ApiError(
        501,
        "reload_not_supported",
        f"agent {found.id!r} cannot be reloaded while the node runs: an agent's manifest is "
        "read once, at the node's start",
        "restart the node to load a changed manifest; in a cluster, roll it: start nodes with "
        "the new manifest, then stop the old ones one by one (SIGTERM drains them)",
    )


RELOAD_AGENT = Operation(
    "POST",
    "/v1/agents/{agent}/reload",
    reload_agent,
    "Reload the agent's manifest: refused (an agent is built once per node start)",
    {"501": answer(ErrorEnvelope, "`reload_not_supported`: restart the node")},
    params=[AGENT],
    errors=("401", "404", "503"),
)
