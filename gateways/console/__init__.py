"""The console: a web page the node serves itself, at ``/console`` (issue 17).

It is plain ES modules and CSS shipped as package data (``static/``), read once into memory and
answered with an ETag: no build step, no Node toolchain, nothing fetched from elsewhere. The page
calls the same API v1 as any client, from the node's own origin, so every browser guard holds
(gateways/http/origins.py): it signs in with a bearer token kept in the tab's ``sessionStorage`` and
reads streams with stream tokens (``?st=``), never with the bearer token in a URL.

The assets are open (they hold no data; every call they make needs the token), and are answered
with a Content-Security-Policy that allows nothing but the node's own scripts, styles and API: no
inline script, no other origin, no framing. The page writes what it shows with ``textContent``
only, so an event's text cannot become markup.
"""

from __future__ import annotations

import functools
import hashlib
import mimetypes
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable

import msgspec
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from eventstore import REGISTRY
from gateways.http.errors import error_response

PREFIX = "/console"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; font-src 'self'; object-src 'none'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'self'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".html": "text/html; charset=utf-8", ".svg": "image/svg+xml"}  # fmt: skip


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def is_console(path: str) -> bool:
    """Paths the console's assets are served at (open: they hold no data)."""
    return path in ("/", PREFIX) or path.startswith(PREFIX + "/")


@functools.cache
def assets() -> dict[str, Asset]:
    """Every file under static/, by its path below it (read once per process)."""
    found: dict[str, Asset] = {}
    _collect(resources.files("gateways.console").joinpath("static"), "", found)
    # The event types this node's log has (the live views listen for each by name).
    types = msgspec.json.encode(sorted(REGISTRY))
    found["types.json"] = Asset(types, "application/json", _etag(types))
    return found


def _etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:20] + '"'


def _collect(folder: Traversable, prefix: str, found: dict[str, Asset]) -> None:
    for item in folder.iterdir():
        name = prefix + item.name
        if item.is_dir():
            _collect(item, name + "/", found)
            continue
        body = item.read_bytes()
        suffix = "." + name.rsplit(".", 1)[-1]
        media = TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"
        found[name] = Asset(body, media, _etag(body))


def page_weight() -> dict[str, int]:
    """Bytes of script and style the console ships (uncompressed), by kind."""
    weight = {"js": 0, "css": 0}
    for name, asset in assets().items():
        kind = name.rsplit(".", 1)[-1]
        if kind in weight:
            weight[kind] += len(asset.body)
    return weight


async def root(request: Request) -> Response:
    return RedirectResponse(PREFIX + "/", status_code=307)


async def asset(request: Request) -> Response:
    name = request.path_params.get("path", "") or "index.html"
    found = assets().get(name)
    if found is None:
        return error_response(
            404,
            "not_found",
            f"the console has no file {name[:200]!r}",
            "open /console/ and navigate from there",
        )
    cache = "no-cache"  # revalidate every load: the ETag makes that a 304
    headers = {**HEADERS, "ETag": found.etag, "Cache-Control": cache}
    if request.headers.get("if-none-match") == found.etag:
        return Response(status_code=304, headers=headers)
    return Response(found.body, media_type=found.media_type, headers=headers)


def routes() -> list[BaseRoute]:
    return [
        Route("/", root, methods=["GET"]),
        Route(PREFIX, root, methods=["GET"]),
        Route(PREFIX + "/{path:path}", asset, methods=["GET"]),
    ]
