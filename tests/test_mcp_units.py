"""The pure parts of MCP tools: what a manifest may declare, which listed tools can be offered
(names, schemas, hints), what a result becomes for the model, and how ``execute`` reads a
:class:`ToolOutput`. The servers themselves run in tests/test_mcp_client.py."""

from __future__ import annotations

import base64
from typing import Any

import mcp_types as types
import pytest

from actors.tools import ToolCallFailed, ToolOutput, ToolSpec, execute
from actors.tools.execute import MAX_IMAGE_CHARS
from gateways.mcp.client import admit, namespaced, output, read_only
from gateways.mcp.config import declare
from gateways.mcp.spec import Http, ServerSpec, Stdio
from runtime.manifest import ManifestError, decode

OBJECT = {"type": "object", "properties": {"x": {"type": "string"}}}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 60).decode()


def declared(servers: str, env: dict[str, str] | None = None) -> list[ServerSpec]:
    manifest = decode(f"id: a\nmodel: {{provider: scripted}}\nmcp_servers:\n{servers}", "a.yaml")
    return declare(manifest.id, manifest.mcp_servers, env or {})


def test_a_stdio_and_an_http_server_with_secrets_read_from_the_environment() -> None:
    found = declared(
        "  - {name: files, command: npx, args: [-y, fs], env: {KEY: '${FS_KEY}'}, cwd: /srv,"
        "     tools: [read, write], policy: {write: ask}, timeout_s: 5}\n"
        "  - {name: web, url: 'https://mcp.example.com/mcp',"
        "     headers: {Authorization: 'Bearer ${WEB_TOKEN}'}, untrusted_output: true}\n",
        {"FS_KEY": "k1", "WEB_TOKEN": "t2"},
    )
    files, web = found
    assert files.transport == Stdio(command="npx", args=("-y", "fs"), env=(("KEY", "k1"),),
                                    cwd="/srv")  # fmt: skip
    assert files.tools == frozenset({"read", "write"})
    assert files.policy == {"write": "ask"} and files.timeout_s == 5
    assert web.transport == Http(url="https://mcp.example.com/mcp",
                                 headers=(("Authorization", "Bearer t2"),))  # fmt: skip
    assert web.tools is None and web.untrusted_output


@pytest.mark.parametrize(
    ("servers", "field", "says"),
    [
        ("  - {name: a, command: x}\n  - {name: a, url: 'http://h/mcp'}\n", "mcp_servers[1].name",
         "declared twice"),
        ("  - {name: a}\n", "mcp_servers[0]", "exactly one of"),
        ("  - {name: a, command: x, url: 'http://h/mcp'}\n", "mcp_servers[0]", "exactly one of"),
        ("  - {name: a, command: x, env: {K: '${NOPE}'}}\n", "mcp_servers[0].env.K", "NOPE"),
        ("  - {name: a, url: 'http://h', headers: {A: '${NOPE}'}}\n", "mcp_servers[0].headers.A",
         "NOPE"),
        ("  - {name: a, url: 'ftp://h'}\n", "mcp_servers[0].url", "http(s)"),
        ("  - {name: a, command: x, headers: {A: b}}\n", "mcp_servers[0].headers", "HTTP server"),
        ("  - {name: a, command: x, tools: [r], policy: {w: ask}}\n", "mcp_servers[0].policy",
         "does not allow"),
    ],
)  # fmt: skip
def test_a_declaration_that_cannot_work_is_an_invalid_manifest(
    servers: str, field: str, says: str
) -> None:
    with pytest.raises(ManifestError) as refused:
        declared(servers)
    assert refused.value.code == "invalid_manifest"
    assert refused.value.field == field
    assert says in refused.value.message and refused.value.hint


def test_a_server_name_that_would_make_tool_names_ambiguous_is_refused() -> None:
    with pytest.raises(ManifestError) as refused:
        declared("  - {name: 'My_Server', command: x}\n")
    assert refused.value.field is not None and "name" in refused.value.field


def tool(name: str, schema: Any = OBJECT, hints: types.ToolAnnotations | None = None) -> types.Tool:
    return types.Tool(name=name, input_schema=schema, annotations=hints)


def test_only_a_read_only_hint_makes_a_tool_read_only() -> None:
    assert read_only(tool("a", hints=types.ToolAnnotations(read_only_hint=True)))
    assert not read_only(tool("b"))  # no hint: it may change things
    assert not read_only(tool("c", hints=types.ToolAnnotations(destructive_hint=False)))
    assert not read_only(tool("d", hints=types.ToolAnnotations(read_only_hint=False,
                                                               destructive_hint=True)))  # fmt: skip


def test_names_are_namespaced_and_what_cannot_be_offered_is_refused_with_a_reason() -> None:
    listed = [
        tool("read.file"),
        tool("read_file"),  # the same name as read.file once namespaced
        tool("x" * 70),
        tool("broken", {"type": "object", "properties": {"x": {"type": 12}}}),
        tool("list", {"type": "array"}),
        tool("ok"),
    ]
    kept, refused = admit("files", listed)
    assert [t.name for t in kept] == ["read.file", "ok"]
    assert namespaced("files", "read.file") == "files__read_file"
    assert "already is" in refused["read_file"]
    assert "64 characters" in refused["x" * 70]
    assert "inputSchema is invalid" in refused["broken"]
    assert "top level" in refused["list"]


def test_a_result_becomes_text_images_and_notes_for_the_model() -> None:
    result = types.CallToolResult(content=[
        types.TextContent(text="first"),
        types.ImageContent(data=PNG, mime_type="image/png"),
        types.ImageContent(data=PNG, mime_type="image/tiff"),
        types.EmbeddedResource(resource=types.TextResourceContents(uri="kit://a", text="body")),
        types.EmbeddedResource(resource=types.BlobResourceContents(
            uri="kit://b", blob=PNG, mime_type="application/zip")),
        types.ResourceLink(uri="kit://c", name="c"),
        types.AudioContent(data=PNG, mime_type="audio/wav"),
    ])  # fmt: skip
    found = output(result)
    assert not found.error
    lines = found.text.split("\n")
    assert lines[0] == "first"
    assert lines[1].startswith("[an image: image/png") and lines[1].endswith("attached]")
    assert "image/tiff" in lines[2] and "not passed" in lines[2]
    assert lines[3:5] == ["[resource kit://a]", "body"]
    assert "application/zip" in lines[5] and "not passed" in lines[5]
    assert lines[6] == "[resource link c: kit://c]"
    assert "audio/wav" in lines[7]
    assert found.blocks == (
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
    )


def test_is_error_is_a_tool_error_and_structured_content_stands_in_for_no_content() -> None:
    assert output(types.CallToolResult(content=[types.TextContent(text="no")], is_error=True)).error
    only = output(types.CallToolResult(content=[], structured_content={"n": 1}))
    assert only.text == '{"n":1}' and not only.error


class Ctx:
    agent_id = session_key = turn_id = call_id = ""
    notes: Any = None
    artifacts: Any = None
    phases: Any = None


def spec(result: object) -> ToolSpec:
    async def run(args: dict[str, Any], ctx: Any) -> object:
        if isinstance(result, BaseException):
            raise result
        return result

    return ToolSpec(name="t", description="", input_schema=OBJECT, mutating=False, run=run)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_execute_keeps_images_cuts_text_and_reads_the_tool_s_own_failure() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    big = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": "A" * (MAX_IMAGE_CHARS + 1)}}  # fmt: skip
    done = await execute(spec(ToolOutput(text="y" * 100, blocks=(image, big))), {}, Ctx(),
                         timeout_s=5, max_output_chars=40)  # fmt: skip
    assert done.ok and done.truncated and done.bytes == 100
    assert done.content is not None and done.content[1] == image and len(done.content) == 2
    assert done.content[0]["text"] == done.output and "left out" in done.output

    failed = await execute(spec(ToolOutput(text="it broke", error=True)), {}, Ctx(),
                           timeout_s=5, max_output_chars=40)  # fmt: skip
    assert not failed.ok and failed.error_code == "tool_error" and failed.output == "it broke"
    assert failed.content is None

    down = await execute(spec(ToolCallFailed("server down; try later", "tool_unavailable")), {},
                         Ctx(), timeout_s=5, max_output_chars=400)  # fmt: skip
    assert not down.ok and down.error_code == "tool_unavailable"
    assert down.output == "server down; try later"
