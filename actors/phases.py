"""Phases: which of an agent's tools its model sees, by the phase its session is in.

A manifest declares ``phases: {name: {allow: [tool | "tag:<t>" | "*"], entry?: true}}``. A
session starts in the entry phase (the one marked ``entry``, else the first declared); the
``phase_set`` tool (offered when more than one phase is declared) or ``POST …/sessions/{key}/
phase`` moves it, with a ``phase.changed`` event. Everything here is pure: the matching, the
check a manifest must pass, the fold of a session's phase from its events, and each phase's
view (its pinned prefix and the registry that checks its calls), built once at load.

The prompt cache. The provider caches a request's prefix in the order tools, system, messages,
so a different tool list re-writes everything after the first tool that differs. Each phase's
tools are therefore ordered with those every phase shows first (in catalogue order), then the
phase's own, then ``phase_set`` (its description names the current phase), and a cache
breakpoint closes the shared run: a phase change keeps the shared tools cached and re-pays the
rest, and each phase's own prefix stays cached for the sessions in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from actors.context.assemble import Pinned
from actors.tools.errors import ToolCallFailed
from actors.tools.registry import ToolRegistry
from actors.tools.spec import ToolContext, ToolSpec
from eventstore.catalogue import PhaseChanged, SessionCleared
from eventstore.event import Event, UnknownEvent

PHASE_SET = "phase_set"
ALLOW_ALL = "*"
TAG = "tag:"
_BREAKPOINT = {"type": "ephemeral"}


@dataclass(frozen=True)
class Declared:
    """One phase as the manifest declares it."""

    name: str
    allow: tuple[str, ...]
    entry: bool = False


def entry_of(declared: Sequence[Declared]) -> str:
    """Where a session starts: the phase marked ``entry``, else the first declared."""
    marked = [d.name for d in declared if d.entry]
    return marked[0] if marked else declared[0].name


def matches(entry: str, spec: ToolSpec) -> bool:
    """Whether one ``allow`` entry names this tool: ``*``, ``tag:<t>`` (one of its tags, case
    aside) or its name."""
    if entry == ALLOW_ALL:
        return True
    if entry.startswith(TAG):
        tag = entry[len(TAG) :].lower()
        return any(own.lower() == tag for own in spec.tags)
    return entry == spec.name


def visible(specs: Iterable[ToolSpec], allow: Sequence[str]) -> list[ToolSpec]:
    """The tools a phase shows, in catalogue order."""
    return [s for s in specs if any(matches(entry, s) for entry in allow)]


def unmatched(declared: Sequence[Declared], specs: Sequence[ToolSpec]) -> list[tuple[str, str]]:
    """(phase, entry) for each ``allow`` entry that names no tool of the agent: a phase that
    shows fewer tools than its author wrote fails the load, not a turn later."""
    return [
        (d.name, entry)
        for d in declared
        for entry in d.allow
        if entry != PHASE_SET and not any(matches(entry, s) for s in specs)
    ]


def evolve(phase: str | None, event: Event | UnknownEvent) -> str | None:
    """A session's phase after one of its events (None: the entry phase)."""
    match event:
        case PhaseChanged(to=to):
            return to
        case SessionCleared():
            return None
        case _:
            return phase


@dataclass(frozen=True)
class PhaseView:
    """What the model of a session in this phase is offered, and what checks its calls."""

    name: str
    pinned: Pinned
    tools: ToolRegistry


@dataclass(frozen=True)
class Phases:
    declared: tuple[Declared, ...]
    entry: str
    views: Mapping[str, PhaseView]

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.declared]

    def resolve(self, phase: str | None) -> str:
        """The phase a session is in: a stored phase the manifest no longer declares (renamed
        since) falls back to the entry phase rather than failing the turn."""
        return phase if phase is not None and phase in self.views else self.entry

    def view(self, phase: str | None) -> PhaseView:
        return self.views[self.resolve(phase)]


def build(
    declared: Sequence[Declared],
    specs: Sequence[ToolSpec],
    server: Sequence[dict[str, Any]],
    system: Pinned,
) -> Phases:
    """Every phase's view, rendered once at load (the same bytes every turn in that phase).
    ``server`` are the provider's server tools (matched by name); ``system`` the agent's pinned
    prefix, whose system blocks every phase shares."""
    entry = entry_of(declared)
    names = [d.name for d in declared]
    switch = len(declared) > 1
    shown = {d.name: visible(specs, d.allow) for d in declared}
    shown_server = {d.name: [t for t in server if _server_allowed(t, d.allow)] for d in declared}
    every = set.intersection(*({s.name for s in v} for v in shown.values()))
    views: dict[str, PhaseView] = {}
    for d in declared:
        common = [s for s in shown[d.name] if s.name in every]
        own = [s for s in shown[d.name] if s.name not in every]
        tools = [*common, *own]
        if switch:
            tools.append(phase_set_tool(names, d.name, _adds(shown, d.name)))
        registry = ToolRegistry(tools)
        definitions = list(registry.definitions())  # shared by the registry: not changed
        if switch and common and len(definitions) > len(common):
            # The breakpoint on the last tool every phase shows (see the module's docstring).
            last = len(common) - 1
            definitions[last] = {**definitions[last], "cache_control": _BREAKPOINT}
        pinned = Pinned(system=system.system, tools=[*definitions, *shown_server[d.name]])
        views[d.name] = PhaseView(d.name, pinned, registry)
    return Phases(tuple(declared), entry, views)


def _server_allowed(tool: dict[str, Any], allow: Sequence[str]) -> bool:
    return any(entry in (ALLOW_ALL, tool.get("name")) for entry in allow)


def _adds(shown: Mapping[str, list[ToolSpec]], current: str) -> dict[str, int]:
    """How many tools each other phase adds to this one: counts, not names, so the model has
    a reason to move and no hidden tool to call."""
    here = {s.name for s in shown[current]}
    return {
        name: sum(1 for s in specs if s.name not in here)
        for name, specs in shown.items()
        if name != current
    }


def phase_set_tool(names: Sequence[str], current: str, adds: Mapping[str, int]) -> ToolSpec:
    """The built-in that moves the session to another phase; its effect is the turn's next
    model call (the tools it sees change then, within the same turn)."""
    others = ", ".join(f"{n} (+{k} tools)" for n, k in adds.items())
    description = (
        f'You are in the "{current}" phase. This moves the conversation to another phase, '
        f"which changes the tools you have from your next reply on. Other phases: {others}. "
        "Move only when the tool you need is not in this phase."
    )

    async def run(args: dict[str, Any], ctx: ToolContext) -> str:
        to = args.get("phase")
        if not isinstance(to, str) or to not in names:
            raise ToolCallFailed(f"no phase {to!r}: call phase_set with one of "
                                 f"{', '.join(names)}", "phase_unknown")  # fmt: skip
        switch = ctx.phases
        if switch is None:
            raise ToolCallFailed("this call runs outside a turn that has a phase: phase_set "
                                 "cannot move it", "phase_not_available")  # fmt: skip
        count = await switch.set(to)
        return f"Now in the {to!r} phase: {count} tools, in effect from your next reply."

    schema = {
        "type": "object",
        "properties": {"phase": {"type": "string", "enum": list(names),
                                 "description": "The phase to move to."}},
        "required": ["phase"],
        "additionalProperties": False,
    }  # fmt: skip
    return ToolSpec(name=PHASE_SET, description=description, input_schema=schema,
                    mutating=False, run=run)  # fmt: skip
