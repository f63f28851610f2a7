"""The dependency rule of DESIGN.md 3, enforced on the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("eventstore", "actors", "gateways", "runtime")
# Which of our packages each package may import.
ALLOWED = {
    "eventstore": set(),
    "actors": {"eventstore"},
    "gateways": {"eventstore", "actors"},
    "runtime": {"eventstore", "actors", "gateways"},
}


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def test_every_package_imports_only_the_layers_below_it() -> None:
    violations = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in imports_of(path) - ALLOWED[package] - {package}:
                violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert violations == []


def test_gateways_use_only_the_message_types_and_bridge_of_actors() -> None:
    # DESIGN.md 3: gateways import eventstore and the message types of actors, never an actor.
    for path in sorted((ROOT / "gateways").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("actors")
            ):
                # The model port (actors.model) is message types too: what a model receives
                # and sends back; so is the channel port (actors.outbox: what a channel sends
                # and takes in), and a schedule's definition (actors.schedule.plan, pure: its
                # write-time checks and next due time, no actor).
                # The tool port (actors.tools: what a tool is, runs with and returns) lets an
                # adapter offer tools from outside (gateways/mcp_client.py).
                allowed = ("actors", "actors.messages", "actors.bridge", "actors.model",
                           "actors.outbox", "actors.schedule.plan", "actors.tools")  # fmt: skip
                assert node.module in allowed, path


def test_the_rule_is_checked_on_real_files() -> None:
    assert imports_of(ROOT / "runtime" / "node.py") >= {"eventstore", "actors", "gateways"}
