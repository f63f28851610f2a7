"""Structured logs: JSON lines for machines, aligned key=value for a terminal.

Libraries that log through the standard library (uvicorn, psycopg, nats) are routed through the
same processors, so every line of a node has one shape. Secrets never reach a log: URLs are
logged with their password masked (:func:`redact_url`) and tokens are never logged at all.
"""

from __future__ import annotations

import logging
import sys
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
import structlog

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def configure(format: str = "auto", level: str = "info") -> None:
    """Our own lines (structlog) are rendered and written to stderr directly, one write each:
    the standard library's path (a LogRecord, handler locks, a formatter running the chain
    again) cost the access log alone 8 % of a node's CPU under load. Other libraries' lines go
    through a stdlib handler that renders them with the same processors."""
    json_lines = format == "json" or (format == "auto" and not sys.stderr.isatty())
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    line: structlog.types.Processor = (
        structlog.processors.JSONRenderer(_json)
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    exceptions = [structlog.processors.format_exc_info] if json_lines else []
    structlog.configure(
        # JSONRenderer(_json) renders bytes already; the console renderer renders text.
        processors=[*shared, *exceptions, line, *([] if json_lines else [_as_bytes])],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.BytesLoggerFactory(_binary(sys.stderr)),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                line,
                _as_text,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # httpx2 logs every request at INFO (a channel send each), with its URL.
    for noisy in ("uvicorn.access", "nats", "httpx2"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


_ENCODE = msgspec.json.Encoder(enc_hook=str).encode


def _binary(stream: Any) -> Any:
    """The byte stream under a text stream (stderr's buffer), or a writer of bytes into the
    text stream itself when it has none (an embedding that replaced stderr with a StringIO)."""
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextSink(stream)


class _TextSink:
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, data: bytes) -> None:
        self._stream.write(data.decode())

    def flush(self) -> None:
        self._stream.flush()


def _json(obj: Any, **_: Any) -> bytes:
    """A line's JSON: msgspec, with anything it cannot encode as its ``str``."""
    return _ENCODE(obj)


def _as_bytes(_logger: Any, _method: str, rendered: Any) -> bytes:
    """The console's rendered line as the bytes logger writes it."""
    return str(rendered).encode()


def _as_text(_logger: Any, _method: str, rendered: Any) -> str:
    """The rendered line as the standard library's formatter returns it."""
    return rendered.decode() if isinstance(rendered, bytes | bytearray) else str(rendered)


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
