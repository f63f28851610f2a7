"""``python -m gateways.mcp.orphan COMMAND ARGS...``: run an MCP server that dies with its node.

The launcher asks the kernel for ``PR_SET_PDEATHSIG`` (SIGKILL) and then becomes the server
(``execvp``: the same process, the setting kept across the exec), so a node killed with -9
leaves no stdio MCP server running; a restarted node starts its own. anyio's ``open_process``
has no ``preexec_fn`` to set it in the forked child, and a launcher needs no code between fork
and exec in a threaded process. A server that forks helpers of its own is in a session of its
own (``start_new_session``); the node's stop signals that whole group (stdio.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if not argv:
        sys.stderr.write("usage: python -m gateways.mcp.orphan COMMAND [ARGS...]\n")
        raise SystemExit(2)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the node died between the fork and the prctl
            raise SystemExit(1)
    try:
        os.execvp(argv[0], argv)  # noqa: S606 - the operator's command, as the manifest names it
    except OSError as e:
        sys.stderr.write(f"dispach: cannot start MCP server {argv[0]!r}: {e.strerror}\n")
        raise SystemExit(127) from e


if __name__ == "__main__":
    main(sys.argv[1:])
