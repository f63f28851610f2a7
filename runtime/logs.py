"""Structured logs: JSON lines for machines, aligned key=value for a terminal.

Libraries that log through the standard library (uvicorn, psycopg, nats) are routed through the
same processors, so every line of a node has one shape. Secrets never reach a log: URLs are
logged with their password masked (:func:`redact_url`) and tokens are never logged at all.
"""

from __future__ import annotations

import logging
import sys
from urllib.parse import urlsplit, urlunsplit

import structlog

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def configure(format: str = "auto", level: str = "info") -> None:
    json_lines = format == "json" or (format == "auto" and not sys.stderr.isatty())
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # httpx2 logs every request at INFO (a channel send each), with its URL.
    for noisy in ("uvicorn.access", "nats", "httpx2"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def redact_url(url: str | None) -> str | None:
    """``url`` with any password replaced by ``***``."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))
