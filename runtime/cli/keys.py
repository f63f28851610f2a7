"""``dispach keys create|list|revoke``: API keys, through a running node's API (``/v1/keys``)."""

from __future__ import annotations

import click

from runtime.cli.remote import _client, _client_errors, _echo, _url_option

_json_option = click.option("--json", "as_json", is_flag=True, help="The API's answer as JSON.")


@click.group()
def keys() -> None:
    """API keys: minted with a scope (read < chat < write < admin) and an optional agent list."""


@keys.command("create")
@_url_option
@click.option("--label", required=True, help="How the list names the key.")
@click.option("--scope", type=click.Choice(["read", "chat", "write", "admin"]), default="admin",
              show_default=True, help="What the key may do.")  # fmt: skip
@click.option("--agent", "agents", multiple=True, help="Only this agent (repeat for several).")
@click.option("--claim", help="The boot claim a fresh node printed (mints its first key).")
@_json_option
def keys_create(url: str, label: str, scope: str, agents: tuple[str, ...], claim: str | None,
                as_json: bool) -> None:  # fmt: skip
    """Mint a key and print its secret: it is shown this once, and stored nowhere."""
    body: dict[str, object] = {"label": label, "scope": scope}
    if agents:
        body["agents"] = list(agents)
    with _client_errors(), _client(url) as client:
        made = client.create_key(body, claim)
    _echo(made, [str(made["secret"]),
                 f"key {made['keyId']} ({made['scope']}): keep the secret above, it is not shown "
                 "again"], as_json)  # fmt: skip


@keys.command("list")
@_url_option
@_json_option
def keys_list(url: str, as_json: bool) -> None:
    """Every key: id, label, scope, agents, created, last used (to the minute), revoked."""
    with _client_errors(), _client(url) as client:
        found = client.keys()
    lines = [
        f"{k['keyId']}  {k['scope']:<5}  {k['label']}"
        + (f"  agents={','.join(k['agents'])}" if k.get("agents") else "")
        + f"  used={k.get('lastUsedAt') or 'never'}"
        + (f"  REVOKED {k['revokedAt']}" if k.get("revokedAt") else "")
        for k in found["keys"]
    ]
    _echo(found, lines or ["no keys"], as_json)


@keys.command("revoke")
@_url_option
@click.argument("key_id", metavar="ID")
@_json_option
def keys_revoke(url: str, key_id: str, as_json: bool) -> None:
    """Revoke key ID: every node refuses it within a second."""
    with _client_errors(), _client(url) as client:
        row = client.revoke_key(key_id)
    _echo(row, [f"revoked {row['keyId']} at {row['revokedAt']}"], as_json)
