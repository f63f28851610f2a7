"""Teams in manifests: a supervisor's ``members``, checked across every manifest at load, and
the ``handoff`` tool built for it (actors/handoff/).

A member is a normal agent (``agents/<id>.yaml``). Being a member makes an agent not
addressable from outside (HTTP, WebSocket, NATS ingress, schedules, channels: its work
comes through its supervisor) unless its manifest says
``addressable: true``; an agent that is no one's member is addressable unless it says
``addressable: false``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jsonschema
from jsonschema.exceptions import SchemaError

from actors.handoff import Handoffs, Member, handoff_tool
from actors.tools import StaticSource, ToolSource
from gateways.manifests import ManifestError
from runtime.manifest_schema import Manifest

HANDOFF = "handoff"


def check(manifests: Mapping[str, Manifest]) -> None:
    """Every team is sound: its members exist and are not the supervisor, each artifact schema
    is a JSON Schema, no agent is its own member through others, and no own tool of a
    supervisor takes the name ``handoff``."""
    for manifest in manifests.values():
        for member_id, member in manifest.members.items():
            where = f"members.{member_id}"
            if member_id == manifest.id:
                raise ManifestError(f"agent {manifest.id!r} lists itself as a member",
                                    "remove it from members", field=where)  # fmt: skip
            if member_id not in manifests:
                known = ", ".join(sorted(set(manifests) - {manifest.id})) or "none"
                raise ManifestError(
                    f"agent {manifest.id!r}: member {member_id!r} is not an agent",
                    f"add agents/{member_id}.yaml, or use one of: {known}", field=where,
                )  # fmt: skip
            try:
                jsonschema.Draft202012Validator.check_schema(member.artifact)
            except SchemaError as e:
                raise ManifestError(
                    f"agent {manifest.id!r}: the artifact of member {member_id!r} is not a "
                    f"valid JSON Schema: {e.message}",
                    "give a JSON Schema (draft 2020-12) object under artifact",
                    field=f"{where}.artifact",
                ) from e
        own = {t if isinstance(t, str) else t.name for t in manifest.tools}
        if manifest.members and HANDOFF in own:
            raise ManifestError(
                f"agent {manifest.id!r} has members and a tool of its own named {HANDOFF!r}",
                "rename the tool: a supervisor's handoff tool is the engine's", field="tools",
            )  # fmt: skip
    cycle = _cycle(manifests)
    if cycle:
        raise ManifestError(
            "agents hand off to each other in a cycle: " + " -> ".join(cycle),
            "a member may not be, through its own members, a supervisor of its supervisor",
            field="members",
        )


def _cycle(manifests: Mapping[str, Manifest]) -> list[str]:
    """A path of member links that comes back to where it began, or [] (depth first, each
    agent's members in their declared order, so the path named is stable)."""
    done: set[str] = set()

    def visit(agent_id: str, path: list[str]) -> list[str]:
        if agent_id in path:
            return [*path[path.index(agent_id) :], agent_id]
        if agent_id in done or agent_id not in manifests:
            return []
        for member_id in manifests[agent_id].members:
            found = visit(member_id, [*path, agent_id])
            if found:
                return found
        done.add(agent_id)
        return []

    for agent_id in manifests:
        found = visit(agent_id, [])
        if found:
            return found
    return []


def members_of(manifests: Mapping[str, Manifest]) -> set[str]:
    """The agents that are some supervisor's members."""
    return {member for m in manifests.values() for member in m.members}


def supervisors(teams: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Each member's supervisors, sorted, from each agent's members (agents in no team are
    left out)."""
    found: dict[str, list[str]] = {}
    for supervisor, members in sorted(teams.items()):
        for member in members:
            found.setdefault(member, []).append(supervisor)
    return found


def addressable(manifest: Manifest, members: set[str]) -> bool:
    """Whether messages may reach the agent from outside (see the module's doc)."""
    if manifest.addressable is not None:
        return manifest.addressable
    return manifest.id not in members


def sources(manifest: Manifest, port: Handoffs) -> list[ToolSource]:
    """The supervisor's ``handoff`` tool (none for an agent without members)."""
    if not manifest.members:
        return []
    members = {
        member_id: Member(member_id, config.description, config.artifact)
        for member_id, config in manifest.members.items()
    }
    tool = handoff_tool(members, port, manifest.limits.turn_timeout_s)
    return [StaticSource("team", [tool])]
