"""``dispach serve``'s process around one node: the HTTP server (uvicorn, without its own signal
handling), the node started beside it, SIGTERM and SIGINT drained, the exit status."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
from typing import Any

import structlog
import uvicorn

from eventstore.errors import DispachError
from gateways.http.app import create_app
from gateways.http.protocol import Limits, http_protocol
from gateways.http.wsprotocol import EdgeWebSocket
from runtime.config import Settings
from runtime.node import Node

log = structlog.get_logger("dispach.node")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the node owns SIGTERM/SIGINT (uvicorn would
    re-raise the signal after shutdown, which turns a clean drain into exit status 143)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


async def serve(settings: Settings, sock: socket.socket | None = None) -> int:
    """Run a node until SIGTERM or SIGINT; returns the process exit status. ``sock``: a socket
    already listening, shared with the other workers of ``serve --workers`` (runtime/workers.py),
    served instead of binding ``settings.host:port``."""
    node = Node(settings)
    if node.services.needed or settings.node_id_from_home:
        # Refuse a data directory another node holds before binding anything (its node id is
        # derived from it unless DISPACH_NODE_ID is set).
        node.services.datadir.lock()
    app = create_app(
        node,
        tokens=settings.tokens,
        loopback=settings.loopback,
        allowed_hosts=settings.allowed_hosts,
        allowed_origins=settings.allowed_origins,
        secret=settings.secret.encode() if settings.secret else node.services.datadir.secret(),
        max_body=settings.max_body,
    )
    node.keyring = app.state.keys
    config = uvicorn.Config(
        app,
        ws_max_size=2 * settings.max_body,
        host=settings.host,
        port=settings.port,
        loop="none",
        # uvicorn's httptools and WebSocket protocols with read timeouts, a cap per client
        # address, and the error envelope for malformed requests (gateways/http/protocol.py).
        http=http_protocol(
            Limits(
                head_timeout=settings.head_timeout_seconds,
                body_timeout=settings.body_timeout_seconds,
                per_client=settings.max_connections_per_client,
            )
        ),
        ws=EdgeWebSocket,
        lifespan="off",
        timeout_keep_alive=int(settings.keep_alive_seconds),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(settings.drain_seconds)),
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    status = 0
    starting = asyncio.create_task(node.start(), name="node-start")

    def on_signal(sig: signal.Signals) -> None:
        log.info("signal", signal=sig.name, action="drain")
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        starting.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    def on_started(task: asyncio.Task[None]) -> None:
        nonlocal status
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            # Everything loaded at start (the SDKs' models, the agents) lives as long as the
            # process: out of the collector's sight, a full collection no longer walks it (it
            # cost the loop ~150 ms per pass, measured by bench/context.py).
            gc.collect()
            gc.freeze()
        if error is not None:
            status = 1
            if isinstance(error, DispachError):
                log.error(
                    "node_start_failed", code=error.code, error=error.message, hint=error.hint
                )
            else:
                log.error("node_start_failed", exc_info=error)
            server.should_exit = True

    starting.add_done_callback(on_started)
    try:
        await server.serve(sockets=None if sock is None else [sock])
        if not server.started and status == 0:
            status = 1  # could not bind (uvicorn logged why)
    finally:
        if not starting.done():
            starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        await node.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return status
