"""A turn's recall: the agent's skills and the session's notes that bear on what was said,
chosen once per turn, before its first model call, and put before the model as a block.

The ranking is Postgres full-text search (eventstore/recall.py) over the turn's input and the
previous reply (a follow-up such as "now the other one" names its subject only there). What
to take of the ranking, within a count and a token budget, is :func:`choose`; the block's
text, :func:`skills_text` and :func:`memory_text`; the event that records the choice,
:func:`decided`. The runner stages that event with the first ``model.call``, and a turn
resumed after a crash reads it back (``TurnState.recall``) instead of choosing again: every
model call of a turn reads the same recall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from actors.context.history import History, text_tokens
from eventstore import EventStore
from eventstore import recall as index
from eventstore.catalogue import Picked, SkillNone, SkillSelected

SKILLS_HEADER = (
    "Skills that match this message (chosen by relevance from the agent's skills; follow the "
    "one that fits the request, ignore those that do not):"
)
PINNED_HEADER = "Skills that always apply:"
MEMORY_HEADER = (
    "Your notes for this session that bear on this message (numbered as session_notes lists "
    "them; it has them all):"
)


@dataclass(frozen=True)
class Skill:
    """One skill file as the agent loaded it."""

    id: str
    title: str
    description: str
    body: str
    digest: str
    """A hash of the file: the version a selection names."""

    @property
    def section(self) -> str:
        """How the skill reads in its block."""
        return f"## {self.title}\n{self.body}".rstrip()

    @property
    def tokens(self) -> int:
        return text_tokens(self.section)


@dataclass(frozen=True)
class RecallPolicy:
    """How an agent's recall is configured (its manifest's ``skills`` and ``memory.recall``)."""

    skills: tuple[Skill, ...] = ()
    pinned: tuple[str, ...] = ()
    """Skills always in the context (the pinned prefix, rendered at load): never selected."""
    max_skills: int = 1
    skill_tokens: int = 2000
    notes: bool = False
    """Whether the session's notes are recalled by relevance instead of shown whole."""
    max_notes: int = 5
    note_tokens: int = 1000
    directory: str | None = None
    """Where the skills were read from (for the skills route)."""

    @property
    def selectable(self) -> tuple[Skill, ...]:
        return tuple(s for s in self.skills if s.id not in self.pinned)

    @property
    def active(self) -> bool:
        """Whether a turn of the agent selects anything (and records it)."""
        return (bool(self.selectable) and self.max_skills > 0) or self.notes

    def skill(self, skill_id: str) -> Skill | None:
        return next((s for s in self.skills if s.id == skill_id), None)


@dataclass(frozen=True)
class Recalled:
    """What a turn's requests carry of its recall (the empty one: nothing)."""

    skills: str | None = None
    memory: str | None = None
    replaces_notes: bool = False
    """The notes block (all the notes) is left out: ``memory`` stands for it."""


NOTHING = Recalled()


class Candidate(NamedTuple):
    key: str
    rank: float
    section: str


# --- the pure decisions ----------------------------------------------------------------------


def previous_reply(history: History) -> str:
    """The text of the session's last assistant message (its prose, not its tool calls)."""
    for item in reversed(history.entries):
        if item.role != "assistant":
            continue
        content = item.content
        blocks = content if isinstance(content, list) else [content]
        text = " ".join(str(b.get("text", "")) for b in blocks
                        if isinstance(b, dict) and b.get("type") == "text")  # fmt: skip
        if text.strip():
            return text
    return ""


def choose(ranked: Sequence[Candidate], header: str, max_count: int,
           max_tokens: int) -> list[tuple[Candidate, int]]:  # fmt: skip
    """The candidates to take, best first: at most ``max_count``, and only those that keep the
    whole block (``header`` and the sections taken) within ``max_tokens``; one too large for
    what is left is passed over for a smaller one after it. Each with its section's tokens."""
    taken: list[tuple[Candidate, int]] = []
    text = header
    for candidate in ranked:
        if len(taken) >= max_count:
            break
        longer = f"{text}\n\n{candidate.section}"
        if text_tokens(longer) <= max_tokens:
            taken.append((candidate, text_tokens(candidate.section)))
            text = longer
    return taken


def skills_text(sections: Sequence[str], header: str = SKILLS_HEADER) -> str | None:
    return "\n\n".join([header, *sections]) if sections else None


def memory_text(sections: Sequence[str]) -> str | None:
    return "\n".join([MEMORY_HEADER, *sections]) if sections else None


def note_section(number: int, note: str) -> str:
    return f"{number}. {note}"


def decided(skills: Sequence[tuple[Candidate, int]], notes: Sequence[tuple[Candidate, int]],
            policy: RecallPolicy, note_count: int,
            loaded: dict[str, Skill]) -> SkillSelected | SkillNone:  # fmt: skip
    """The event that records a turn's recall."""
    if not skills and not notes:
        return SkillNone(candidates=len(policy.selectable), notes=note_count)
    picked = [Picked(id=c.key, rank=round(c.rank, 6), tokens=t, digest=loaded[c.key].digest)
              for c, t in skills]  # fmt: skip
    memory = [Picked(id=str(int(c.key) + 1), rank=round(c.rank, 6), tokens=t) for c, t in notes]
    block = recalled_of([c.section for c, _ in skills], [c.section for c, _ in notes], policy)
    tokens = sum(text_tokens(t) for t in (block.skills, block.memory) if t)
    return SkillSelected(skills=picked, memory=memory, tokens=tokens)


def recalled_of(skill_sections: Sequence[str], note_sections: Sequence[str],
                policy: RecallPolicy) -> Recalled:  # fmt: skip
    return Recalled(skills=skills_text(skill_sections), memory=memory_text(note_sections),
                    replaces_notes=policy.notes)  # fmt: skip


# --- the shell: ranking on the store, and the block of a recorded choice ---------------------


async def select(store: EventStore, agent_id: str, policy: RecallPolicy, history: History,
                 text: str) -> SkillSelected | SkillNone:  # fmt: skip
    """Rank the agent's skills and the session's notes against ``text`` and the previous reply,
    and decide what the turn recalls."""
    query = index.query_text(text, previous_reply(history))
    loaded = {s.id: s for s in policy.selectable}
    skills: list[tuple[Candidate, int]] = []
    if loaded and policy.max_skills > 0:
        versions = [(s.id, s.digest) for s in loaded.values()]
        ranked = await index.asearch_skills(store, agent_id, versions, query, len(versions))
        candidates = [Candidate(r.key, r.rank, loaded[r.key].section) for r in ranked
                      if r.key in loaded]  # fmt: skip
        skills = choose(candidates, SKILLS_HEADER, policy.max_skills, policy.skill_tokens)
    notes: list[tuple[Candidate, int]] = []
    if policy.notes and history.notes and policy.max_notes > 0:
        ranked = await index.arank_notes(store, agent_id, history.notes, query,
                                         len(history.notes))  # fmt: skip
        candidates = [Candidate(r.key, r.rank, note_section(int(r.key) + 1,
                                                            history.notes[int(r.key)]))
                      for r in ranked]  # fmt: skip
        notes = choose(candidates, MEMORY_HEADER, policy.max_notes, policy.note_tokens)
    return decided(skills, notes, policy, len(history.notes), loaded)


async def resolve(store: EventStore, agent_id: str, policy: RecallPolicy, notes: Sequence[str],
                  chosen: SkillSelected | SkillNone | None) -> Recalled:  # fmt: skip
    """The block a recorded choice stands for: each skill in the version it named (the loaded
    one, else the index's copy; a version neither has any more is left out), each note as the
    session had it when the turn began."""
    if chosen is None:
        return Recalled(replaces_notes=policy.notes)
    if isinstance(chosen, SkillNone):
        return Recalled(replaces_notes=policy.notes)
    sections: list[str] = []
    for picked in chosen.skills:
        skill = policy.skill(picked.id)
        if skill is not None and skill.digest == picked.digest:
            sections.append(skill.section)
            continue
        stored = await index.askill_version(store, agent_id, picked.id, picked.digest or "")
        if stored is not None:
            title, body, _ = stored
            sections.append(f"## {title}\n{body}".rstrip())
    remembered = [note_section(int(p.id), notes[int(p.id) - 1]) for p in chosen.memory
                  if 0 < int(p.id) <= len(notes)]  # fmt: skip
    return Recalled(skills=skills_text(sections), memory=memory_text(remembered),
                    replaces_notes=bool(chosen.memory) or policy.notes)  # fmt: skip
