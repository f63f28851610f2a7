"""The stdio transport of an MCP server: a child process spoken to in JSON-RPC lines on its stdin
and stdout, for the SDK's ``Client``.

Ours rather than the SDK's ``stdio_client`` for how it reads: the SDK joins its buffer to every
chunk it reads and splits the whole again, so one message of 50 MB (a tool that returns a large
file) costs about 20 s of the node's event loop; here the chunks of a line are kept in a list
and joined once, and a line longer than ``max_message`` ends the session with an error instead
of growing without bound. The rest is what a stdio server expects: the SDK's minimal inherited
environment plus the manifest's ``env``, a process group of its own (so what it starts is
stopped with it), its stderr passed through to the node's, and at the end stdin closed, a grace
period, then SIGTERM and SIGKILL to the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import mcp_types as types
import structlog
from anyio.streams.text import TextReceiveStream
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage

from eventstore.bridge import anyio_blocking
from gateways.mcp.spec import Stdio

log = structlog.get_logger("dispach.mcp")

MAX_MESSAGE = 64 * 1024 * 1024
"""The longest line (one JSON-RPC message) read from a server, in characters."""
GRACE_S = 2.0
"""How long a server has to exit once its stdin is closed, and again after SIGTERM."""


class MessageTooLarge(Exception):
    """A line over the limit: the session ends with it."""


@contextlib.asynccontextmanager
async def stdio_transport(
    server: Stdio, max_message: int = MAX_MESSAGE
) -> AsyncIterator[tuple[Any, Any]]:
    """Start ``server`` and yield the (read, write) streams the SDK's session takes; stop it
    when the block ends."""
    # Through the launcher, so that the server dies with this node (gateways/mcp/orphan.py).
    process = await anyio.open_process(
        [sys.executable, "-m", "gateways.mcp.orphan", server.command, *server.args],
        env=get_default_environment() | dict(server.env),
        cwd=server.cwd,
        stderr=sys.stderr,
        start_new_session=True,
    )
    incoming, read = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write, outgoing = anyio.create_memory_object_stream[SessionMessage](0)

    async def reader() -> None:
        assert process.stdout is not None
        async with incoming:
            try:
                async for line in _lines(TextReceiveStream(process.stdout), max_message):
                    if len(line) <= INLINE_PARSE:
                        await incoming.send(_message(line))
                    else:
                        await incoming.send(await anyio_blocking(_message, line))
            except MessageTooLarge as e:
                with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                    await incoming.send(e)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                pass  # the server, or the session's end, closed a side: the session sees it
        # Nobody reads what it writes now: drop it until the pipe closes, so a server blocked
        # writing (the rest of a result over the limit) can see its stdin close and exit.
        await _drain(process)

    async def writer() -> None:
        assert process.stdin is not None
        async with outgoing:
            try:
                async for message in outgoing:
                    text = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((text + "\n").encode())
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                await incoming.aclose()  # the server went away: no request waits forever

    async with anyio.create_task_group() as group:
        group.start_soon(reader)
        group.start_soon(writer)
        try:
            yield read, write
        finally:
            with anyio.CancelScope(shield=True):
                await read.aclose()  # the reader stops forwarding and drains instead
                await _stop(process)
                for stream in (write, incoming, outgoing):
                    await stream.aclose()
            group.cancel_scope.cancel()


async def _lines(chunks: AsyncIterator[str], limit: int) -> AsyncIterator[str]:
    """The lines of a stream of text, each joined once from its pieces."""
    pieces: list[str] = []
    held = 0
    async for chunk in chunks:
        start = 0
        while (end := chunk.find("\n", start)) >= 0:
            pieces.append(chunk[start:end])
            line = "".join(pieces)
            pieces.clear()
            held = 0
            start = end + 1
            if line.strip():
                yield line
        rest = chunk[start:]
        if rest:
            pieces.append(rest)
            held += len(rest)
            if held > limit:
                raise MessageTooLarge(
                    f"the server sent a message of more than {limit // (1024 * 1024)} MiB"
                )


INLINE_PARSE = 256 * 1024
"""Characters of a message parsed on the event loop; a larger one is parsed in a worker thread
(the loop goes on serving meanwhile): pydantic took 0.55-0.74 s to validate a 50 MB result, one
step of the loop that every request of the node waited behind."""


def _message(line: str) -> SessionMessage | Exception:
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as e:  # the session surfaces it; the server's next lines still count
        log.warning("mcp_bad_message", error=str(e)[:300])
        return e


async def _stop(process: anyio.abc.Process) -> None:
    """Close stdin and wait; then SIGTERM the process group and wait; then SIGKILL it (its
    stdout is drained meanwhile by the reader)."""
    if process.stdin is not None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.aclose()
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
        with anyio.move_on_after(GRACE_S):
            await process.wait()
        if process.returncode is not None:
            break
    with anyio.move_on_after(GRACE_S), contextlib.suppress(OSError, anyio.BrokenResourceError):
        await process.aclose()  # its pipes' transports, released now rather than at collection


async def _drain(process: anyio.abc.Process) -> None:
    if process.stdout is None:
        return
    with contextlib.suppress(OSError, anyio.EndOfStream, anyio.BrokenResourceError,
                             anyio.ClosedResourceError):  # fmt: skip
        while True:
            await process.stdout.receive()
