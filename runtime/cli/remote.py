"""The client commands: they talk to a running node over HTTP (gateways.client), never to
the log."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
import msgspec

from runtime.cli import describe as admin
from runtime.cli.follow import describe_turn, follow, instant, summary

if TYPE_CHECKING:
    from gateways.client import Client


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


@click.command()
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
        reason = follow(client, agent, accepted.turn_id, reasoning=reasoning)
    sys.exit(TURN_EXIT_CODES.get(reason or "error", TURN_ERROR_EXIT))


@click.command()
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
                follow(client, agent, accepted.turn_id, prefix=f"{agent}> ", reasoning=reasoning)
            except ClientError as e:
                click.secho(f"{e.code}: {e.message}\n  hint: {e.hint}", fg="red", err=True)


@click.command("mcp")
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


@click.group()
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
    for line in describe_turn(turn):
        click.echo(line)
    start = instant(found[0]["ts"]) if found else 0.0
    for event in found:
        offset = f"+{instant(event['ts']) - start:.3f}s"
        kind = click.style(f"{event['type']:<18}", bold=True)
        click.echo(f"  {offset:>9}  {kind} {summary(event['type'], event['data'])}".rstrip())


@turns.command("stop")
@_url_option
@click.argument("turn_id")
def turns_stop(url: str, turn_id: str) -> None:
    """Ask a running turn to stop (its turn.end follows with reason `stopped`)."""
    with _client_errors(), _client(url) as client:
        client.stop(client.turn(turn_id)["agentId"], turn_id)
    click.echo(f"stopping {turn_id}")


@click.group()
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


@click.group(invoke_without_command=True)
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


@agents.command("reload")
@_url_option
@click.argument("agent_id", metavar="ID")
@_json_option
def agents_reload(url: str, agent_id: str, as_json: bool) -> None:
    """Read the agent's manifest again (on the node's disk) and run it for new turns on every
    node; running turns finish on the version they started with. A broken manifest changes
    nothing and its error is shown."""
    _change(url, agent_id, "reload", None, as_json)


@agents.command("stop")
@_url_option
@click.argument("agent_id", metavar="ID")
@click.option("--reason", help="Why, on the record and in every refusal.")
@_json_option
def agents_stop(url: str, agent_id: str, reason: str | None, as_json: bool) -> None:
    """Disable the agent on every node: new messages are refused (409 agent_stopped), its
    schedules' ticks are skipped; running turns finish. Durable across restarts."""
    _change(url, agent_id, "stop", reason, as_json)


@agents.command("start")
@_url_option
@click.argument("agent_id", metavar="ID")
@_json_option
def agents_start(url: str, agent_id: str, as_json: bool) -> None:
    """Let a stopped agent take messages again, on every node."""
    _change(url, agent_id, "start", None, as_json)


def _change(url: str, agent_id: str, kind: str, reason: str | None, as_json: bool) -> None:
    with _client_errors(), _client(url) as client:
        state = client.change_agent(agent_id, kind, reason=reason)
    _echo(state, admin.describe_change(kind, state), as_json)


@click.group()
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


@click.group()
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
