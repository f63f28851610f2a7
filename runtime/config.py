"""Node settings, read from the environment only (the same in a shell, CI and compose.yaml)."""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path

import msgspec

from actors import prices
from actors.prices import PriceTable
from eventstore import subjects
from gateways.webhooks.target import TargetPolicy
from runtime.errors import ConfigError

DEFAULT_PORT = 7420
# An origin as a browser sends it: scheme, host (a name, an IPv4 or a bracketed IPv6), port.
_ORIGIN = re.compile(r"https?://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    home: Path
    """Data directory: embedded Postgres and NATS data, agent manifests (DISPACH_HOME)."""
    database_url: str | None = None
    """External Postgres; unset starts the embedded one (DATABASE_URL)."""
    nats_url: str | None = None
    """External NATS with JetStream; unset starts the embedded one (NATS_URL)."""
    schema: str = "dispach"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tokens: tuple[str, ...] = ()
    """Bearer tokens accepted by the API (DISPACH_API_TOKEN, comma-separated for several)."""
    keys_only: bool = False
    """DISPACH_AUTH=keys: a non-loopback bind may run without a token, on API keys alone; the
    node then refuses to start unless the database holds a live unrestricted admin key."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names a loopback bind also answers to (DISPACH_ALLOWED_HOSTS; DNS-rebinding guard)."""
    allowed_origins: tuple[str, ...] = ()
    """Web pages (origins) besides the node's own that may call the API from a browser, with
    CORS (DISPACH_ALLOWED_ORIGINS)."""
    secret: str | None = None
    """Signs stream tokens (DISPACH_SECRET); unset: the one kept in <home>/secret."""
    max_body: int = 1_000_000
    """Request body cap in bytes (DISPACH_MAX_BODY)."""
    head_timeout_seconds: float = 10.0
    """How long a request head (request line and headers) may take to arrive; a connection
    that sends nothing this long is closed (DISPACH_HEAD_TIMEOUT_SECONDS)."""
    body_timeout_seconds: float = 30.0
    """The longest pause between the bytes of a request body (DISPACH_BODY_TIMEOUT_SECONDS)."""
    keep_alive_seconds: float = 65.0
    """How long an idle keep-alive connection stays open (DISPACH_KEEP_ALIVE_SECONDS): longer
    than clients and proxies keep theirs (httpx 5 s, Node's fetch 4 s, a cloud load balancer
    60 s), so the client closes first. A server that closes an idle connection just as the
    client reuses it loses that request unanswered (a POST is not retried)."""
    max_connections_per_client: int = 256
    """Open connections (WebSockets included) from one client address; 0: no cap
    (DISPACH_MAX_CONNECTIONS_PER_CLIENT)."""
    node_id: str = ""
    """This process in the cluster (DISPACH_NODE_ID). Default: the host name and a digest of
    the data directory, which the node then locks (two processes never share an id)."""
    node_id_from_home: bool = False
    cluster: str = "dispach"
    """The deployment's name: it prefixes every NATS subject, queue group and key-value bucket,
    so two deployments can share one NATS cluster (DISPACH_CLUSTER)."""
    partitions: int = 64
    """Sessions hash to this many partitions, each owned by one node at a time; fixed for the
    life of a deployment (DISPACH_PARTITIONS)."""
    lease_ttl_seconds: float = 10.0
    """A partition lease not renewed for this long expires and another node takes the
    partition over (DISPACH_LEASE_TTL_SECONDS; renewed every third of it)."""
    replicas: int = 1
    """Copies the lease bucket keeps on a NATS cluster (DISPACH_KV_REPLICAS: 3 on a 3-server
    cluster)."""
    workers: int = 1
    """Node processes ``dispach serve`` runs behind one port (DISPACH_WORKERS, or --workers)."""
    log_format: str = "auto"
    log_level: str = "info"
    pool_size: int = 8
    writer_queue: int = 10_000
    drain_seconds: float = 10.0
    accept_timeout_seconds: float = 30.0
    """How long ``POST …/messages`` waits for its session to accept the message before it
    answers ``504 accept_timeout`` (DISPACH_ACCEPT_TIMEOUT_SECONDS)."""
    session_idle_seconds: float = 60.0
    """A session actor idle this long is passivated (DISPACH_SESSION_IDLE_SECONDS)."""
    max_sessions: int = 1024
    """Live session actors (each holding its history in memory) before idle ones are passivated
    at once (DISPACH_MAX_SESSIONS)."""
    outbox_poll_seconds: float = 1.0
    """How often the outbox looks for due items when nothing woke it (DISPACH_OUTBOX_POLL_MS)."""
    agents_dir: Path | None = None
    """Where agent manifests live (DISPACH_AGENTS; default: <home>/agents)."""
    retention_turns_days: float | None = None
    """``retention.turns_days``: whole partitions of the log whose every event is older than
    this many days are archived and dropped, by one node of the deployment
    (DISPACH_RETENTION_TURNS_DAYS; unset: the log keeps everything). See eventstore/archive.py
    for what is never archived."""
    retention_keep_sessions_active: bool = True
    """``retention.keep_sessions_active``: never archive a partition holding events of a
    session with a turn inside the retention (DISPACH_RETENTION_KEEP_SESSIONS_ACTIVE=false to
    archive them anyway; such a session's notes then answer ``cursor_archived``)."""
    archive_dir: Path | None = None
    """Where archives are written (DISPACH_ARCHIVE_DIR; default: <home>/archives)."""
    prices: PriceTable = msgspec.field(default_factory=PriceTable)
    """What usage is costed with: the defaults, then the entries of DISPACH_PRICES_FILE (YAML or
    JSON) and DISPACH_PRICES (inline JSON), whole models each (actors/prices.py)."""
    webhook_policy: TargetPolicy = msgspec.field(default_factory=TargetPolicy)
    """Where an event webhook may POST: no internal address unless DISPACH_WEBHOOK_ALLOW names
    its host or network, or DISPACH_WEBHOOK_ALLOW_PRIVATE=1 (gateways/webhooks/target.py)."""
    webhook_max_attempts: int = 8
    """An event webhook's delivery is dead after this many POSTs (DISPACH_WEBHOOK_MAX_ATTEMPTS)."""
    webhook_backoff_seconds: float = 1.0
    """The first pause between POSTs, doubled each time (DISPACH_WEBHOOK_BACKOFF_SECONDS)."""
    webhook_timeout_seconds: float = 10.0
    """One POST's bound (DISPACH_WEBHOOK_TIMEOUT_SECONDS)."""

    @property
    def archives_path(self) -> Path:
        return self.archive_dir if self.archive_dir is not None else self.home / "archives"

    @property
    def agents_path(self) -> Path:
        return self.agents_dir if self.agents_dir is not None else self.home / "agents"

    @property
    def embedded_postgres(self) -> bool:
        return self.database_url is None

    @property
    def embedded_nats(self) -> bool:
        return self.nats_url is None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def from_env(env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Build and validate settings from ``env`` (default: the process environment)."""
    env = os.environ if env is None else env
    values: dict[str, object] = {
        "home": Path(env.get("DISPACH_HOME") or "~/.dispach").expanduser(),
        "database_url": env.get("DATABASE_URL") or None,
        "nats_url": env.get("NATS_URL") or None,
        "schema": env.get("DISPACH_DB_SCHEMA", "dispach"),
        "host": env.get("DISPACH_HOST", "127.0.0.1"),
        "port": _int(env, "DISPACH_PORT", DEFAULT_PORT),
        "tokens": tuple(
            t.strip() for t in env.get("DISPACH_API_TOKEN", "").split(",") if t.strip()
        ),
        "keys_only": _auth(env),
        "allowed_hosts": tuple(
            h.strip() for h in env.get("DISPACH_ALLOWED_HOSTS", "").split(",") if h.strip()
        ),
        "allowed_origins": tuple(
            o.strip() for o in env.get("DISPACH_ALLOWED_ORIGINS", "").split(",") if o.strip()
        ),
        "secret": env.get("DISPACH_SECRET") or None,
        "max_body": _int(env, "DISPACH_MAX_BODY", 1_000_000),
        "head_timeout_seconds": float(_int(env, "DISPACH_HEAD_TIMEOUT_SECONDS", 10)),
        "body_timeout_seconds": float(_int(env, "DISPACH_BODY_TIMEOUT_SECONDS", 30)),
        "keep_alive_seconds": float(_int(env, "DISPACH_KEEP_ALIVE_SECONDS", 65)),
        "max_connections_per_client": _int(env, "DISPACH_MAX_CONNECTIONS_PER_CLIENT", 256),
        "node_id": env.get("DISPACH_NODE_ID") or "",
        "cluster": env.get("DISPACH_CLUSTER") or "dispach",
        "partitions": _int(env, "DISPACH_PARTITIONS", 64),
        "lease_ttl_seconds": _float(env, "DISPACH_LEASE_TTL_SECONDS", 10.0),
        "replicas": _int(env, "DISPACH_KV_REPLICAS", 1),
        "workers": workers(env.get("DISPACH_WORKERS") or "1"),
        "log_format": env.get("DISPACH_LOG_FORMAT", "auto"),
        "log_level": env.get("DISPACH_LOG_LEVEL", "info"),
        "pool_size": _int(env, "DISPACH_PG_POOL", 8),
        "writer_queue": _int(env, "DISPACH_WRITER_QUEUE", 10_000),
        "drain_seconds": float(_int(env, "DISPACH_DRAIN_SECONDS", 10)),
        "accept_timeout_seconds": float(_int(env, "DISPACH_ACCEPT_TIMEOUT_SECONDS", 30)),
        "session_idle_seconds": float(_int(env, "DISPACH_SESSION_IDLE_SECONDS", 60)),
        "max_sessions": _int(env, "DISPACH_MAX_SESSIONS", 1024),
        "outbox_poll_seconds": _int(env, "DISPACH_OUTBOX_POLL_MS", 1000) / 1000,
        "agents_dir": Path(env["DISPACH_AGENTS"]).expanduser()
        if env.get("DISPACH_AGENTS")
        else None,
        "retention_turns_days": _float(env, "DISPACH_RETENTION_TURNS_DAYS", 0.0) or None,
        "retention_keep_sessions_active": env.get("DISPACH_RETENTION_KEEP_SESSIONS_ACTIVE", "true")
        .strip()
        .lower()
        not in ("false", "0", "no"),
        "archive_dir": Path(env["DISPACH_ARCHIVE_DIR"]).expanduser()
        if env.get("DISPACH_ARCHIVE_DIR")
        else None,
        "webhook_max_attempts": _int(env, "DISPACH_WEBHOOK_MAX_ATTEMPTS", 8),
        "webhook_backoff_seconds": _float(env, "DISPACH_WEBHOOK_BACKOFF_SECONDS", 1.0),
        "webhook_timeout_seconds": _float(env, "DISPACH_WEBHOOK_TIMEOUT_SECONDS", 10.0),
    }
    # Given as objects (tests do), they are not read: a bad file is not an error then.
    if "prices" not in overrides:
        values["prices"] = prices.load(env)
    if "webhook_policy" not in overrides:
        values["webhook_policy"] = TargetPolicy.from_env(env)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if not values["node_id"]:
        # The same node after a restart (its data directory, which it then locks): it takes
        # its own leases back at once instead of waiting for them to expire.
        values["node_id"] = home_node_id(values["home"])  # type: ignore[arg-type]
        values["node_id_from_home"] = True
    settings = Settings(**values)  # type: ignore[arg-type]
    validate(settings)
    return settings


def validate(settings: Settings) -> None:
    if settings.log_format not in ("auto", "json", "console"):
        raise ConfigError(
            f"DISPACH_LOG_FORMAT={settings.log_format!r} is not a log format",
            "use json, console or auto (console on a terminal, json otherwise)",
            "DISPACH_LOG_FORMAT",
        )
    if settings.accept_timeout_seconds < 1:
        raise ConfigError(
            f"DISPACH_ACCEPT_TIMEOUT_SECONDS={settings.accept_timeout_seconds:g} is under 1",
            "use a whole number of seconds, 1 or more (default 30)",
            "DISPACH_ACCEPT_TIMEOUT_SECONDS",
        )
    if settings.retention_turns_days is not None and settings.retention_turns_days < 0:
        raise ConfigError(
            f"DISPACH_RETENTION_TURNS_DAYS={settings.retention_turns_days:g} is negative",
            "use a number of days (e.g. 90), or unset it to keep the whole log",
            "DISPACH_RETENTION_TURNS_DAYS",
        )
    if not 0 < settings.port < 65536:
        raise ConfigError(
            f"DISPACH_PORT={settings.port} is not a TCP port", "use 1-65535", "DISPACH_PORT"
        )
    _validate_http_limits(settings)
    _validate_cluster(settings)
    _validate_ranges(settings)
    if not settings.loopback and not settings.tokens and not settings.keys_only:
        raise ConfigError(
            f"refusing to listen on {settings.host} without an API token",
            "set DISPACH_API_TOKEN (or bind 127.0.0.1); only loopback may run without a token, "
            "or, once an admin key exists, set DISPACH_AUTH=keys to run on keys alone",
            "DISPACH_API_TOKEN",
        )
    for origin in settings.allowed_origins:
        if not _ORIGIN.fullmatch(origin):
            raise ConfigError(
                f"DISPACH_ALLOWED_ORIGINS has {origin!r}, which is not an origin",
                "list origins as a browser sends them, scheme://host[:port] with no path, "
                "e.g. https://console.example.com,http://localhost:5173",
                "DISPACH_ALLOWED_ORIGINS",
            )
    if settings.secret is not None and len(settings.secret) < 32:
        raise ConfigError(
            "DISPACH_SECRET is shorter than 32 characters",
            "use a long random secret, e.g. `python -c 'import secrets;"
            " print(secrets.token_urlsafe(48))'`",
            "DISPACH_SECRET",
        )
    for raw in settings.tokens:
        token, _, scope = raw.partition("@")
        if "@" in raw and not scope:
            raise ConfigError(
                "an API token ends with '@' but names no agents",
                "write secret@agent1+agent2 to scope a token, or drop the '@'",
                "DISPACH_API_TOKEN",
            )
        if len(token) < 16:
            raise ConfigError(
                "an API token is shorter than 16 characters",
                "use a long random token, e.g. `python -c 'import secrets;"
                " print(secrets.token_urlsafe(32))'`",
                "DISPACH_API_TOKEN",
            )


def _validate_http_limits(settings: Settings) -> None:
    for name, seconds in (
        ("DISPACH_HEAD_TIMEOUT_SECONDS", settings.head_timeout_seconds),
        ("DISPACH_BODY_TIMEOUT_SECONDS", settings.body_timeout_seconds),
        ("DISPACH_KEEP_ALIVE_SECONDS", settings.keep_alive_seconds),
    ):
        if seconds < 1:
            raise ConfigError(f"{name}={seconds:g} is under a second",
                              "use a whole number of seconds, 1 or more", name)  # fmt: skip
    if settings.max_connections_per_client < 0:
        raise ConfigError(
            f"DISPACH_MAX_CONNECTIONS_PER_CLIENT={settings.max_connections_per_client} is negative",
            "use a number of connections, or 0 for no cap",
            "DISPACH_MAX_CONNECTIONS_PER_CLIENT",
        )


def _auth(env: Mapping[str, str]) -> bool:
    """``DISPACH_AUTH``: ``tokens`` (the default) or ``keys``."""
    raw = env.get("DISPACH_AUTH", "tokens").strip().lower() or "tokens"
    if raw not in ("tokens", "keys"):
        raise ConfigError(
            f"DISPACH_AUTH={raw!r} is neither tokens nor keys",
            "use DISPACH_AUTH=keys to run a public bind on API keys alone, or unset it",
            "DISPACH_AUTH",
        )
    return raw == "keys"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _validate_cluster(settings: Settings) -> None:
    if not subjects.CLUSTER_NAME.fullmatch(settings.cluster):
        raise ConfigError(
            f"DISPACH_CLUSTER={settings.cluster!r} is not a deployment name",
            "use 1-32 lower-case letters, digits, '-' or '_', starting with a letter",
            "DISPACH_CLUSTER",
        )


def _validate_ranges(settings: Settings) -> None:
    for field, name, low, high, hint in _RANGES:
        value = getattr(settings, field)
        if not low <= value <= high:  # workers may come from --workers: say it plainly
            said = f"{value} workers" if field == "workers" else f"{name}={value:g}"
            raise ConfigError(f"{said} is out of range", hint, name)


_RANGES = (  # the numbers with bounds: the field, its variable, the bounds, the hint
    ("partitions", "DISPACH_PARTITIONS", 1, 4096,
     "use 1-4096 (default 64), and keep it for the life of the deployment"),
    ("lease_ttl_seconds", "DISPACH_LEASE_TTL_SECONDS", 1, 300,
     "use 1-300 seconds (default 10): failover takes about this long"),
    ("replicas", "DISPACH_KV_REPLICAS", 1, 5,
     "use 1 for one NATS server, 3 for a 3-server cluster"),
    ("workers", "DISPACH_WORKERS", 1, 64, "use 1-64 worker processes, or 'auto' for one per core"),
    ("webhook_max_attempts", "DISPACH_WEBHOOK_MAX_ATTEMPTS", 1, 100,
     "use 1-100 POSTs (default 8); then a delivery is dead"),
    ("webhook_backoff_seconds", "DISPACH_WEBHOOK_BACKOFF_SECONDS", 0.01, 3600,
     "use 0.01-3600 seconds (default 1), doubled after each POST"),
    ("webhook_timeout_seconds", "DISPACH_WEBHOOK_TIMEOUT_SECONDS", 0.1, 120,
     "use 0.1-120 seconds (default 10) for one POST"),
)  # fmt: skip


def home_node_id(home: Path) -> str:
    digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]
    return f"{socket.gethostname()}-{digest}"


def nats_servers(url: str) -> list[str]:
    """NATS_URL may list a cluster's servers, comma-separated: the client connects to one and
    fails over to the others."""
    return [u.strip() for u in url.split(",") if u.strip()]


def workers(raw: str) -> int:
    """A worker count as written (DISPACH_WORKERS, --workers): a number, or ``auto`` (cores)."""
    if raw.strip().lower() == "auto":
        return max(1, os.cpu_count() or 1)
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{raw!r} is not a worker count",
            "use a whole number, or 'auto' (one per core)",
            "DISPACH_WORKERS",
        ) from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number", f"set {name} to a number of seconds", name
        ) from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not finite", f"set {name} to a number", name)
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number", f"set {name} to a number", name
        ) from None
