"""Skills and memory recall (issue 36, part 3): an agent's skill files are loaded with it and
indexed in Postgres; each turn, before its first model call, the skills and the session's notes
whose words match the input and the previous reply are selected by full-text rank, within
their bounds, recorded as ``skill.selected`` / ``skill.none`` and sent to the model. Against a
real node, Postgres and NATS, with the fake Anthropic server recording what the model got."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from actors.recall import MEMORY_HEADER, SKILLS_HEADER, Candidate, choose
from actors.turn.core import attempts
from eventstore import EventStore, RecordedEvent, streams, subjects
from eventstore.catalogue import SkillNone, SkillSelected, ToolCall, TurnEnd
from eventstore.recall import MAX_WORDS, query_text
from gateways.manifests import ManifestError
from runtime import skills
from runtime.manifest import decode
from tests import fakes
from tests.conftest import ApiFactory, NodeFactory, Servers
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_turn_crash import accept_when_serving, resumed, serve, serve_env, wait_for
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic
KEY_ENV = "DISPACH_TEST_ANTHROPIC_KEY"

RELEASE = """---
name: Release notes
description: Draft release notes and a changelog from a range of git commits.
---
<!-- authoring note, never sent -->
RELEASE-BODY: group the commits by change type, breaking changes first.
"""
CSV = """---
name: csv-profile
description: Profile a CSV file, its columns, types and missing values.
---
CSV-BODY: read the header, then count the empty cells per column.
"""
INCIDENT = """# Incident timeline

Build the timeline of an outage from logs and alerts.

INCIDENT-BODY: order the alerts by time, then mark when it was detected and fixed.
"""


def manifest(fake: FakeAnthropic, extra: str = "") -> str:
    return f"""
id: helper
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {fake.url}
  api_key_env: {KEY_ENV}
  max_output_tokens: 1024
instructions:
  - You are a careful test agent.
tools: [session_notes]
{extra}
"""


def write_skills(root: Path, files: dict[str, str]) -> Path:
    where = root / "agents" / "helper" / "skills"
    for name, text in files.items():
        path = where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return where


SKILLS = {"release-notes.md": RELEASE, "csv-profile/SKILL.md": CSV, "incident.md": INCIDENT}


def sent(fake: FakeAnthropic, index: int) -> str:
    """Everything the model got in one request (system and messages), as text."""
    body = fake.message_requests()[index].body
    return json.dumps({"system": body.get("system"), "messages": body["messages"]})


def recall_of(events: list[RecordedEvent]) -> list[SkillSelected | SkillNone]:
    return [e.data for e in events if isinstance(e.data, SkillSelected | SkillNone)]


def input_message(fake: FakeAnthropic, index: int) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = fake.message_requests()[index].body["messages"][-1]["content"]
    return content


# --- pure parts --------------------------------------------------------------------------------


def test_the_query_is_any_of_the_words_of_the_input_then_the_reply() -> None:
    assert query_text("Write the release-notes, or not!", "Notes again") == (
        "write or the or release or notes or not or again"
    )
    assert query_text('"quoted" -minus') == "quoted or minus"  # never the query language's
    assert len(query_text(" ".join(f"w{i}" for i in range(500))).split(" or ")) == MAX_WORDS
    assert query_text("", "") == ""


def test_choose_takes_the_best_that_fit_count_and_tokens() -> None:
    ranked = [Candidate("a", 0.9, "x" * 400), Candidate("b", 0.8, "y" * 4000),
              Candidate("c", 0.5, "z" * 40), Candidate("d", 0.1, "w" * 40)]  # fmt: skip
    taken = choose(ranked, "header", max_count=2, max_tokens=200)
    assert [c.key for c, _ in taken] == ["a", "c"]  # b is too large for what is left
    assert [t for _, t in taken] == [100, 10]
    assert choose(ranked, "header", max_count=0, max_tokens=10_000) == []


def test_a_skill_file_with_front_matter_or_a_heading(tmp_path: Path) -> None:
    release = skills.parse("release-notes", RELEASE, "release-notes.md")
    assert (release.title, release.description) == (
        "Release notes", "Draft release notes and a changelog from a range of git commits."
    )  # fmt: skip
    assert release.body.startswith("RELEASE-BODY") and "authoring" not in release.body
    incident = skills.parse("incident", INCIDENT, "incident.md")
    assert incident.title == "Incident timeline"
    assert incident.description == "Build the timeline of an outage from logs and alerts."
    assert incident.body.startswith("Build the timeline") and "# Incident" not in incident.body
    assert release.digest != skills.parse("release-notes", RELEASE + "more", "x").digest


def test_a_skill_that_could_never_be_chosen_rightly_fails_the_load(tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    write_skills(tmp_path, {"bare.md": "just a body\n\n# and a late heading\n"})
    write_skills(tmp_path, {"Bad Name.md": RELEASE})
    with pytest.raises(ManifestError, match="has a name that is not"):
        skills.load(decode("id: helper\n", "helper.yaml"), agents)
    (agents / "helper" / "skills" / "Bad Name.md").unlink()
    write_skills(tmp_path, {"empty.md": "---\nname: empty\n---\n"})
    with pytest.raises(ManifestError, match="has no description"):
        skills.load(decode("id: helper\n", "helper.yaml"), agents)
    (agents / "helper" / "skills" / "empty.md").unlink()
    loaded = skills.load(decode("id: helper\n", "helper.yaml"), agents)
    assert [s.id for s in loaded.skills] == ["bare"] and loaded.skills[0].title == "bare"
    with pytest.raises(ManifestError) as pinned:
        skills.load(decode("id: helper\nskills: {pinned: [nope]}\n", "helper.yaml"), agents)
    assert pinned.value.field == "skills.pinned[0]"
    with pytest.raises(ManifestError) as large:
        skills.load(decode("id: helper\nskills: {max_tokens: 5}\n", "helper.yaml"), agents)
    assert large.value.field == "skills.max_tokens"
    with pytest.raises(ManifestError) as missing:
        skills.load(decode("id: helper\nskills: {dir: elsewhere}\n", "helper.yaml"), agents)
    assert missing.value.field == "skills.dir"
    none = skills.load(decode("id: other\n", "other.yaml"), agents)  # no <id>/skills: none
    assert none.skills == () and not none.active


# --- on a node ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_matching_skill_is_selected_and_reaches_the_model_and_others_do_not(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "test-key")
    write_skills(api_factory.nodes.root, SKILLS)
    api_factory.write_agent("helper", manifest(fake_anthropic, "skills: {max: 1}"))
    fake_anthropic.script(Reply(text="Here are the notes."), Reply(text="No idea."))
    api = await api_factory.start()
    node = api.node

    first = await send(node, "helper", "Please write the release notes for version 2",
                       session="s:release")  # fmt: skip
    events = await wait_end(node, first.turn_id)
    [chosen] = recall_of(events)
    assert isinstance(chosen, SkillSelected)
    assert [p.id for p in chosen.skills] == ["release-notes"] and chosen.skills[0].rank > 0
    assert chosen.memory == [] and chosen.tokens > 0
    # Recorded once, before the first model call, in its append.
    names = [e.type for e in events]
    assert names.index("skill.selected") < names.index("model.call")
    assert events[names.index("skill.selected")].txid == events[names.index("model.call")].txid
    request = sent(fake_anthropic, 0)
    assert "RELEASE-BODY" in request and "CSV-BODY" not in request
    assert "INCIDENT-BODY" not in request and "authoring note" not in request
    blocks = input_message(fake_anthropic, 0)
    assert blocks[0]["text"].startswith(SKILLS_HEADER)  # in the input's message, before it
    assert blocks[-1]["text"] == "Please write the release notes for version 2"

    other = await send(node, "helper", "How is the weather today?", session="s:weather")
    [nothing] = recall_of(await wait_end(node, other.turn_id))
    assert nothing == SkillNone(candidates=3, notes=0)
    request = sent(fake_anthropic, 1)
    assert not any(marker in request for marker in ("RELEASE-BODY", "CSV-BODY", "INCIDENT-BODY"))
    assert len(input_message(fake_anthropic, 1)) == 1

    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as http:
        listed = (await http.get("/v1/agents/helper/skills")).json()
        detail = (await http.get("/v1/agents/helper")).json()
        bare = (await http.get("/v1/agents/assistant/skills")).json()
    assert listed["supported"] is True and detail["skills"] == 3
    assert [(s["id"], s["title"]) for s in listed["skills"]] == [
        ("csv-profile", "csv-profile"), ("incident", "Incident timeline"),
        ("release-notes", "Release notes"),
    ]  # fmt: skip
    release = listed["skills"][2]
    assert release["description"].startswith("Draft release notes") and release["tokens"] > 0
    assert release["pinned"] is False and release["digest"] == chosen.skills[0].digest
    selection = listed["selection"]
    assert (selection["max"], selection["maxTokens"], selection["pinned"]) == (1, 2000, [])
    assert selection["dir"].endswith("agents/helper/skills")
    assert "ts_rank_cd" in selection["ranking"]
    assert listed["memory"] == {"recall": False, "max": 5, "maxTokens": 1000}
    assert bare["supported"] is True and bare["skills"] == []


@pytest.mark.asyncio
async def test_the_previous_reply_counts_toward_the_selection(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follow-up that names its subject only in the reply it follows still finds the skill."""
    monkeypatch.setenv(KEY_ENV, "test-key")
    write_skills(node_factory.root, SKILLS)
    node_factory.write_agent("helper", manifest(fake_anthropic, "skills: {max: 1}"))
    fake_anthropic.script(Reply(text="Shall I profile the CSV file's columns?"), Reply(text="ok"))
    node = await node_factory.start()
    first = await send(node, "helper", "I have a spreadsheet export", session="s:follow")
    assert isinstance(recall_of(await wait_end(node, first.turn_id))[0], SkillNone)
    second = await send(node, "helper", "yes please", session="s:follow")
    [chosen] = recall_of(await wait_end(node, second.turn_id))
    assert isinstance(chosen, SkillSelected) and [p.id for p in chosen.skills] == ["csv-profile"]
    assert "CSV-BODY" in sent(fake_anthropic, 1)


@pytest.mark.asyncio
async def test_the_block_keeps_to_its_bounds_and_the_context_view_shows_it(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "test-key")
    many = {f"timeline-{i}.md": f"# Timeline {i}\n\nA timeline of the outage, variant {i}.\n\n"
            f"BODY-{i}: " + "step " * 20 for i in range(4)}  # fmt: skip
    write_skills(api_factory.nodes.root, {**many, "incident.md": INCIDENT})
    extra = "skills: {max: 2, max_tokens: 120, pinned: [incident]}"
    api_factory.write_agent("helper", manifest(fake_anthropic, extra))
    fake_anthropic.script(Reply(text="done"))
    api = await api_factory.start()
    text = "give me the outage timeline"
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as http:
        view = (await http.get("/v1/agents/helper/context",
                               params={"sessionKey": "s:bound", "input": text})).json()  # fmt: skip
    accepted = await send(api.node, "helper", text, session="s:bound")
    [chosen] = recall_of(await wait_end(api.node, accepted.turn_id))
    assert isinstance(chosen, SkillSelected)
    # Four skills match; two fit the count, and only as many as fit 120 tokens.
    assert 1 <= len(chosen.skills) <= 2 and chosen.tokens <= 120
    assert "incident" not in [p.id for p in chosen.skills]  # pinned: never selected
    request = sent(fake_anthropic, 0)
    taken = [p.id.removeprefix("timeline-") for p in chosen.skills]
    assert all(f"BODY-{i}" in request for i in taken)
    assert sum(f"BODY-{i}" in request for i in range(4)) == len(taken)
    # The pinned skill is in the cached system prefix, before its breakpoint.
    system = fake_anthropic.message_requests()[0].body["system"]
    pinned = [b for b in system if "INCIDENT-BODY" in b["text"]]
    assert len(pinned) == 1 and pinned[0].get("cache_control") == {"type": "ephemeral"}
    slots = {s["label"]: s for s in view["slots"]}
    assert slots["skills (pinned)"]["pinned"] is True
    shown = slots["skills"]
    assert shown["pinned"] is False and shown["tokens"] <= 120
    assert shown["text"] == input_message(fake_anthropic, 0)[0]["text"]
    assert [s["label"] for s in view["slots"]][-2:] == ["skills", "input"]
    assert view["total"] == sum(s["tokens"] for s in view["slots"])


@pytest.mark.asyncio
async def test_a_note_of_an_earlier_turn_is_recalled_when_relevant(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "test-key")
    extra = "memory: {recall: {max: 2, max_tokens: 200}}"
    api_factory.write_agent("helper", manifest(fake_anthropic, extra))
    deploy = "The deploy pipeline waits for a manual approval gate"
    colour = "The person's favourite colour is green"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("session_notes", {"action": "append", "text": deploy}),
                         ToolUse("session_notes", {"action": "append", "text": colour})]),
        Reply(text="Noted both."),
        Reply(text="Yes."),
        Reply(text="Lunch it is."),
    )  # fmt: skip
    api = await api_factory.start()
    node, key = api.node, "s:memory"
    first = await send(node, "helper", "remember two things for me", session=key)
    [before] = recall_of(await wait_end(node, first.turn_id))
    assert before == SkillNone(candidates=0, notes=0)

    second = await send(node, "helper", "how does the deploy approval work?", session=key)
    [chosen] = recall_of(await wait_end(node, second.turn_id))
    assert isinstance(chosen, SkillSelected) and chosen.skills == []
    assert [p.id for p in chosen.memory] == ["1"] and chosen.memory[0].rank > 0
    blocks = input_message(fake_anthropic, 2)
    assert blocks[0]["text"] == f"{MEMORY_HEADER}\n1. {deploy}"
    assert len(blocks) == 2  # the colour is not relevant: not recalled
    # No block of every note either (the history still holds the calls that wrote them).
    assert "Your notes for this session (session_notes)" not in sent(fake_anthropic, 2)

    third = await send(node, "helper", "what shall we eat?", session=key)
    [unrelated] = recall_of(await wait_end(node, third.turn_id))
    assert unrelated == SkillNone(candidates=0, notes=2)
    assert len(input_message(fake_anthropic, 3)) == 1  # nothing before the input

    async with httpx.AsyncClient(base_url=api.url, headers=api.headers) as http:
        view = (
            await http.get(
                "/v1/agents/helper/context",
                params={"sessionKey": key, "input": "favourite colour?"},
            )
        ).json()
        replayed = (await http.get(f"/v1/agents/helper/turns/{second.turn_id}/context")).json()
    memory = next(s for s in view["slots"] if s["label"] == "memory")
    assert memory["text"] == f"{MEMORY_HEADER}\n2. {colour}" and memory["tokens"] > 0
    assert "notes" not in [s["label"] for s in view["slots"]]
    # The past turn's context, rebuilt from the log, is what the model got.
    last = replayed["steps"][0]["messages"][-1]["content"]
    assert last[0]["text"] == f"{MEMORY_HEADER}\n1. {deploy}"


# --- a resumed turn keeps its selection ------------------------------------------------------

CRASHY = """
id: crashy
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
skills: {{max: 1}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: true
    input_schema:
      type: object
      properties:
        path: {{type: string}}
        seconds: {{type: number}}
      required: [path]
"""


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_turn_resumed_after_kill_9_uses_the_selection_in_its_log(
    servers: Servers, schema: str, tmp_path: Path, fake_anthropic: FakeAnthropic
) -> None:
    """The node dies during a tool call; before it restarts, the skill it chose is edited to
    match nothing and another that matches is added. The resumed turn selects nothing again:
    its second model call reads the version of the skill its ``skill.selected`` named."""
    marker = tmp_path / "runs.txt"
    marker.touch()
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "crashy.yaml").write_text(CRASHY.format(url=fake_anthropic.url))
    where = agents / "crashy" / "skills"
    where.mkdir(parents=True)
    (where / "release-notes.md").write_text(RELEASE)
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("record", {"path": str(marker), "seconds": 20}, id="toolu_r")]),
        Reply(text="finished after the crash"),
    )
    env = serve_env(servers, schema, tmp_path, agents)
    log = tmp_path / "serve.log"
    subjects.use(schema)
    first = serve(env, log)
    nc = await nats.connect(servers.nats_url)
    store = EventStore(servers.database_url, schema=schema)
    try:
        accepted = await accept_when_serving(nc, "crashy", "record the release notes", log)
        stream = streams.turn(accepted.turn_id)
        await store.aopen()

        async def recorded() -> bool:
            return any(isinstance(e.data, ToolCall) for e in await store.aread_stream(stream))

        await wait_for(recorded, 30, "the tool call to be recorded")
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)
        await store.aclose()
        (where / "release-notes.md").write_text(
            RELEASE.replace("Draft release notes and a changelog", "Nothing at all")
            .replace("RELEASE-BODY", "EDITED-BODY")
        )  # fmt: skip
        (where / "record-keeping.md").write_text(
            "# Record keeping\n\nRecord the release and the notes.\n\nOTHER-BODY\n"
        )
        store = EventStore(servers.database_url, schema=schema)
        events = await resumed(env, log, store, accepted.turn_id)
    finally:
        if first.poll() is None:
            first.kill()
        await nc.close()
        await store.aclose()
    [chosen] = recall_of(events)
    assert isinstance(chosen, SkillSelected) and [p.id for p in chosen.skills] == ["release-notes"]
    assert [a.attempt for a in attempts(e.data for e in events)] == [1, 2]
    assert [e.data.reason for e in events if isinstance(e.data, TurnEnd)] == ["final"]
    for index in (0, 1):  # the call before the crash and the one after
        request = sent(fake_anthropic, index)
        assert "RELEASE-BODY" in request
        assert "EDITED-BODY" not in request and "OTHER-BODY" not in request
