"""The ``dispach`` command."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
import msgspec

from eventstore.errors import DispachError
from runtime import admin, logcmd
from runtime import config as config_module

if TYPE_CHECKING:
    from eventstore import EventStore
    from gateways.client import Client, StreamFrame
    from runtime.config import Settings


def _print_version(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    """``--version``: the node's own version string (imported only when asked: it is heavy)."""
    if not value or ctx.resilient_parsing:
        return
    from gateways.http.app import VERSION

    click.echo(f"dispach {VERSION}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="Print the version and exit.")  # fmt: skip
def main() -> None:
    """Dispach: an AI agent runtime on an append-only event log.

    Configuration comes from the environment: DISPACH_HOME (data directory, default ~/.dispach),
    DATABASE_URL and NATS_URL (unset: embedded Postgres and NATS are started under DISPACH_HOME),
    DISPACH_HOST / DISPACH_PORT (127.0.0.1:7420), DISPACH_API_TOKEN.
    """


main.add_command(logcmd.log)


@main.command()
@click.option("--host", help="Bind address (DISPACH_HOST). Non-loopback needs DISPACH_API_TOKEN.")
@click.option("--port", type=int, help="Port (DISPACH_PORT, default 7420).")
@click.option("--home", type=click.Path(), help="Data directory (DISPACH_HOME).")
@click.option("--agents", type=click.Path(), help="Directory of agent manifests (DISPACH_AGENTS).")
@click.option(
    "--workers",
    metavar="N|auto",
    help="Node processes sharing the port, Postgres and NATS: a number, or auto for one per core "
    "(DISPACH_WORKERS, default 1).",
)
def serve(
    host: str | None, port: int | None, home: str | None, agents: str | None, workers: str | None
) -> None:
    """Start a node: Postgres, NATS, the event store, actors and the HTTP API.

    With --workers N (N > 1) this process supervises N nodes that share its port, its Postgres and
    its NATS (runtime/workers.py); SIGTERM or Ctrl-C drains them all.
    """
    import structlog
    import uvloop

    from runtime import workers as workers_module
    from runtime.logs import configure
    from runtime.node import serve as serve_node

    with _errors():
        settings = serve_settings(host, port, home, agents, workers)
        configure(settings.log_format, settings.log_level)
        sock = workers_module.inherited_socket()  # set when this process is one of N workers
        if sock is None and settings.workers > 1:
            status = workers_module.supervise(settings)
        else:
            if sock is not None:
                structlog.contextvars.bind_contextvars(node=settings.node_id)
            status = uvloop.run(serve_node(settings, sock))
    sys.exit(status)


def serve_settings(
    host: str | None, port: int | None, home: str | None, agents: str | None, workers: str | None
) -> Settings:
    """The settings of `serve`: the environment, overridden by the options given."""
    from pathlib import Path

    return config_module.from_env(
        host=host,
        port=port,
        home=Path(home).expanduser() if home else None,
        agents_dir=Path(agents).expanduser() if agents else None,
        workers=config_module.workers(workers) if workers is not None else None,
    )


@main.group()
def events() -> None:
    """Read the event log."""


@events.command("show")
@click.argument("stream")
@click.option("--json", "as_json", is_flag=True, help="One public JSON envelope per line.")
@click.option("--full", is_flag=True, help="Include private fields (tool arguments, outputs).")
def events_show(stream: str, as_json: bool, full: bool) -> None:
    """Print every event of STREAM (e.g. turn-<turnId>) in version order."""
    from runtime import show

    with _errors(), _store() as (store, _):
        found = store.read_stream(stream)
        if not found:
            raise click.ClickException(
                f"stream {stream} has no events (stream names look like turn-<turnId>)"
            )
        for event in found:
            click.echo(show.as_json(event) if as_json else show.line(event, full=full))


@events.command("tail")
@click.option("--after", help="Start after this cursor (an event's `cursor`).")
@click.option("--from-start", is_flag=True, help="Start at the beginning of the log.")
@click.option("--category", "categories", multiple=True, help="Only these stream categories.")
@click.option("--type", "types", multiple=True, help="Only these event types.")
@click.option("--json", "as_json", is_flag=True, help="One public JSON envelope per line.")
@click.option("--full", is_flag=True, help="Include private fields (tool arguments, outputs).")
def events_tail(
    after: str | None,
    from_start: bool,
    categories: tuple[str, ...],
    types: tuple[str, ...],
    as_json: bool,
    full: bool,
) -> None:
    """Follow the log live (new events only, unless --from-start or --after)."""
    from eventstore import RecordedEvent
    from runtime import show
    from runtime.tail import check_types, tail

    def emit(event: RecordedEvent) -> None:
        click.echo(show.as_json(event) if as_json else show.line(event, full=full), nl=True)

    with _errors():
        check_types(set(types))
        with _store() as (store, nats_url), contextlib.suppress(KeyboardInterrupt):
            asyncio.run(tail(store, nats_url, after, from_start, set(categories), set(types), emit))


@main.group()
def projections() -> None:
    """Maintain the read models derived from the log."""


@projections.command("rebuild")
@click.argument("names", nargs=-1)
@click.option("--page", type=click.IntRange(min=1), metavar="N",
              help="Events replayed per transaction (a few thousand by default).")  # fmt: skip
def projections_rebuild(names: tuple[str, ...], page: int | None) -> None:
    """Rebuild projections from the log (all, or NAMES) into new tables, then swap them in.

    Safe while a node runs: the log is replayed beside the live tables in short transactions;
    the swap then locks the live tables only to apply the last events and move the new tables
    in (writers wait for that alone: its lock time is printed). An asynchronous projection's
    checkpoint moves with its tables, and a running node's runner carries on from it. A rebuild
    that is stopped leaves the live tables as they were; run it again.
    """
    from eventstore import ASYNC, INLINE, rebuild
    from eventstore.projector import REBUILD_PAGE

    known = {p.name: (p, True) for p in INLINE} | {p.name: (p, False) for p in ASYNC}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.ClickException(
            f"no projection named {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    with _errors(), _store() as (store, _):
        for name in names or sorted(known):
            projection, inline = known[name]
            progress = _every_second(f"{name}: {{}} events applied so far")
            done = rebuild(
                store, projection, inline=inline, page=page or REBUILD_PAGE, progress=progress
            )
            retried = f", at attempt {done.attempts}" if done.attempts > 1 else ""
            click.echo(
                f"{name}: rebuilt from {done.events} events; the swap held its tables' writers "
                f"for {done.lock_ms:.1f} ms ({done.tail} events applied under the lock{retried})"
            )


def _every_second(line: str) -> Callable[[int], None]:
    """A progress report that prints ``line`` with the count at most once a second."""
    last = time.monotonic()

    def report(count: int) -> None:
        nonlocal last
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            click.echo(line.format(count))

    return report


@contextmanager
def _store() -> Iterator[tuple[EventStore, str | None]]:
    """The node's store (shared with a running node, or on services started for the command)."""
    from eventstore import INLINE, EventStore
    from runtime.embedded import services_for

    settings = config_module.from_env()
    with services_for(settings.home, settings.database_url, settings.nats_url) as (db, nats_url):
        store = EventStore(db, schema=settings.schema, inline=INLINE, pool_size=2)
        store.open()
        try:
            yield store, nats_url
        finally:
            store.close()


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except DispachError as e:
        raise click.ClickException(f"{e.code}: {e.message}\n  hint: {e.hint}") from e


# The client commands: they talk to a running node over HTTP (gateways.client), never to the log.

# Exit codes of `send` by the turn's end reason; 1 is a failure to send or follow (click's own).
TURN_EXIT_CODES = {"final": 0, "stopped": 3, "max_steps": 4, "timeout": 4, "output_limit": 4,
                   "truncated": 4, "refused": 6}  # fmt: skip
TURN_ERROR_EXIT = 5

_url_option = click.option(
    "--url",
    envvar="DISPACH_URL",
    default="http://127.0.0.1:7420",
    show_default=True,
    help="The node's HTTP address (DISPACH_URL).",
)
_reasoning_option = click.option(
    "--reasoning", is_flag=True, help="Show the model's thinking as it streams (dim, on stderr)."
)


@main.command()
@_url_option
@click.option("--agent", default="assistant", show_default=True, help="Agent id.")
@click.option("--session", help="Session key (default: the agent's api:default).")
@click.option(
    "--idempotency-key",
    help="Sending the same key and text again makes no new turn (default: a fresh random key, "
    "which a retry of this send reuses).",
)
@click.option("--no-stream", is_flag=True, help="Print the turn id once accepted; do not follow.")
@_reasoning_option
@click.argument("text")
def send(
    url: str,
    agent: str,
    session: str | None,
    idempotency_key: str | None,
    no_stream: bool,
    reasoning: bool,
    text: str,
) -> None:
    """Send TEXT to an agent and print the turn live: the reply on stdout as it is written; tool
    calls, retries and the final status on stderr.

    Exit status: 0 when the turn ends `final`, 3 `stopped`, 4 at a limit (`max_steps`,
    `timeout`, `output_limit`, `truncated`), 5 `error`, 6 `refused`; 1 when the message could
    not be sent or followed.
    """
    with _client_errors(), _client(url) as client:
        accepted = client.send(agent, text, session_key=session, idempotency_key=idempotency_key)
        if no_stream:
            click.echo(accepted.turn_id)
            return
        # Without --idempotency-key a replay is the client's own retry: nothing to tell.
        replayed = ", replayed: accepted before" if accepted.replayed and idempotency_key else ""
        click.secho(
            f"turn {accepted.turn_id}, session {accepted.session_key}{replayed}", dim=True, err=True
        )
        reason = _follow(client, agent, accepted.turn_id, reasoning=reasoning)
    sys.exit(TURN_EXIT_CODES.get(reason or "error", TURN_ERROR_EXIT))


@main.command()
@_url_option
@click.option("--agent", default="assistant", show_default=True, help="Agent id.")
@click.option("--session", help="Session key kept for the whole chat (default: cli:<random>).")
@_reasoning_option
def chat(url: str, agent: str, session: str | None, reasoning: bool) -> None:
    """Talk with an agent: each line you type is a message; /quit or end of input leaves."""
    import secrets

    from gateways.client import ClientError

    key = session or f"cli:{secrets.token_hex(4)}"
    click.secho(f"{agent}, session {key}. /quit or Ctrl-D to leave.", dim=True, err=True)
    with _client(url) as client:
        while True:
            click.echo("you> ", nl=False)
            line = sys.stdin.readline()
            if not line:
                click.echo()
                return
            text = line.strip()
            if text == "/quit":
                return
            if not text:
                continue
            try:
                accepted = client.send(agent, text, session_key=key)
                _follow(client, agent, accepted.turn_id, prefix=f"{agent}> ", reasoning=reasoning)
            except ClientError as e:
                click.secho(f"{e.code}: {e.message}\n  hint: {e.hint}", fg="red", err=True)


@main.command("mcp")
@_url_option
def mcp_command(url: str) -> None:
    """Serve the node's agents to an MCP host on stdin/stdout (tools: list_agents,
    send_message, get_turn, list_approvals, answer_approval), calling the node at --url
    (DISPACH_URL) with the first token of DISPACH_API_TOKEN. Only MCP frames go to stdout;
    logs go to stderr."""
    import anyio

    from gateways.http.app import VERSION
    from gateways.mcp import server as mcp_server
    from runtime.logs import configure

    configure("auto", "warning")
    anyio.run(mcp_server.serve_stdio, lambda: _client(url), VERSION)


@main.group()
def turns() -> None:
    """Inspect and stop turns on a running node."""


@turns.command("show")
@_url_option
@click.argument("turn_id")
@click.option("--json", "as_json", is_flag=True, help="The resource and its events as JSON.")
def turns_show(url: str, turn_id: str, as_json: bool) -> None:
    """Print a turn and its timeline: one line per stored event."""
    with _client_errors(), _client(url) as client:
        turn = client.turn(turn_id)
        found = client.events(turn["agentId"], turn_id)
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode({"turn": turn, "events": found})))
        return
    for line in _describe_turn(turn):
        click.echo(line)
    start = _instant(found[0]["ts"]) if found else 0.0
    for event in found:
        offset = f"+{_instant(event['ts']) - start:.3f}s"
        kind = click.style(f"{event['type']:<18}", bold=True)
        click.echo(f"  {offset:>9}  {kind} {_summary(event['type'], event['data'])}".rstrip())


@turns.command("stop")
@_url_option
@click.argument("turn_id")
def turns_stop(url: str, turn_id: str) -> None:
    """Ask a running turn to stop (its turn.end follows with reason `stopped`)."""
    with _client_errors(), _client(url) as client:
        client.stop(client.turn(turn_id)["agentId"], turn_id)
    click.echo(f"stopping {turn_id}")


@main.group()
def cluster() -> None:
    """The nodes sharing this deployment's log, and who owns which partitions."""


@cluster.command("status")
@_url_option
@click.option("--json", "as_json", is_flag=True, help="GET /v1/cluster as it answers.")
def cluster_status(url: str, as_json: bool) -> None:
    """Print the nodes, the partitions each holds, and the singletons (one line each)."""
    with _client_errors(), _client(url) as client:
        status = client.cluster()
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(status)))
        return
    for line in describe_cluster(status):
        click.echo(line)


def describe_cluster(status: dict[str, Any]) -> list[str]:
    """``dispach cluster status`` as lines: a header, a line per node, one per singleton."""
    nodes = status["nodes"]
    lines = [
        f"cluster {status['cluster']}: {len(nodes)} node(s), {status['partitions']} partitions, "
        f"lease TTL {status['ttlS']:g} s (answered by {status['node']})"
    ]
    held = sum(len(n["partitions"]) for n in nodes)
    if held < status["partitions"]:
        lines.append(f"  {status['partitions'] - held} partition(s) have no owner (moving)")
    for node in nodes:
        flags = " draining" if node.get("draining") else ""
        age = node.get("ageMs")
        seen = f", heartbeat {age / 1000:.1f} s ago" if age is not None else ""
        lines.append(f"  {node['id']}: {len(node['partitions'])} partition(s){flags}{seen}")
    epochs = [lease["epoch"] for lease in status["leases"] if lease["partition"] is not None]
    if epochs:
        lines.append(f"  partition epochs {min(epochs)}..{max(epochs)}")
    for lease in status["leases"]:
        if lease["partition"] is None:
            name, holder, epoch = lease["lease"][2:], lease["node"], lease["epoch"]
            lines.append(f"  {name}: held by {holder} (epoch {epoch})")
    return lines


_json_option = click.option(
    "--json", "as_json", is_flag=True, help="The API's answer as JSON, as the node sent it."
)


@main.group(invoke_without_command=True)
@_url_option
@_json_option
@click.pass_context
def agents(ctx: click.Context, url: str, as_json: bool) -> None:
    """The agents of a running node: id, model, tool count, channels. `agents show ID` for one.

    With --json: the list of each agent's GET /v1/agents/{id}.
    """
    if ctx.invoked_subcommand is not None:
        return
    with _client_errors(), _client(url) as client:
        found = [client.agent(a["id"]) for a in client.agents()]
    _echo(found, admin.describe_agents(found), as_json)


@agents.command("show")
@_url_option
@click.argument("agent_id", metavar="ID")
@_json_option
def agents_show(url: str, agent_id: str, as_json: bool) -> None:
    """An agent's model, tools with their policy, channels, schedules and limits.

    With --json: {"agent": GET …/{id}, "tools": GET …/tools, "schedules": [GET …/schedules]}.
    """
    with _client_errors(), _client(url) as client:
        agent = client.agent(agent_id)
        tools = client.tools(agent_id)
        schedules = client.schedules(agent_id)
    body = {"agent": agent, "tools": tools, "schedules": schedules}
    _echo(body, admin.describe_agent(agent, tools, schedules), as_json)


@main.group()
def sessions() -> None:
    """An agent's sessions on a running node: list, show their history, fork one."""


_agent_option = click.option("--agent", required=True, help="Agent id.")


@sessions.command("list")
@_url_option
@_agent_option
@click.option("--search", help="Only sessions whose key contains this text.")
@click.option("--status", help="Only sessions whose last turn ended so (final, error, …).")
@click.option("--limit", type=int, help="At most this many (the node's default: 100).")
@_json_option
def sessions_list(url: str, agent: str, search: str | None, status: str | None,
                  limit: int | None, as_json: bool) -> None:  # fmt: skip
    """The agent's sessions, most recently active first."""
    with _client_errors(), _client(url) as client:
        found = client.sessions(agent, q=search, status=status, limit=limit)
    _echo(found, admin.describe_sessions(agent, found), as_json)


@sessions.command("show")
@_url_option
@_agent_option
@click.argument("key")
@click.option("--limit", type=int, default=50, show_default=True, help="History rows to show.")
@_json_option
def sessions_show(url: str, agent: str, key: str, limit: int, as_json: bool) -> None:
    """A session's summary and its history, oldest first, turn by turn.

    With --json: {"session": GET …/sessions/{key}, "messages": GET …/messages (newest first)}.
    """
    with _client_errors(), _client(url) as client:
        summary = client.session(agent, key)
        page = client.messages(agent, key, limit=limit)
    body = {"session": summary, "messages": page["messages"]}
    _echo(body, admin.describe_session(summary, page["messages"]), as_json)


@sessions.command("fork")
@_url_option
@_agent_option
@click.argument("key")
@click.option("--at", required=True, metavar="TURN",
              help="The last turn to copy: its id, or its 1-based index.")  # fmt: skip
@click.option("--new-key", help="The new session's key (default: one the node picks).")
@click.option("--to-agent", help="Fork into this agent (default: the same one).")
@_json_option
def sessions_fork(url: str, agent: str, key: str, at: str, new_key: str | None,
                  to_agent: str | None, as_json: bool) -> None:  # fmt: skip
    """Start a new session from KEY's history up to and including a turn; KEY is untouched."""
    with _client_errors(), _client(url) as client:
        answer = client.fork(agent, key, admin.at_turn(at), new_key=new_key, to_agent=to_agent)
    _echo(answer, [admin.describe_fork(answer)], as_json)


@main.group()
def approvals() -> None:
    """Tool calls waiting for a person (tools whose policy is `ask`), and the answers."""


@approvals.command("list")
@_url_option
@click.option("--agent", help="Only this agent's (default: every agent you can reach).")
@_json_option
def approvals_list(url: str, agent: str | None, as_json: bool) -> None:
    """Each waiting call: agent, session, turn, tool, when it was asked, how to answer it.

    With --json: {"approvals": [...]}, the body of GET …/approvals (over every agent).
    """
    with _client_errors(), _client(url) as client:
        ids = [agent] if agent else [a["id"] for a in client.agents()]
        waiting = sorted((w for i in ids for w in client.approvals(i, private=True)),
                         key=lambda w: str(w.get("requestedAt")))  # fmt: skip
    _echo({"approvals": waiting}, admin.describe_approvals(waiting), as_json)


@approvals.command("grant")
@_url_option
@click.argument("approval_id", metavar="ID")
@_agent_option
@_json_option
def approvals_grant(url: str, approval_id: str, agent: str, as_json: bool) -> None:
    """Let the waiting call ID run; its turn carries on with the tool's result."""
    _decide(url, approval_id, agent, as_json, granted=True)


@approvals.command("deny")
@_url_option
@click.argument("approval_id", metavar="ID")
@_agent_option
@_json_option
def approvals_deny(url: str, approval_id: str, agent: str, as_json: bool) -> None:
    """Refuse the waiting call ID; its turn carries on, the model told the call was refused."""
    _decide(url, approval_id, agent, as_json, granted=False)


def _decide(url: str, approval_id: str, agent: str, as_json: bool, *,
            granted: bool) -> None:  # fmt: skip
    with _client_errors(), _client(url) as client:
        answer = client.decide(agent, approval_id, granted)
    then = "the call runs" if answer.get("granted") else "the model reads a refusal"
    done = "granted" if answer.get("granted") else "denied"
    _echo(answer, [f"{done} {answer.get('approvalId')} (agent {agent}): {then}"], as_json)


def _echo(body: object, lines: list[str], as_json: bool) -> None:
    """The API's body as JSON, or the lines for a person."""
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(body)))
        return
    for line in lines:
        click.echo(line)


def _follow(client: Client, agent: str, turn_id: str, prefix: str = "",
            reasoning: bool = False) -> str | None:  # fmt: skip
    """Print a turn's stream until it ends; return its end reason."""
    printer = _TurnPrinter(prefix, agent)
    try:
        for frame in client.stream_turn(agent, turn_id, reasoning=reasoning):
            printer.frame(frame)
    except KeyboardInterrupt:
        printer.end_line()
        click.secho(f"interrupted; turn {turn_id} runs on (dispach turns stop {turn_id})", err=True)
        sys.exit(130)
    return printer.reason


class _TurnPrinter:
    """Writes the frames of one turn for a person at a terminal."""

    _NOTED = frozenset(
        {"model.retry", "tool.call", "tool.result", "tool.gated", "tool.repair",
         "approval.resolved", "turn.stopping", "delivery.failed"}
    )  # fmt: skip

    def __init__(self, prefix: str, agent: str) -> None:
        self.prefix = prefix
        self.agent = agent
        self.reason: str | None = None
        self.replied = False
        self._open = False  # stdout has a line without its end
        self._thinking = False  # stderr has thinking without its line end

    def frame(self, frame: StreamFrame) -> None:
        data: dict[str, Any] = frame.data.get("data") or {}
        match frame.event:
            case "model.chunk" if data.get("kind", "text") == "text":
                self._reply(str(data.get("delta", "")))
            case "model.chunk":  # the model's thinking (asked for with --reasoning): not the reply
                self._think(str(data.get("delta", "")))
            case "turn.attempt" if data.get("attempt", 1) > 1:
                self._note(frame.event, data)
            case "turn.end":
                if not self.replied and data.get("text"):
                    self._reply(str(data["text"]))  # its chunks were not on the stream
                self.reason = data.get("reason")
                self.end_line()
                colour = "green" if self.reason == "final" else "red"
                click.secho(_summary("turn.end", data), fg=colour, err=True)
            case "stream.ended" if self.reason is None:
                self.reason = frame.data.get("status")
            case "approval.requested":  # the turn is parked: say how to let it go on
                self.end_line()
                first, *rest = admin.approval_note(frame.data.get("agentId") or self.agent, data)
                click.secho(f"  {frame.event}  {first}", fg="yellow", bold=True, err=True)
                for line in rest:
                    click.echo(f"  {line}", err=True)
            case event if event in self._NOTED:
                self._note(event, data)

    def end_line(self) -> None:
        if self._open:
            click.echo()
            self._open = False

    def _think(self, delta: str) -> None:
        if self._open and not self._thinking:
            self.end_line()
        self._thinking = True
        click.secho(delta, dim=True, italic=True, nl=False, err=True)

    def _reply(self, delta: str) -> None:
        if not delta:
            return
        if self._thinking:  # the answer starts on a line of its own
            click.echo(err=True)
            self._thinking = False
        if not self._open and self.prefix:
            click.secho(self.prefix, bold=True, nl=False)
        click.echo(delta, nl=False)
        self.replied = True
        self._open = not delta.endswith("\n")

    def _note(self, event: str, data: dict[str, Any]) -> None:
        self.end_line()
        click.secho(f"  {event}  {_summary(event, data)}", dim=True, err=True)


def _call_summary(d: dict[str, Any]) -> str:
    """A ``model.call``: catalogue v2 carries its context and pressure (v1 wrote them as the
    ``context.assembled`` and ``context.pressure`` before it)."""
    line = f"{d.get('role')} {d.get('model')}, {d.get('promptTokens')} prompt tokens"
    if isinstance(context := d.get("context"), dict):
        line += f" in {len(context.get('slots') or [])} blocks"
    if isinstance(pressure := d.get("pressure"), dict):
        line += f", {pressure.get('fraction', 0):.0%} of the budget"
    return line


def _summary(event: str, d: dict[str, Any]) -> str:
    """A short line about one event's public data."""
    match event:
        case "turn.start":
            return f"{d.get('source')}: {_clip(repr(d.get('input', '')))}"
        case "turn.attempt":
            return f"attempt {d.get('attempt')} on {d.get('node')}" + (
                f", resumed from step {d['resumedFromStep']}" if d.get("resumedFromStep") else ""
            )
        case "context.assembled":
            return f"{d.get('total')} tokens in {len(d.get('slots') or [])} blocks"
        case "model.call":
            return _call_summary(d)
        case "model.chunk":
            return f"{d.get('kind', 'text')} {_clip(repr(d.get('delta', '')))}"
        case "model.retry":
            return f"status {d.get('status')}, attempt {d.get('attempt')}, in {d.get('delayMs')} ms"
        case "model.result":
            return (
                f"{d.get('finishReason')}, {d.get('outputTokens')} output tokens,"
                f" {d.get('latencyMs')} ms" + _error(d)
            )
        case "tool.call":
            mutating = ", mutating" if d.get("mutating") else ""
            return f"{d.get('slug')} ({d.get('callId')}), args #{d.get('argsHash')}{mutating}"
        case "tool.result":
            flags = [f for f in ("truncated", "uncertain") if d.get(f)]
            return (
                f"{d.get('slug')} {'ok' if d.get('ok') else 'failed'}, {d.get('latencyMs')} ms,"
                f" {d.get('bytes')} bytes" + "".join(f", {f}" for f in flags)
            )
        case "approval.requested":
            return admin.approval_waits(d)
        case "approval.resolved":
            return admin.approval_resolved(d)
        case "turn.end":
            tokens = d.get("tokens") or {}
            return (
                f"{d.get('reason')}: {_steps(d.get('steps'))}, {tokens.get('prompt', 0)} prompt +"
                f" {tokens.get('output', 0)} output tokens, {d.get('durationMs')} ms" + _error(d)
            )
    return _clip(msgspec.json.encode(d).decode())


def _error(d: dict[str, Any]) -> str:
    error = d.get("error")
    if not error:
        return ""
    return f"\n  {error.get('code')}: {error.get('message')}\n  hint: {error.get('hint')}"


def _steps(count: object) -> str:
    return "1 step" if count == 1 else f"{count} steps"


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _describe_turn(t: dict[str, Any]) -> list[str]:
    lines = [
        f"turn {t['turnId']}  agent {t.get('agentId')}  session {t.get('sessionKey')}",
        f"status {t.get('status')} ({t.get('state')}), {_steps(t.get('steps'))},"
        f" {t.get('promptTokens')} prompt + {t.get('outputTokens')} output tokens"
        + (f", {t['durationMs']} ms" if t.get("durationMs") is not None else ""),
        f"input: {_clip(repr(t.get('input', '')))}",
    ]
    if t.get("text"):
        lines.append(f"reply: {_clip(repr(t['text']))}")
    if t.get("errorCode"):
        lines.append(f"error {t['errorCode']}: {t.get('errorMessage')}")
        lines.append(f"  hint: {t.get('errorHint')}")
    return [*lines, "timeline:"]


def _instant(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts).timestamp()


def _client(url: str) -> Client:
    """A client for ``url`` with the first token of DISPACH_API_TOKEN (its ``@scope`` removed)."""
    import os

    from gateways.client import Client

    tokens = [t.strip() for t in os.environ.get("DISPACH_API_TOKEN", "").split(",") if t.strip()]
    return Client(url, tokens[0].partition("@")[0] if tokens else None)


@contextmanager
def _client_errors() -> Iterator[None]:
    from gateways.client import ClientError

    try:
        yield
    except ClientError as e:
        raise click.ClickException(f"{e.code}: {e.message}\n  hint: {e.hint}") from e
