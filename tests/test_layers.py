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


# What gateways may import of actors, module by module (never ``from actors import ...``, which
# hides what is taken): the message types (actors.messages); the actor kind's ask and the NATS
# request limiter (actors.actor, actors.inflight); the ports, which are message types too: what a
# model receives and sends back (actors.model), what a channel sends and takes in
# (actors.outbox), what a tool is, runs with and returns (actors.tools: an adapter offers tools
# from outside, gateways/mcp/client.py); a schedule's definition (actors.schedule.plan, pure:
# its write-time checks and next due time), and a webhook subscription's (actors.webhooks.plan,
# pure: which event types it may name); the acceptance door's key check
# (actors.idempotency) and the spans a request opens (actors.tracing).
GATEWAYS_MAY_IMPORT = frozenset({
    "actors.messages", "actors.actor", "actors.inflight", "actors.model", "actors.outbox",
    "actors.schedule.plan", "actors.tools", "actors.idempotency", "actors.tracing",
    "actors.prices", "actors.usage", "actors.webhooks.plan",
})  # fmt: skip


def actors_imports(path: Path) -> list[str]:
    """Each import of actors in ``path``, as the module it names (``actors`` for the package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "actors" or node.module.startswith("actors."):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "actors"]
    return found


def test_gateways_use_only_the_message_types_ports_and_ask_of_actors() -> None:
    # DESIGN.md 3: gateways import eventstore and the message types of actors, never an actor.
    violations = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "gateways").rglob("*.py"))
        for module in actors_imports(path)
        if module not in GATEWAYS_MAY_IMPORT
    ]
    assert violations == []


def test_the_eventstore_imports_nothing_of_actors() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "eventstore").rglob("*.py"))
        for module in actors_imports(path)
    ]
    assert violations == []


# How a thread and the event loop meet; eventstore/bridge.py is the one module that may use them.
CROSSINGS = frozenset({
    "run_coroutine_threadsafe", "call_soon_threadsafe", "to_thread", "run_in_executor",
    "from_thread", "ThreadPoolExecutor", "threading",
})  # fmt: skip
BRIDGE = ROOT / "eventstore" / "bridge.py"


def crossings(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if set(a.name.split(".")) & CROSSINGS]
        elif isinstance(node, ast.ImportFrom) and node.module:
            named = {node.module, *node.module.split("."), *(a.name for a in node.names)}
            found += sorted(named & CROSSINGS)
        elif isinstance(node, ast.Attribute) and node.attr in CROSSINGS:
            found.append(node.attr)
        elif isinstance(node, ast.Name) and node.id in CROSSINGS:
            found.append(node.id)
    return [f"{path.relative_to(ROOT)}:{name}" for name in found]


def test_threads_meet_the_loop_only_in_the_bridge() -> None:
    violations = [
        found
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != BRIDGE
        for found in crossings(path)
    ]
    assert violations == []
    assert {"to_thread", "call_soon_threadsafe", "threading"} <= {
        c.split(":")[1] for c in crossings(BRIDGE)
    }  # the check sees them where they are


def test_the_rule_is_checked_on_real_files() -> None:
    assert imports_of(ROOT / "runtime" / "node.py") >= {"eventstore", "actors", "gateways"}
