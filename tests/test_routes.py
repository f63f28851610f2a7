"""gateways/http/routes.py: API v1's operations, declared once, make both Starlette's routes and
the OpenAPI document (tests/test_openapi.py checks the document against the live server; this
file checks the declarations themselves and how they become routes)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateways.http.operation import AGENT, Endpoint, Operation, answer, serve
from gateways.http.routes import OPERATIONS, document, table


def test_each_operation_declares_exactly_its_paths_parameters() -> None:
    for op in OPERATIONS:
        in_path = re.findall(r"\{([^}:]+)\}", op.path)
        declared = [p["name"] for p in op.params if p["in"] == "path"]
        assert sorted(declared) == sorted(in_path), f"{op.method} {op.path}"
        assert op.method == op.method.upper() and op.summary, f"{op.method} {op.path}"


def test_the_document_lists_the_operations_in_their_order() -> None:
    paths = json.loads(document())["paths"]
    assert list(paths) == list(dict.fromkeys(op.path for op in OPERATIONS))
    by_path = [(op.path, op.method) for path in paths for op in OPERATIONS if op.path == path]
    assert [(p, m.upper()) for p, item in paths.items() for m in item] == by_path


def test_every_operation_is_served_by_one_route_of_its_path() -> None:
    routes = [r for r in table(1_000_000) if isinstance(r, Route)]
    for op in OPERATIONS:
        serving = [r for r in routes if r.path == op.path]
        assert len(serving) == 1, op.path
        assert op.method in (serving[0].methods or ()), f"{op.method} {op.path}"


async def said(request: Request, what: str) -> Response:
    return PlainTextResponse(f"{what} {request.path_params['agent']}")


async def get_one(request: Request) -> Response:
    return await said(request, "get")


async def put_one(request: Request) -> Response:
    return await said(request, "put")


def declared(method: str, handler: Endpoint) -> Operation:
    path = "/v1/agents/{agent}"
    return Operation(method, path, handler, "One", {"200": answer({}, "Ok")}, params=[AGENT])


def test_a_method_declared_twice_on_a_path_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("PUT /v1/agents/{agent} is declared twice")):
        serve([declared("PUT", put_one), declared("GET", get_one), declared("PUT", get_one)])


@pytest.mark.asyncio
async def test_handlers_of_one_path_share_its_route_its_allow_and_head() -> None:
    routes = serve([declared("GET", get_one), declared("PUT", put_one)])
    assert len(routes) == 1
    transport = httpx.ASGITransport(app=Starlette(routes=routes))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        assert (await http.get("/v1/agents/a")).text == "get a"
        assert (await http.put("/v1/agents/b")).text == "put b"
        head = await http.head("/v1/agents/c")
        assert head.status_code == 200 and head.headers["content-length"] == str(len("get c"))
        refused = await http.delete("/v1/agents/a")
        assert refused.status_code == 405
        assert set(refused.headers["allow"].split(", ")) == {"GET", "HEAD", "PUT"}
