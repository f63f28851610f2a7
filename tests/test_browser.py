"""Browsers against a real node (issue 13, section 1): Debian's Chromium, headless, driven by
Playwright's Python API, against real `dispach serve` processes on the suite's Postgres and NATS.

A web page the user visits must not drive a loopback node: from another origin its text/plain,
form and beacon POSTs are refused and leave no turn in the log, its WebSocket is refused before
the upgrade, and its CORS fetches fail unless the node lists its origin. A page the node does list
reads a live turn with an ``EventSource`` on a stream token (``?st=``), resumes it after the node
is killed and restarted, and stops reconnecting once the turn has ended. Clients that send no
``Origin`` (curl, the Python client, the CLI) are unaffected.

The pages (tests/browser_pages/) are served by a small HTTP server of their own on another
loopback port, which makes them another origin than the node's. Where a test must count the
browser's connections it puts :class:`CountingProxy` between the browser and the node: the proxy
sees every request the browser's network stack sends, whatever the page's script reports.

Chromium is /usr/bin/chromium (``DISPACH_CHROMIUM`` names another). Where it is missing these
tests skip with a loud reason on a developer's machine, and fail in CI (``CI=true`` or
``DISPACH_REQUIRE_BROWSER=1``, which .ci/run sets), so a run without a browser never passes.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Response as PageResponse
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect
from websockets.typing import Origin

from eventstore import REGISTRY, EventStore, RecordedEvent
from gateways.client import Client
from tests import fakes
from tests.conftest import ROOT, Servers
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_node import free_port

fake_anthropic = fakes.fake_anthropic
pytestmark = pytest.mark.slow

DISPACH = str(Path(sys.executable).parent / "dispach")
PAGES = Path(__file__).resolve().parent / "browser_pages"
CHROMIUM = os.environ.get("DISPACH_CHROMIUM") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]  # Playwright adds --headless, --no-sandbox (chromium_sandbox=False) and a fresh profile
API_TOKEN = "browser-test-api-token"
SECRET = "browser-test-node-secret-0123456789abcdef"
CONTROL_FRAMES = ("turn.accepted", "stream.replay", "stream.subscribed", "stream.ended")
EVENT_TYPES = sorted(REGISTRY)

# An agent whose scripted model answers "record" with a mutating tool that leaves a mark on disk:
# a turn a page could start would show there, as well as in the log.
KEEPER = """
id: keeper
model:
  provider: scripted
  script:
    - {{match: "record", tool: record, input: {{path: "{marker}", seconds: 0}}}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran.
    mutating: true
    input_schema:
      type: object
      properties: {{path: {{type: string}}, seconds: {{type: number}}}}
      required: [path]
"""

# An agent on the fake Anthropic server: a mutating tool the test kills the node in, then text.
TALKER = """
id: talker
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: true
    input_schema:
      type: object
      properties: {{path: {{type: string}}, seconds: {{type: number}}}}
      required: [path]
"""


def browser_required() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get(
        "DISPACH_REQUIRE_BROWSER"
    ) in ("1", "true")


# --- the node: `dispach serve` on the suite's Postgres and NATS -----------------------------------


class ServeNode:
    """A real ``dispach serve`` on the test's Postgres schema and the suite's NATS, restartable
    on the same port and data (its output, every run's, goes to one log file)."""

    def __init__(self, servers: Servers, schema: str, root: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"serve-{self.port}.log"
        self.token = env.get("DISPACH_API_TOKEN")
        inherited = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DISPACH_", "ANTHROPIC_"))
            and k.upper() not in ("DATABASE_URL", "NATS_URL", "HTTP_PROXY", "HTTPS_PROXY")
        }
        self.env = (
            inherited
            | {
                "DATABASE_URL": servers.database_url,
                "NATS_URL": servers.nats_url,
                "DISPACH_DB_SCHEMA": schema,
                "DISPACH_CLUSTER": schema,
                "DISPACH_HOME": str(root / f"home-{self.port}"),
                "DISPACH_AGENTS": str(root / "agents"),
                "DISPACH_PORT": str(self.port),
                "DISPACH_LOG_FORMAT": "json",
                "DISPACH_DRAIN_SECONDS": "2",
                "PYTHONPATH": str(ROOT),  # the agents' tools live in tests/
                "NO_PROXY": "127.0.0.1,localhost",
            }
            | env
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def http(self) -> httpx.Client:
        """A client as curl or a server would be: no ``Origin``."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30)

    def start(self, wait: bool = True) -> None:
        """Start the process; with ``wait``, return once ``/v1/ready`` answers 200."""
        assert self.proc is None or self.proc.poll() is not None
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [DISPACH, "serve"], env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        if not wait:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/v1/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"not ready in 60 s: {self.output()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


ServeFactory = Callable[..., ServeNode]


@pytest.fixture
def serve(servers: Servers, schema: str, tmp_path: Path) -> Iterator[ServeFactory]:
    """Starts nodes: ``serve(DISPACH_API_TOKEN=..., ...)`` (the environment it adds)."""
    started: list[ServeNode] = []

    def start(**env: str) -> ServeNode:
        node = ServeNode(servers, schema, tmp_path, env)
        started.append(node)
        node.start()
        return node

    yield start
    for node in started:
        node.close()


def write_agent(root: Path, agent_id: str, manifest: str) -> None:
    (root / "agents").mkdir(exist_ok=True)
    (root / "agents" / f"{agent_id}.yaml").write_text(manifest)


def logged(servers: Servers, schema: str, kind: str) -> list[RecordedEvent]:
    """Every event of type ``kind`` in the test's log (read from Postgres, not through the node)."""
    store = EventStore(servers.database_url, schema=schema)
    store.open()
    try:
        return [e for e in store.read_all(limit=100_000) if e.type == kind]
    finally:
        store.close()


def wait_until(probe: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def turn_status(node: ServeNode, agent: str, turn_id: str) -> str:
    with node.http() as http:
        response = http.get(f"/v1/agents/{agent}/turns/{turn_id}")
    assert response.status_code == 200, response.text
    return str(response.json()["status"])


def error_code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code


# --- the pages and the browser --------------------------------------------------------------------


class _QuietPages(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()


class PageServer:
    """tests/browser_pages/ on a loopback port of its own: another origin than the node's."""

    def __init__(self) -> None:
        handler = functools.partial(_QuietPages, directory=str(PAGES))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.page = f"{self.origin}/index.html"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


@pytest.fixture
def pages() -> Iterator[Callable[[], PageServer]]:
    """Starts page servers, each another origin."""
    started: list[PageServer] = []

    def start() -> PageServer:
        server = PageServer()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture
def browser() -> Iterator[Browser]:
    """Chromium for one test. Not for a module: while Playwright's sync API is up its event loop
    counts as running in this thread, and the suite's autouse async fixture (conftest.py) could
    not set up or tear down the next test."""
    if not Path(CHROMIUM).is_file():
        reason = (
            f"BROWSER TESTS NOT RUN: no Chromium at {CHROMIUM} "
            "(apt-get install chromium, or point DISPACH_CHROMIUM at one)"
        )
        if browser_required():
            pytest.fail(reason + "; CI requires them (CI=true or DISPACH_REQUIRE_BROWSER=1)")
        pytest.skip(reason)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def new_page(browser: Browser) -> Iterator[Callable[[str], Page]]:
    """Opens a page at a URL, each in a browser context of its own (its own cookies, cache)."""
    contexts = []

    def open_page(url: str) -> Page:
        context = browser.new_context()
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(30_000)
        response = page.goto(url)
        assert response is not None and response.ok, url
        if page.evaluate("typeof corsFetch") == "undefined":  # a page of the node's: add them
            page.add_script_tag(path=PAGES / "probes.js")
        return page

    yield open_page
    for context in contexts:
        context.close()


class Responses:
    """The status of every response the page's network stack received for URLs containing
    ``part`` (what the page's script may not read: a no-cors or form post's answer)."""

    def __init__(self, page: Page, part: str) -> None:
        self.seen: list[tuple[str, int]] = []

        def seen(response: PageResponse) -> None:
            if part in response.url:
                self.seen.append((response.url, response.status))

        page.on("response", seen)

    def wait(self, count: int, page: Page) -> list[int]:
        deadline = time.monotonic() + 30
        while len(self.seen) < count:
            assert time.monotonic() < deadline, f"only {self.seen} of {count} responses"
            page.wait_for_timeout(50)
        return [status for _, status in self.seen]


# --- a proxy that counts the browser's requests --------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One HTTP request head the browser sent, when, and whether the node was there to take it."""

    at: float
    head: str
    reached: bool

    @property
    def line(self) -> str:
        return self.head.split("\r\n", 1)[0]

    def header(self, name: str) -> str | None:
        for line in self.head.split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name:
                return value.strip()
        return None


class CountingProxy:
    """A TCP proxy on its own loopback port in front of ``port``, recording the head of every
    request that passes. The browser sends it only GETs (an EventSource), so each request is a
    head that ends with an empty line. While the node is down the proxy still reads the request,
    records it as not reached and closes the connection: the browser sees a network error."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def requests(self, part: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if part in s.line]

    def _record(self, buffer: bytes, reached: bool) -> bytes:
        while b"\r\n\r\n" in buffer:
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            with self._lock:
                self.seen.append(Seen(time.time(), head.decode("latin-1"), reached))
        return buffer

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        first = b""
        try:
            while b"\r\n\r\n" not in first:
                data = client.recv(65536)
                if not data:
                    return
                first += data
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                self._record(first, reached=False)
                return
            upstream.settimeout(None)
            with self._lock:
                self._sockets.append(upstream)
            upstream.sendall(first)
            buffer = self._record(first, reached=True)
            back = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
            back.start()
            try:
                while data := client.recv(65536):
                    buffer = self._record(buffer + data, reached=True)
                    upstream.sendall(data)
            except OSError:
                pass
            finally:
                _shut(client, upstream)
            back.join(10)
            upstream.close()
        except OSError:
            pass
        finally:
            _shut(client)
            client.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            _shut(source, sink)  # the node went away: so does the browser's connection

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            sockets = list(self._sockets)
        _shut(*sockets)
        for thread in self._threads:
            thread.join(10)


def _shut(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


# --- 1. another origin cannot drive a loopback node ----------------------------------------------


def test_a_page_on_another_origin_cannot_start_a_turn_with_a_simple_post(
    serve: ServeFactory,
    pages: Callable[[], PageServer],
    new_page: Callable[[str], Page],
    servers: Servers,
    schema: str,
    tmp_path: Path,
) -> None:
    """The loopback default (no token): a no-cors text/plain fetch, a beacon and three forms
    (urlencoded, multipart, and text/plain shaped as JSON) are refused before any route: no turn
    in the log, the mutating tool never runs. A request without Origin still works."""
    marker = tmp_path / "keeper-ran.txt"
    write_agent(tmp_path, "keeper", KEEPER.format(marker=marker))
    node = serve()
    page = new_page(pages().page)
    target = f"{node.url}/v1/agents/keeper/messages"
    answers = Responses(page, "/v1/agents/keeper/messages")

    body = json.dumps({"text": "record"})
    assert page.evaluate("([url, body]) => plainPost(url, body)", [target, body]) == "sent"
    assert page.evaluate("([url, body]) => beacon(url, body)", [target, body]) is True
    forms = [
        ("application/x-www-form-urlencoded", {"text": "record"}),
        ("multipart/form-data", {"text": "record"}),
        ("text/plain", {'{"text":"record","x":"': '"}'}),  # body: {"text":"record","x":"="}
    ]
    for enctype, fields in forms:
        page.evaluate("([u, e, f]) => submitForm(u, e, f)", [target, enctype, fields])
        answers.wait(len(answers.seen) + 1, page)  # one form at a time: a frame loads one page
    statuses = answers.wait(5, page)

    assert logged(servers, schema, "turn.start") == [], f"a page started a turn ({statuses})"
    assert not marker.exists(), "a page ran the mutating tool"
    assert statuses == [403] * 5, statuses

    with node.http() as http:  # not a browser: no Origin, unaffected
        accepted = http.post("/v1/agents/keeper/messages", json={"text": "record"})
    assert accepted.status_code == 202, accepted.text
    wait_until(lambda: turn_status(node, "keeper", accepted.json()["turnId"]) != "running", "end")
    assert len(logged(servers, schema, "turn.start")) == 1
    assert marker.read_text() == "ran\n"


def test_the_refusal_of_another_origin_is_the_error_envelope(serve: ServeFactory) -> None:
    """What the browser gets (the page cannot read it, but a developer's console shows it):
    403 origin_not_allowed, also for `Origin: null` (a sandboxed frame, a file: page)."""
    node = serve()
    with node.http() as http:
        for origin in ("http://127.0.0.1:1", "http://localhost:1", "null", "http://evil.example"):
            response = http.post(
                "/v1/agents/assistant/messages",
                content=b'{"text": "hi"}',
                headers={"Origin": origin, "Content-Type": "text/plain"},
            )
            assert response.status_code == 403, (origin, response.text)
            error = response.json()["error"]
            assert error["code"] == "origin_not_allowed" and error["message"] and error["hint"]
            get = http.get("/v1/agents", headers={"Origin": origin})
            assert (get.status_code, error_code(get)) == (403, "origin_not_allowed"), origin
        assert http.get("/v1/agents").status_code == 200


def test_a_page_on_another_origin_cannot_open_the_websocket(
    serve: ServeFactory,
    pages: Callable[[], PageServer],
    new_page: Callable[[str], Page],
    servers: Servers,
    schema: str,
    tmp_path: Path,
) -> None:
    """Cross-site WebSocket hijacking: the socket is refused before the upgrade (the page never
    sees it open, so it can neither send nor read), and no turn starts. A page the node serves
    itself (its own origin) still opens it."""
    marker = tmp_path / "keeper-ran.txt"
    write_agent(tmp_path, "keeper", KEEPER.format(marker=marker))
    node = serve()
    ws_url = f"ws://127.0.0.1:{node.port}/v1/ws"
    frame = {"type": "message", "agentId": "keeper", "text": "record"}

    page = new_page(pages().page)
    seen = page.evaluate("([u, f]) => openSocket(u, f, 3000)", [ws_url, frame])
    assert seen["opened"] is False, seen
    assert seen["frames"] == [], seen
    assert seen["closeCode"] == 1006, seen  # the handshake failed: no close frame
    assert logged(servers, schema, "turn.start") == []
    assert not marker.exists()

    with pytest.raises(InvalidStatus) as refused:  # what the browser was answered
        ws_connect(ws_url, origin=Origin(pages().origin), open_timeout=10).close()
    assert refused.value.response.status_code == 403
    assert json.loads(refused.value.response.body or b"{}")["error"]["code"] == (
        "origin_not_allowed"
    )

    own = new_page(f"{node.url}/v1/health")  # a page at the node's own origin
    seen = own.evaluate("([u, f]) => openSocket(u, f, 5000)", [ws_url, None])
    assert seen["opened"] is True, seen
    assert seen["frames"][0]["type"] == "ws.open", seen


def test_the_nodes_own_origin_may_post_and_localhost_is_another_origin(
    serve: ServeFactory, new_page: Callable[[str], Page]
) -> None:
    """The Origin check compares the whole origin with the node's own (``http://<Host>``): a
    page at http://127.0.0.1:<port> may post to it; one at http://localhost:<port> (the same
    server under another name, so another origin) may not post to http://127.0.0.1:<port>."""
    node = serve()
    init = {
        "method": "POST",
        "headers": {"Content-Type": "application/json"},
        "body": json.dumps({"text": "hello"}),
    }
    target = f"{node.url}/v1/agents/assistant/messages"
    same = new_page(f"{node.url}/v1/health")
    answer = same.evaluate("([u, i]) => corsFetch(u, i)", [target, init])
    assert answer.get("status") == 202, answer

    other = new_page(f"http://localhost:{node.port}/v1/health")
    answer = other.evaluate("([u, i]) => corsFetch(u, i)", [target, init])
    assert "error" in answer, answer  # refused: the page may not read it
    with node.http() as http:
        preflight = http.options(
            "/v1/agents/assistant/messages",
            headers={
                "Origin": f"http://localhost:{node.port}",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
    assert (preflight.status_code, error_code(preflight)) == (403, "origin_not_allowed")


@pytest.mark.parametrize("token", [False, True], ids=["loopback-default", "api-token"])
def test_a_cors_fetch_works_only_from_an_allowed_origin(
    serve: ServeFactory,
    pages: Callable[[], PageServer],
    new_page: Callable[[str], Page],
    servers: Servers,
    schema: str,
    token: bool,
) -> None:
    """DISPACH_ALLOWED_ORIGINS lists the web app's origin: its fetches (a JSON POST, with the
    bearer token when the node has one: a preflight) work and it reads the answers; the same
    fetches from another origin fail, and a stream token does not open a stream for it."""
    allowed, other = pages(), pages()
    env = {"DISPACH_ALLOWED_ORIGINS": f"http://example.invalid,{allowed.origin}"}
    if token:
        env |= {"DISPACH_API_TOKEN": API_TOKEN, "DISPACH_SECRET": SECRET}
    node = serve(**env)
    headers = {"Content-Type": "application/json"} | node.headers
    post = {"method": "POST", "headers": headers, "body": json.dumps({"text": "hello"})}
    read = {"headers": node.headers}
    messages = f"{node.url}/v1/agents/assistant/messages"

    stranger = new_page(other.page)
    for url, init in ((messages, post), (f"{node.url}/v1/agents", read)):
        answer = stranger.evaluate("([u, i]) => corsFetch(u, i)", [url, init])
        assert "error" in answer, answer
    assert logged(servers, schema, "turn.start") == []

    app = new_page(allowed.page)
    answer = app.evaluate("([u, i]) => corsFetch(u, i)", [messages, post])
    assert answer.get("status") == 202, answer
    assert answer["contentType"].startswith("application/json")  # an exposed header
    turn_id = json.loads(answer["body"])["turnId"]
    turn = app.evaluate(
        "([u, i]) => corsFetch(u, i)", [f"{node.url}/v1/agents/assistant/turns/{turn_id}", read]
    )
    assert turn.get("status") == 200 and json.loads(turn["body"])["turnId"] == turn_id, turn
    assert [e.metadata.turn_id for e in logged(servers, schema, "turn.start")] == [turn_id]

    with node.http() as http:
        preflights = {
            origin: http.options(
                "/v1/agents/assistant/messages",
                headers={
                    "Origin": origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )
            for origin in (allowed.origin, other.origin)
        }
        welcome, stranger_preflight = preflights[allowed.origin], preflights[other.origin]
        assert welcome.status_code == 200, welcome.text
        assert welcome.headers["access-control-allow-origin"] == allowed.origin
        assert stranger_preflight.status_code == 403, stranger_preflight.text
        assert error_code(stranger_preflight) == "origin_not_allowed"
        if not token:
            return
        issued = http.post("/v1/stream-tokens", json={"agentId": "assistant", "turnId": turn_id})
        assert issued.status_code == 201, issued.text
    stream = f"{node.url}/v1/agents/assistant/turns/{turn_id}/stream?st={issued.json()['token']}"
    stranger.evaluate("([u, t]) => listen(u, t)", [stream, [*EVENT_TYPES, *CONTROL_FRAMES]])
    stranger.wait_for_function("() => sse.source.readyState === 2")  # failed, for good
    kinds = stranger.evaluate("() => sse.log.map(e => e.kind)")
    assert "open" not in kinds and "event" not in kinds, kinds
    # What it was answered (a CORS failure: Chromium reports no response to the page or to
    # Playwright, so ask the same thing with the same Origin).
    answered = httpx.get(stream, headers={"Origin": other.origin}, timeout=30)
    assert (answered.status_code, error_code(answered)) == (403, "origin_not_allowed")


# --- 2. with a token: an allowed page streams a live turn ----------------------------------------


@pytest.mark.timeout(240)  # two node starts and a resumed turn: 35-90 s here
def test_an_allowed_pages_event_source_reads_a_live_turn_across_a_kill_and_stops_after_the_end(
    serve: ServeFactory,
    pages: Callable[[], PageServer],
    new_page: Callable[[str], Page],
    fake_anthropic: FakeAnthropic,
    tmp_path: Path,
) -> None:
    """The page gets a stream token from its back end (here: the test, with the API token) and
    opens ``EventSource(.../stream?st=...&chunks=true)`` through a counting proxy. Mid-turn, in
    a mutating tool, the node is killed (SIGKILL) and started again on the same port: the server
    side of the connection is gone, the browser reconnects on its own with Last-Event-ID, and the
    resumed turn's events follow. Across both connections the page receives every stored event
    of the turn once, in order. After turn.end the browser reconnects once, is answered 204, and
    closes the source for good (CLOSED: no connection after that one). Neither token is ever in
    the node's log."""
    marker = tmp_path / "talker-ran.txt"
    marker.touch()
    write_agent(tmp_path, "talker", TALKER.format(url=fake_anthropic.url))
    fake_anthropic.script(
        Reply(text="noting", tool_uses=[ToolUse("record", {"path": str(marker), "seconds": 60})]),
        Reply(text="word " * 80, chunk_size=8, event_delay=0.02),  # ~1 s of deltas
    )
    app = pages()
    node = serve(
        DISPACH_API_TOKEN=API_TOKEN,
        DISPACH_SECRET=SECRET,
        DISPACH_ALLOWED_ORIGINS=app.origin,
        DISPACH_TEST_ANTHROPIC_KEY="test",
    )
    proxy = CountingProxy(node.port)
    try:
        with node.http() as http:
            accepted = http.post("/v1/agents/talker/messages", json={"text": "note it"})
            assert accepted.status_code == 202, accepted.text
            turn_id = accepted.json()["turnId"]
            issued = http.post("/v1/stream-tokens", json={"agentId": "talker", "turnId": turn_id})
            assert issued.status_code == 201, issued.text
        token = issued.json()["token"]
        path = f"/v1/agents/talker/turns/{turn_id}/stream"
        page = new_page(app.page)
        answers = Responses(page, path)
        page.evaluate(
            "([u, t]) => listen(u, t)",
            [f"{proxy.url}{path}?st={token}&chunks=true", [*EVENT_TYPES, *CONTROL_FRAMES]],
        )

        page.wait_for_function("() => sse.log.some(e => e.type === 'tool.call')")
        wait_until(lambda: marker.read_text() == "ran\n", "the tool to start")
        assert turn_status(node, "talker", turn_id) == "running"
        before = page.evaluate("() => sse.log.filter(e => e.kind === 'event').length")
        node.kill()
        page.wait_for_function("() => sse.log.some(e => e.kind === 'error')")
        node.start()  # same port, same data: the turn resumes
        try:
            page.wait_for_function(
                "() => sse.log.some(e => e.type === 'stream.ended')", timeout=60_000
            )
        except PlaywrightTimeout:
            seen = [
                (e["kind"], e.get("type"), e.get("state"))
                for e in page.evaluate("() => sse.log")
                if e.get("type") != "model.chunk"
            ]
            asked = [(round(r.at - time.time(), 1), r.reached, r.header("last-event-id"))
                     for r in proxy.requests(path)]  # fmt: skip
            raise AssertionError(
                f"no stream.ended in 60 s; turn {turn_status(node, 'talker', turn_id)}; the page "
                f"saw {seen}; answers {answers.seen}; requests {asked}; "
                f"node log: {node.output()[-3000:]}"
            ) from None
        ended_at = page.evaluate("() => sse.log.find(e => e.type === 'stream.ended').t") / 1000
        # After the end the browser reconnects once, is answered 204 and closes the source for
        # good: CLOSED (2), from which an EventSource never reconnects (it would be CONNECTING,
        # 0, if the answer invited another try). What it asked of the proxy is checked below.
        page.wait_for_function("() => sse.source.readyState === 2", timeout=30_000)

        with node.http() as http:
            stored = http.get(f"{path[:-7]}/events", params={"limit": "10000"})
        assert stored.status_code == 200, stored.text
        cursors = [e["cursor"] for e in stored.json()["events"]]
        log = page.evaluate("() => sse.log")
        frames = [e for e in log if e["kind"] == "event" and e["type"] in REGISTRY]
        assert [f["data"]["cursor"] for f in frames] == cursors, "every event once, in order"
        assert [f["id"] for f in frames] == cursors  # the SSE id is the cursor
        assert [f["type"] for f in frames] == [e["type"] for e in stored.json()["events"]]
        assert frames[-1]["type"] == "turn.end"
        assert "model.chunk" in [f["type"] for f in frames]
        assert 0 < before < len(cursors), "the page read the turn live, before its end"

        cut = next(i for i, e in enumerate(log) if e["kind"] == "error")
        last_before_cut = [e["id"] for e in log[:cut] if e["kind"] == "event"][-1]
        streams = proxy.requests(path)
        reached = [s for s in streams if s.reached]
        assert reached[0].header("last-event-id") is None
        resumed = reached[1]  # the first request that reached the restarted node
        assert resumed.header("last-event-id") == last_before_cut, resumed.head
        after_end = [s for s in streams if s.at >= ended_at]
        assert len(after_end) == 1, [(s.at - ended_at, s.header("last-event-id")) for s in streams]
        assert after_end[0].header("last-event-id") == cursors[-1]  # turn.end's cursor
        assert answers.seen[-1][1] == 204, answers.seen
        assert page.evaluate("() => sse.source.readyState") == 2  # CLOSED: it stopped for good
    finally:
        proxy.close()
    assert node.stop() == 0
    output = node.output()
    assert token not in output and token.split(".")[-1] not in output
    assert API_TOKEN not in output and SECRET not in output


# --- 3. clients without Origin are unaffected ----------------------------------------------------


def test_curl_the_python_client_and_the_cli_work_as_before(
    serve: ServeFactory, pages: Callable[[], PageServer]
) -> None:
    """The README's curl commands (with the token), the Python client and `dispach send` against
    a node with a token and an allowed origin: none sends Origin, none is affected."""
    node = serve(
        DISPACH_API_TOKEN=API_TOKEN,
        DISPACH_SECRET=SECRET,
        DISPACH_ALLOWED_ORIGINS=pages().origin,
    )
    auth = ["-H", f"Authorization: Bearer {API_TOKEN}"]

    def curl(*args: str, status: int = 200) -> str:
        done = subprocess.run(
            ["curl", "-sS", "--max-time", "30", "-w", "\n%{http_code}", *auth, *args],
            capture_output=True,
            check=False,
        )
        assert done.returncode == 0, (args, done.stderr)
        body, _, code = done.stdout.decode().rpartition("\n")
        assert int(code) == status, (args, code, body)
        return body

    accepted = json.loads(
        curl(
            f"{node.url}/v1/agents/assistant/messages",
            "-H",
            "content-type: application/json",
            "-d",
            '{"text": "calculate 6*7", "sessionKey": "demo"}',
            status=202,
        )
    )
    turn_id = accepted["turnId"]
    stream = curl("-N", f"{node.url}/v1/agents/assistant/turns/{turn_id}/stream?chunks=true")
    assert "event: turn.end" in stream and "event: stream.ended" in stream
    assert json.loads(curl(f"{node.url}/v1/agents/assistant/turns/{turn_id}"))["status"] == "final"
    # A POST without a body needs no Content-Type: the turn has ended, so nothing to stop.
    stop = f"{node.url}/v1/agents/assistant/turns/{turn_id}/stop"
    assert json.loads(curl("-X", "POST", stop, status=409))["error"]["code"] == "turn_not_running"

    with Client(node.url, token=API_TOKEN) as client:
        sent = client.send("assistant", "calculate 6*7")
        frames = list(client.stream_turn("assistant", sent.turn_id))
    assert frames[-1].event == "stream.ended"
    assert "turn.end" in [f.event for f in frames]

    cli = subprocess.run(
        [DISPACH, "send", "calculate 6*7"],
        env=node.env | {"DISPACH_URL": node.url},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr.decode()
    assert "42" in cli.stdout.decode()


def test_a_body_that_is_not_json_is_refused_without_an_origin_too(
    serve: ServeFactory, servers: Servers, schema: str
) -> None:
    """Whatever sends it, a body that does not say application/json is 415
    content_type_unsupported and starts nothing; a JSON body with a charset, or a POST with no
    body and no type, is taken."""
    node = serve()
    path = "/v1/agents/assistant/messages"
    body = b'{"text": "hello"}'
    with node.http() as http:
        for kind in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonp",
            None,
        ):
            headers = {} if kind is None else {"Content-Type": kind}
            response = http.post(path, content=body, headers=headers)
            assert response.status_code == 415, (kind, response.text)
            assert error_code(response) == "content_type_unsupported", kind
        chunked = http.post(path, content=iter([body]))  # chunked, no type
        assert (chunked.status_code, error_code(chunked)) == (415, "content_type_unsupported")
        assert logged(servers, schema, "turn.start") == []
        typed = http.post(
            path, content=body, headers={"Content-Type": "application/json; charset=utf-8"}
        )
        assert typed.status_code == 202, typed.text
        turn_id = typed.json()["turnId"]
        wait_until(lambda: turn_status(node, "assistant", turn_id) != "running", "the turn's end")
        stop = http.post(f"/v1/agents/assistant/turns/{turn_id}/stop")  # Content-Length: 0
        assert (stop.status_code, error_code(stop)) == (409, "turn_not_running"), stop.text
