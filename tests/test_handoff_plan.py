"""Teams without services: the manifest checks at load (members that exist, artifact schemas
that are JSON Schemas, no cycle), who is addressable, and the pure decisions of a handoff
(reading an artifact, each round's budget, what a member turn's end means)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.handoff import plan
from actors.handoff.plan import Member
from actors.turn.core import Limits, TurnState, bounded, remaining
from eventstore.catalogue import Budget, Tokens, TurnEnd
from runtime.manifest import ManifestError, load_all

SCHEMA = "{type: object, properties: {total: {type: number}}, required: [total]}"


def team(tmp_path: Path, **manifests: str) -> Path:
    agents = tmp_path / "agents"
    agents.mkdir()
    for agent_id, text in manifests.items():
        (agents / f"{agent_id}.yaml").write_text(f"id: {agent_id}\n{text}")
    return agents


def members(*ids: str, schema: str = SCHEMA) -> str:
    lines = [f"  {i}: {{description: does {i}, artifact: {schema}}}" for i in ids]
    return "members:\n" + "\n".join(lines) + "\n"


def test_a_supervisor_gets_the_handoff_tool_and_its_member_is_not_addressable(
    tmp_path: Path,
) -> None:
    agents = load_all(team(tmp_path, boss=members("adder"), adder="", other="addressable: false\n"))
    assert "handoff" in agents["boss"].tools.names
    assert "handoff" not in agents["adder"].tools.names  # nesting must be declared
    assert agents["boss"].members == ("adder",)
    assert agents["boss"].addressable and not agents["adder"].addressable
    assert not agents["other"].addressable  # said so itself
    spec = agents["boss"].tools.get("handoff")
    assert spec is not None and spec.untrusted_output and not spec.mutating
    assert spec.input_schema["properties"]["member"]["enum"] == ["adder"]
    assert "adder: does adder" in spec.description


def test_a_member_may_say_it_is_addressable(tmp_path: Path) -> None:
    agents = load_all(team(tmp_path, boss=members("adder"), adder="addressable: true\n"))
    assert agents["adder"].addressable


@pytest.mark.parametrize(
    ("manifests", "field", "fragment"),
    [
        ({"boss": members("ghost")}, "members.ghost", "member 'ghost' is not an agent"),
        ({"boss": members("boss")}, "members.boss", "lists itself"),
        (
            {"boss": members("adder", schema="{type: 12}"), "adder": ""},
            "members.adder.artifact",
            "not a valid JSON Schema",
        ),
        (
            {"a": members("b"), "b": members("c"), "c": members("a")},
            "members",
            "a -> b -> c -> a",
        ),
        (
            {"boss": members("adder") + "tools: [{name: handoff, module: x:y, "
             "input_schema: {type: object}}]\n", "adder": ""},
            "tools",
            "a tool of its own named 'handoff'",
        ),
        ({"boss": "members: {adder: {description: x}}\n", "adder": ""}, "members",
         "missing required field `artifact`"),
    ],
    ids=["unknown", "itself", "bad-schema", "cycle", "own-handoff", "no-artifact"],
)  # fmt: skip
def test_teams_are_checked_at_load(
    tmp_path: Path, manifests: dict[str, str], field: str, fragment: str
) -> None:
    with pytest.raises(ManifestError) as caught:
        load_all(team(tmp_path, **manifests))
    assert caught.value.field is not None and caught.value.field.startswith(field)
    assert fragment in str(caught.value)
    assert caught.value.hint


ADDER = Member("adder", "adds", {"type": "object", "properties": {"total": {"type": "number"}},
                                 "required": ["total"], "additionalProperties": False})  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "artifact", "errors"),
    [
        ('{"total": 5}', {"total": 5}, []),
        ('```json\n{"total": 5}\n```', {"total": 5}, []),
        ("  \n", None, ["$: the reply is empty, not a JSON value"]),
        ('{"total": "5", "x": 1}', {"total": "5", "x": 1},
         ["$: Additional properties are not allowed ('x' was unexpected)",
          "total: '5' is not of type 'number'"]),
    ],
)  # fmt: skip
def test_a_reply_is_read_as_an_artifact(reply: str, artifact: object, errors: list[str]) -> None:
    assert plan.read_artifact(reply, ADDER) == (artifact, errors)


def test_prose_is_not_an_artifact() -> None:
    artifact, errors = plan.read_artifact("The total is 5.", ADDER)
    assert artifact is None and errors[0].startswith("$: the reply is not JSON")


def test_the_member_is_told_the_task_the_context_and_the_schema() -> None:
    text = plan.task_text("add 2 and 3", "  the numbers are exact  ", ADDER)
    assert text.startswith("add 2 and 3\n\nContext from the supervisor:\nthe numbers are exact")
    assert '"required":["total"]' in text
    assert "Context" not in plan.task_text("add", None, ADDER)
    assert "total: wrong" in plan.repair_text(["total: wrong"])


def test_what_the_parent_has_left_bounds_the_member_turn() -> None:
    state = TurnState(steps=3, output_tokens=900)
    left = remaining(state, Limits(max_steps=5, turn_timeout_s=60, max_output_tokens=1000), 20.0)
    assert left == Budget(max_steps=2, turn_timeout_s=40.0, max_output_tokens=100)
    own = Limits(max_steps=8, turn_timeout_s=30, max_output_tokens=32_000)
    assert bounded(own, left) == Limits(max_steps=2, turn_timeout_s=30, max_output_tokens=100)
    assert bounded(own, None) == own
    # A repair round gets what the first round left; a bound never given stays unbounded.
    assert plan.after_round(left, 1, 60, 15.0) == Budget(max_steps=1, turn_timeout_s=25.0,
                                                         max_output_tokens=40)  # fmt: skip
    assert plan.after_round(Budget(), 3, 5, 1.0) == Budget()


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [("final", None), ("timeout", "timeout"), ("max_steps", "budget"),
     ("output_limit", "budget"), ("truncated", "budget"), ("error", "error"),
     ("stopped", "error"), ("refused", "error")],
)  # fmt: skip
def test_what_a_member_turns_end_means(reason: str, outcome: str | None) -> None:
    end = TurnEnd(reason=reason, steps=1, tokens=Tokens(), duration_ms=1)  # type: ignore[arg-type]
    assert plan.end_outcome(end) == outcome


def test_the_cost_is_every_member_turn_summed() -> None:
    ends = [TurnEnd(reason="final", steps=s, tokens=Tokens(prompt=10 * s, output=s),
                    duration_ms=1) for s in (2, 1)]  # fmt: skip
    assert plan.cost(ends) == (3, Tokens(prompt=30, output=3))
