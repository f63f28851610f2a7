"""An agent's skills: markdown files under its directory, read when the agent is loaded.

A skill is ``<dir>/<id>.md`` or ``<dir>/<id>/SKILL.md`` (the original Dispach's layout, after
agentskills.io), by default ``dir`` is ``<id>/skills`` beside ``agents/<id>.yaml``. Its title
and description come from YAML front matter (``name`` or ``title``, ``description``), else from
its first ``# heading`` and the paragraph after it; the rest is the body the model follows. The
title and description are what a turn's words are matched against (actors/recall.py); a skill
with no description would never be chosen for the right reason, so it fails the load, as does a
file that cannot be read, a pinned id that names no skill, and a skill too large for its block.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

from actors.agent import Agent
from actors.context.history import text_tokens
from actors.recall import PINNED_HEADER, RecallPolicy, Skill, skills_text
from eventstore import EventStore
from eventstore.recall import IndexedSkill, aindex_skills
from gateways.api.schemas import MemoryRecall, SkillInfo, SkillList, SkillSelection
from gateways.manifests import ManifestError
from runtime.manifest_schema import Manifest, RecallConfig

__all__ = ["RANKING", "index", "listed", "load", "parse", "pinned_text"]

RANKING = (
    "once per turn, before its first model call: Postgres full-text search (english, "
    "ts_rank_cd) of the skills' titles and descriptions and of the session's notes against "
    "the input and the previous reply; best first, within max and max_tokens"
)

_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
_FRONT = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)
_HEADING = re.compile(r"^#[ \t]+(.+?)[ \t#]*$")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)


def load(manifest: Manifest, directory: Path | None) -> RecallPolicy:
    """The recall policy of ``manifest`` (agents' directory: ``directory``), its skills read."""
    config = manifest.skills
    where = _where(manifest, directory)
    skills = _read_all(manifest.id, where) if where is not None else ()
    known = {s.id for s in skills}
    for index, skill_id in enumerate(config.pinned):
        if skill_id not in known:
            raise ManifestError(
                f"agent {manifest.id!r} pins skill {skill_id!r}, which is not among its skills "
                f"({', '.join(sorted(known)) or 'none'}, in {where or 'no skills directory'})",
                "name a skill by its file name without .md (or its folder's name)",
                field=f"skills.pinned[{index}]",
            )
    for skill in skills:
        alone = skills_text([skill.section])
        if skill.id not in config.pinned and alone and text_tokens(alone) > config.max_tokens:
            raise ManifestError(
                f"agent {manifest.id!r}: skill {skill.id!r} takes {text_tokens(alone)} tokens, "
                f"more than skills.max_tokens ({config.max_tokens}): it could never be selected",
                "shorten the skill, or raise skills.max_tokens",
                field="skills.max_tokens",
            )
    recall = manifest.memory.recall
    bounds = recall if isinstance(recall, RecallConfig) else RecallConfig()
    policy = RecallPolicy(
        skills=skills, pinned=tuple(config.pinned), max_skills=config.max,
        skill_tokens=config.max_tokens, notes=recall is not False, max_notes=bounds.max,
        note_tokens=bounds.max_tokens, directory=str(where) if where is not None else None,
    )  # fmt: skip
    text = pinned_text(policy)
    if text is not None and text_tokens(text) > config.max_tokens:
        raise ManifestError(
            f"agent {manifest.id!r}: its pinned skills take {text_tokens(text)} tokens, more "
            f"than skills.max_tokens ({config.max_tokens})",
            "pin fewer skills, shorten them, or raise skills.max_tokens",
            field="skills.pinned",
        )
    return policy


async def index(store: EventStore, agent: Agent) -> None:
    """Write the versions of the agent's skills this node loaded to the index it ranks them in
    (and prune the versions no node loaded for a week)."""
    await aindex_skills(store, agent.id, [
        IndexedSkill(s.id, s.digest, s.title, s.description, s.body, s.tokens)
        for s in agent.recall.skills
    ])  # fmt: skip


def listed(agent: Agent) -> SkillList:
    """How the API shows an agent's skills and their selection (``GET …/skills``)."""
    recall = agent.recall
    return SkillList(
        skills=[SkillInfo(id=s.id, title=s.title, description=s.description, tokens=s.tokens,
                          pinned=s.id in recall.pinned, digest=s.digest)
                for s in recall.skills],
        supported=True,
        selection=SkillSelection(dir=recall.directory, max=recall.max_skills,
                                 max_tokens=recall.skill_tokens, pinned=list(recall.pinned),
                                 ranking=RANKING),
        memory=MemoryRecall(recall=recall.notes, max=recall.max_notes,
                            max_tokens=recall.note_tokens),
    )  # fmt: skip


def pinned_text(policy: RecallPolicy) -> str | None:
    """The block of the skills the agent pins (in the pinned prefix), if it pins any."""
    sections = [s.section for s in policy.skills if s.id in policy.pinned]
    return skills_text(sections, PINNED_HEADER)


def parse(skill_id: str, raw: str, source: str) -> Skill:
    """One skill file's title, description and body."""
    text = raw.replace("\r\n", "\n")
    front: dict[str, Any] = {}
    found = _FRONT.match(text)
    if found is not None:
        try:
            loaded = yaml.safe_load(found.group(1))
        except yaml.YAMLError as e:
            raise ManifestError(f"{source}: its front matter is not valid YAML: {e}",
                                "fix the YAML between the two --- lines") from e  # fmt: skip
        if not isinstance(loaded, dict):
            raise ManifestError(f"{source}: its front matter is not a mapping",
                                "write `name: ...` and `description: ...` between the --- "
                                "lines")  # fmt: skip
        front = loaded
        text = text[found.end() :]
    body = _COMMENT.sub("", text).strip()
    lines = body.split("\n")
    title = _field(front, "title") or _field(front, "name")
    heading = _HEADING.match(lines[0]) if lines else None
    if heading is not None:
        title = title or heading.group(1).strip()
        body = "\n".join(lines[1:]).strip()
    description = _field(front, "description") or _first_paragraph(body)
    if not description:
        raise ManifestError(
            f"{source}: skill {skill_id!r} has no description",
            "give it `description:` in front matter, or a paragraph after its # title, saying "
            "what it is for and when it applies: that is what a turn's words are matched against",
        )
    digest = hashlib.sha256(raw.encode()).hexdigest()[:16]
    return Skill(id=skill_id, title=title or skill_id, description=description, body=body,
                 digest=digest)  # fmt: skip


def _where(manifest: Manifest, directory: Path | None) -> Path | None:
    configured = manifest.skills.dir
    if configured is None:
        default = directory / manifest.id / "skills" if directory is not None else None
        return default if default is not None and default.is_dir() else None
    path = Path(configured)
    if not path.is_absolute():
        if directory is None:
            raise ManifestError(
                f"agent {manifest.id!r}: skills.dir {configured!r} is relative, and the agent "
                "has no manifest directory to resolve it against",
                "give an absolute path", field="skills.dir",
            )  # fmt: skip
        path = directory / path
    if not path.is_dir():
        raise ManifestError(
            f"agent {manifest.id!r}: skills.dir {str(path)!r} is not a directory",
            "create it, or fix skills.dir (relative to the manifest's directory)",
            field="skills.dir",
        )
    return path


def _read_all(agent_id: str, where: Path) -> tuple[Skill, ...]:
    files = {p.stem: p for p in where.glob("*.md") if p.is_file()}
    for folder in where.iterdir():
        nested = folder / "SKILL.md"
        if folder.is_dir() and nested.is_file():
            if folder.name in files:
                raise ManifestError(
                    f"agent {agent_id!r}: skill {folder.name!r} is both {files[folder.name]} "
                    f"and {nested}",
                    "keep one of them",
                    field="skills.dir",
                )
            files[folder.name] = nested
    skills = []
    for skill_id, path in sorted(files.items()):
        if not _ID.fullmatch(skill_id):
            raise ManifestError(
                f"agent {agent_id!r}: skill file {path} has a name that is not a skill id",
                "name it with lowercase letters, digits, - and _ (at most 63), e.g. "
                "release-notes.md",
                field="skills.dir",
            )
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ManifestError(f"{path}: cannot be read: {e}",
                                "make it a readable UTF-8 file, or remove it",
                                field="skills.dir") from e  # fmt: skip
        skills.append(parse(skill_id, raw, str(path)))
    return tuple(skills)


def _field(front: dict[str, Any], name: str) -> str:
    value = front.get(name)
    return " ".join(str(value).split()) if isinstance(value, str | int | float) else ""


def _first_paragraph(body: str) -> str:
    paragraph: list[str] = []
    for line in body.split("\n"):
        if not line.strip():
            if paragraph:
                break
            continue
        if line.startswith("#"):
            if paragraph:
                break
            continue
        paragraph.append(line.strip())
    return " ".join(paragraph)
