"""Tracing: OpenTelemetry spans of requests, turns, steps, model calls, tool calls and
deliveries, exported over OTLP/HTTP; the one module that uses OpenTelemetry.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, and
then free: the SDK is never imported, and every function here tests :data:`ENABLED` first and
hands back a shared do-nothing object, so the hot paths build no span and call no API.

Context crosses processes as a W3C ``traceparent`` (validated by the SDK's propagator; a
malformed one is ignored): in HTTP request headers, in NATS message headers (a command forwarded
to its session's owner, a message through the NATS door), and in the log, as the
``correlation_id`` of an event's metadata: ``turn.start`` carries the context that asked for the
turn, the turn's own events carry its span's. So a turn run on another node, or resumed after a
crash, is a child of the request that made it, and a delivery links to the turn that promised
it. ``tracestate`` travels with the live context but is not stored (the log keeps the
``traceparent`` only). With tracing off, no header is added and nothing extra is stored.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

ENABLED = False
"""Whether spans are made; read it as ``tracing.ENABLED`` (it changes at :func:`configure`)."""


def enabled() -> bool:
    """Whether spans are made (for a module that imports this one's functions by name)."""
    return ENABLED


_tracer: Tracer | None = None
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for tracing (an OTLP endpoint is set)."""
    return any(environ.get(name) for name in _ENDPOINTS)


class Tracing:
    """Tracing on for this process: :meth:`shutdown` exports what is buffered, then stops."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider

    def flush(self) -> None:
        """Export every span ended so far, now (a bench or a test reading what was sent)."""
        self._provider.force_flush()

    def shutdown(self) -> None:
        """Make no more spans, export what is buffered, stop the exporter (once)."""
        global ENABLED, _tracer
        if _tracer is not None:
            ENABLED, _tracer = False, None
            self._provider.shutdown()


def configure(
    node_id: str, environ: Mapping[str, str] = os.environ, exporter: SpanExporter | None = None
) -> Tracing | None:
    """Turn tracing on when the environment asks for it (or an ``exporter`` is given: tests and
    benches) and it is not on already; None otherwise. Spans are batched (BatchSpanProcessor)
    and sent by the SDK's thread, never on the event loop. ``service.name`` is ``dispach``
    unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` say otherwise."""
    global ENABLED, _tracer  # noqa: PLW0603 - the process's one switch, read on the hot paths
    if ENABLED or (exporter is None and not wanted(environ)):
        return None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, timeout: the OTEL_* variables
    ours = Resource.create({"service.name": "dispach", "dispach.node.id": node_id})
    provider = TracerProvider(resource=ours.merge(OTELResourceDetector().detect()))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = provider.get_tracer("dispach")
    ENABLED = True
    return Tracing(provider)


# --- context ------------------------------------------------------------------------------------


def _extract(carrier: Mapping[str, str]) -> Context:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def _context_of(traceparent: str | None) -> Context:
    """The context a stored ``traceparent`` names; an empty one (a new trace) for None or a
    malformed one, never the ambient context of whoever started the coroutine."""
    return _extract({"traceparent": traceparent} if traceparent else {})


def _traceparent(span: Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def traceparent() -> str | None:
    """The current span's ``traceparent`` (to store with an event), or None."""
    if not ENABLED:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return _traceparent(span) if span.get_span_context().is_valid else None


def headers() -> dict[str, str] | None:
    """The current context as NATS message headers, or None (tracing off, or no span)."""
    if not ENABLED:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier or None


@contextlib.contextmanager
def _current(span: Span) -> Iterator[None]:
    from opentelemetry import trace

    # Errors are set by the callers, as codes: an exception's text may quote what it was given.
    with trace.use_span(
        span, end_on_exit=True, record_exception=False, set_status_on_exception=False
    ):
        yield


def _kind(name: str) -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind[name]


def _error(span: Span, code: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", code)
    span.set_status(Status(StatusCode.ERROR, code))


# --- HTTP and NATS ------------------------------------------------------------------------------


class Request:
    """The server span of one HTTP request, current while the request is handled."""

    def __init__(self, span: Span) -> None:
        self.span = span

    def answered(self, method: str, route: str, status: int) -> None:
        self.span.update_name(f"{method} {route}" if route != "unmatched" else method)
        self.span.set_attribute("http.route", route)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            _error(self.span, str(status))


@contextlib.contextmanager
def request(method: str, path: str, carrier: Mapping[str, str]) -> Iterator[Request]:
    """A SERVER span for an HTTP request (``carrier``: its ``traceparent``/``tracestate``, if
    it sent them), current inside the block. Only called with tracing on."""
    assert _tracer is not None
    span = _tracer.start_span(method, _extract(carrier), _kind("SERVER"),
                              {"http.request.method": method, "url.path": path})  # fmt: skip
    with _current(span):
        yield Request(span)


# With tracing off these return a shared ``nullcontext``: no generator is made per call.
_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()
_NO_HEADERS: contextlib.nullcontext[None] = contextlib.nullcontext()


def command(
    kind: str, node: str, carrier: Mapping[str, str] | None
) -> contextlib.AbstractContextManager[None]:
    """The span of a command that crossed nodes (``carrier``: its NATS headers): a SERVER span
    on the node that serves it, a child of the sender's context. Nothing with tracing off."""
    if not ENABLED or not carrier:
        return _NOTHING
    assert _tracer is not None
    span = _tracer.start_span(f"dispach.command {kind}", _extract(carrier), _kind("SERVER"),
                              {"dispach.command": kind, "dispach.node.id": node})  # fmt: skip
    return _current(span)


@contextlib.contextmanager
def _forward(kind: str, node: str) -> Iterator[dict[str, str] | None]:
    assert _tracer is not None
    attributes = {"dispach.command": kind, "dispach.node.target": node}
    span = _tracer.start_span(
        f"dispach.forward {kind}", kind=_kind("CLIENT"), attributes=attributes
    )
    with _current(span):
        yield headers()


def forward(kind: str, node: str) -> contextlib.AbstractContextManager[dict[str, str] | None]:
    """A CLIENT span for a command sent to node ``node``; yields the headers to send it with
    (None with tracing off)."""
    return _forward(kind, node) if ENABLED else _NO_HEADERS


def attached(carrier: Mapping[str, str] | None) -> contextlib.AbstractContextManager[None]:
    """The context in ``carrier`` (a message's NATS headers) made current inside the block."""
    if not ENABLED or not carrier:
        return _NOTHING
    return _attach(_extract(carrier))


# --- turns --------------------------------------------------------------------------------------


class Untraced:
    """A turn with tracing off: every method does nothing."""

    traceparent: str | None = None

    def step(self, number: int) -> None:
        """A step begins (the one before it, if still open, ends)."""

    def step_done(self) -> None:
        """The step ends."""

    def model_call(self, label: str, model: str) -> None:
        """A model call begins (``label``: the model adapter's, e.g. ``anthropic:<model>``)."""

    def model_done(self, usage: Any, stop_reason: str | None) -> None:
        """The model call ended with a reply (``usage``: an ``actors.model.Usage``)."""

    def model_failed(self, code: str) -> None:
        """The model call failed with ``code``."""

    def current(self) -> contextlib.AbstractContextManager[None]:
        """The step's context made current inside the block (tool calls take it as parent)."""
        return contextlib.nullcontext()

    def end(self, reason: str | None, steps: int, error: str | None = None) -> None:
        """The turn's run ends (``reason`` None: unfinished, left for the next owner); only
        the first call counts."""


UNTRACED = Untraced()


def provider_of(label: str) -> str:
    """``gen_ai.provider.name`` from a model adapter's label: ``anthropic:claude-…`` →
    ``anthropic``, ``scripted (offline)`` → ``scripted``."""
    return label.split(":", 1)[0].split(" ", 1)[0]


class TurnTrace(Untraced):
    """The spans of one run of a turn: ``dispach.turn``, its ``dispach.step`` children, and a
    ``chat`` span per model call (the GenAI semantic conventions). Spans are started with
    explicit parents, not the ambient context: the turn's coroutine outlives the request. A
    turn the sampler left out (``OTEL_TRACES_SAMPLER``) makes no step or chat span: they would
    be left out too, after costing their making."""

    def __init__(self, tracer: Tracer, parent: str | None, attributes: dict[str, Any]) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._span = tracer.start_span("dispach.turn", _context_of(parent), attributes=attributes)
        self.traceparent = _traceparent(self._span)
        self._turn = trace.set_span_in_context(self._span)
        self._step: Span | None = None
        self._parent = self._turn
        self._model: Span | None = None
        self._ended = False
        self._sampled = self._span.is_recording()

    def step(self, number: int) -> None:
        self.step_done()
        if not self._sampled:
            return
        attributes = {"dispach.step.number": number}
        self._step = self._tracer.start_span("dispach.step", self._turn, attributes=attributes)
        self._parent = self._trace.set_span_in_context(self._step)

    def step_done(self) -> None:
        if self._step is not None:
            self._step.end()
            self._step, self._parent = None, self._turn

    def model_call(self, label: str, model: str) -> None:
        if not self._sampled:
            return
        provider = provider_of(label)
        self._model = self._tracer.start_span(f"chat {model}", self._parent, _kind("CLIENT"), {
            "gen_ai.operation.name": "chat", "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
        })  # fmt: skip

    def model_done(self, usage: Any, stop_reason: str | None) -> None:
        span, self._model = self._model, None
        if span is None:
            return
        # input_tokens is everything the model read, cached or not (as model.result counts it).
        span.set_attributes({
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
            "gen_ai.usage.cache_read_input_tokens": usage.cache_read_tokens,
            "gen_ai.usage.cache_creation_input_tokens": usage.cache_write_tokens,
            "gen_ai.response.finish_reasons": [stop_reason or ""],
        })  # fmt: skip
        span.end()

    def model_failed(self, code: str) -> None:
        span, self._model = self._model, None
        if span is not None:
            _error(span, code)
            span.end()

    def current(self) -> contextlib.AbstractContextManager[None]:
        return _attach(self._parent)

    def end(self, reason: str | None, steps: int, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if self._model is not None:  # cut short by a stop, a timeout or a drain
            self._model.set_attribute("dispach.cut_short", True)
            self._model.end()
            self._model = None
        self.step_done()
        self._span.set_attributes({"dispach.turn.outcome": reason or "unfinished",
                                   "dispach.turn.steps": steps})  # fmt: skip
        if error is not None:
            _error(self._span, error)
        self._span.end()


@contextlib.contextmanager
def _attach(ctx: Context) -> Iterator[None]:
    from opentelemetry import context

    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def turn(
    parent: str | None, agent_id: str, session_key: str, turn_id: str, node_id: str, attempt: int
) -> Untraced:
    """The trace of one run of a turn, a child of ``parent`` (its turn.start's traceparent)."""
    if not ENABLED:
        return UNTRACED
    assert _tracer is not None
    return TurnTrace(_tracer, parent, {
        "dispach.agent.id": agent_id, "dispach.session.key": session_key,
        "dispach.turn.id": turn_id, "dispach.turn.attempt": attempt, "dispach.node.id": node_id,
    })  # fmt: skip


# --- tools and deliveries -----------------------------------------------------------------------


class Call:
    """A span that ends with the block; :meth:`failed` marks it failed first."""

    def __init__(self, span: Span | None = None) -> None:
        self._span = span

    def failed(self, code: str) -> None:
        if self._span is not None:
            _error(self._span, code)


_NO_CALL = Call()


@contextlib.contextmanager
def _span(
    name: str, kind: str, attributes: dict[str, Any], links: list[Any], root: bool = False
) -> Iterator[Call]:
    from opentelemetry.context import Context

    assert _tracer is not None
    parent = Context() if root else None  # None: the current context
    span = _tracer.start_span(name, parent, _kind(kind), attributes, links)
    with _current(span):
        yield Call(span)


def tool_call(name: str, call_id: str) -> contextlib.AbstractContextManager[Call]:
    """An ``execute_tool`` span (its name and call id; never its arguments), a child of the
    current context (the step's, see :meth:`TurnTrace.current`)."""
    if not ENABLED:
        return contextlib.nullcontext(_NO_CALL)
    return _span(f"execute_tool {name}", "INTERNAL", {
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
    }, [])  # fmt: skip


def delivery(
    channel: str, item_id: str, attempt: int, turn: str | None
) -> contextlib.AbstractContextManager[Call]:
    """A PRODUCER span for one delivery attempt, linked to the turn that promised the reply
    (``turn``: the traceparent its events were stored with): a delivery may come long after
    the turn, from another node, so it starts a trace of its own rather than extend the turn's."""
    if not ENABLED:
        return contextlib.nullcontext(_NO_CALL)
    from opentelemetry import trace

    linked = trace.get_current_span(_context_of(turn)).get_span_context() if turn else None
    links = [trace.Link(linked)] if linked is not None and linked.is_valid else []
    return _span(f"dispach.delivery {channel}", "PRODUCER", {
        "dispach.channel": channel, "dispach.outbox.item": item_id,
        "dispach.delivery.attempt": attempt,
    }, links, root=True)  # fmt: skip
