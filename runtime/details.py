"""How the API shows a loaded agent (``GET /v1/agents/{id}``): its resource built from the agent
the node runs."""

from __future__ import annotations

import msgspec

from actors.agent import Agent
from gateways.api.schemas import AgentDetail, ToolInfo
from gateways.model.scripted import ScriptedModel


def agent_detail(agent: Agent) -> AgentDetail:
    """How the API shows an agent: the model it really runs (the offline scripted model says
    so, not the manifest's model id it stands in for)."""
    tools = [
        ToolInfo(
            slug=name,
            summary=(spec.description or "").split("\n", 1)[0],
            mutating=spec.mutating,
            trust="untrusted" if spec.untrusted_output else "trusted",
            provider=f"mcp:{spec.mcp_server}" if spec.mcp_server else "local",
            policy=spec.policy,
            timeout_s=agent.limits.tool_timeout_s if spec.timeout_s is None else spec.timeout_s,
        )
        for name in agent.tools.names
        if (spec := agent.tools.get(name)) is not None
    ]
    return AgentDetail(
        id=agent.id,
        name=agent.name,
        status="loaded",
        model=agent.model.label if isinstance(agent.model, ScriptedModel) else agent.model_id,
        provider=agent.model.label,
        tools=len(tools),
        tool_list=tools,
        skills=len(agent.recall.skills),
        concurrency=agent.concurrency,
        limits=msgspec.to_builtins(agent.limits),
        max_output_tokens=agent.max_tokens_per_call,
        phase=None if agent.phases is None else agent.phases.entry,
        entry_phase=None if agent.phases is None else agent.phases.entry,
        phases={} if agent.phases is None else
        {name: len(view.tools.names) for name, view in agent.phases.views.items()},
        members=list(agent.members),
        addressable=agent.addressable,
    )  # fmt: skip
