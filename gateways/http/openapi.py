"""``GET /v1/openapi.json``: the OpenAPI 3.1 document, rendered from the operations the server
serves (gateways/http/routes.py) and the msgspec types their handlers decode and encode
(gateways/api/schemas.py), so it cannot drift from either."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from gateways.api.fork import MAX_INDEX
from gateways.http.constraints import (
    EXPRESSIONS,
    NO_NUL,
    NOT_ZERO,
    SCHEDULE_SESSION,
    SESSION_KEY,
    time_zones,
)
from gateways.http.errors import ErrorEnvelope
from gateways.http.operation import Operation, answer
from gateways.ingress import MAX_SESSION_KEY, MAX_TEXT, NOT_BLANK
from gateways.streams.tokens import MAX_TTL_S

_REF = "#/components/schemas/{name}"
_ERRORS = {
    "400": "The request is malformed (code, message, hint and often field say how)",
    "401": "A bearer token is required",
    "403": "The Host or the Origin (a web page) is not one this server answers to, a stream "
    "token does not cover this, or (a message) the agent is a team's member that takes tasks "
    "only by handoff (`agent_not_addressable`)",
    "404": "No such agent, turn, session or schedule (or not visible to this token)",
    "409": "The resource is in a state that refuses this (the code says which)",
    "413": "The body is over the size cap",
    "415": "A request body must be `application/json`",
    "501": "Dispach v1 has this operation; this runtime deliberately does not (the code and "
    "hint say why and what to do instead)",
    "503": "The node is not ready (`not_ready`), or Postgres (`store_unavailable`) or NATS "
    "(`nats_unavailable`) is down: nothing was done, retry after `Retry-After` seconds",
    "504": "The session did not accept the message in time: `accepted` is `unknown` (with an "
    "Idempotency-Key a stored turn is answered as a replay instead); retry with the same key",
}
_SECURITY: dict[str, list[dict[str, list[str]]]] = {
    "bearer": [{"bearer": []}],
    "open": [],
    "stream": [{"bearer": []}, {"streamToken": []}],
}


def render(operations: Sequence[Operation]) -> bytes:
    """The document of ``operations``: their paths in the order they come, and a component for
    every msgspec type they name (and the types those name), constrained as the server checks."""
    types: dict[str, Any] = {ErrorEnvelope.__name__: ErrorEnvelope}
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method.lower()] = _resolved(_operation(op), types)
    _, components = msgspec.json.schema_components(types.values(), ref_template=_REF)
    _constrain(components)
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "Dispach API",
            "version": "1",
            "description": "Agent runtime API v1 (wire-compatible with Dispach v1).",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "streamToken": {"type": "apiKey", "in": "query", "name": "st"},
            },
        },
    }
    return msgspec.json.encode(doc)


def _operation(op: Operation) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "summary": op.summary,
        "parameters": list(op.params),
        "responses": dict(op.answers),
    }
    if op.body is not None:
        doc["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": op.body}},
        }
    # Every operation but the always-open ones (health, this document: errors=()) is refused
    # with 503 while the node is not ready (gateways/http/readiness.py).
    for status in (*op.errors, "503") if op.errors and "503" not in op.errors else op.errors:
        doc["responses"][status] = answer(ErrorEnvelope, _ERRORS[status])
    doc["security"] = _SECURITY[op.security]
    return doc


def _resolved(schema: Any, types: dict[str, Any]) -> Any:
    """``schema`` with each msgspec type in it replaced by its component's ``$ref``, and the
    type added to ``types`` (the components to generate)."""
    match schema:
        case dict():
            return {key: _resolved(value, types) for key, value in schema.items()}
        case list():
            return [_resolved(value, types) for value in schema]
        case type():
            types.setdefault(schema.__name__, schema)
            return {"$ref": _REF.format(name=schema.__name__)}
        case _:
            return schema


def _constrain(components: dict[str, Any]) -> None:
    """What the server checks beyond the types (gateways/ingress.py `check`), so generated
    requests and the server agree on what is valid. The checks are not in the msgspec types
    because v1 clients expect their own error codes (e.g. `message_text_required`)."""
    body = components["MessageBody"]["properties"]
    body["text"].update(minLength=1, maxLength=MAX_TEXT, pattern=NOT_BLANK)
    no_nul = {"pattern": NO_NUL}
    session = {"minLength": 1, "maxLength": MAX_SESSION_KEY, "pattern": SESSION_KEY,
               "allOf": [{"pattern": NOT_BLANK}]}  # fmt: skip
    body["sessionKey"].update(session)
    # A fork's turn: an index from 1, or a turn id (fork_invalid otherwise); its new session's
    # key is checked as a message's is (session_key_invalid).
    fork = components["ForkBody"]["properties"]
    fork["atTurn"]["anyOf"] = [{"type": "integer", "minimum": 1, "maximum": MAX_INDEX},
                               {"type": "string", "minLength": 1}]  # fmt: skip
    fork["newKey"]["anyOf"] = [{"type": "string", **session}, {"type": "null"}]
    for name in ("Deliver", "Sender"):
        for prop in components[name]["properties"].values():
            if prop.get("type") == "string":
                prop.update(no_nul)
    # A schedule must say where its replies go ("none" is an answer; leaving it out is refused
    # with schedule_missing_delivery). Expressions, zones and sessions are checked by the server
    # (schedule_invalid): no schema can say which cron expressions exist.
    # An approval's answer must say yes or no (missing: approval_decision_required, v1's code).
    components["Decision"]["required"] = ["granted"]
    components["Decision"]["properties"]["granted"] = {"type": "boolean"}
    spec = components["ScheduleSpec"]
    spec["required"] = sorted({*spec.get("required", []), "deliver"})
    spec["properties"]["task"].update(minLength=1, pattern=NOT_BLANK)
    # The expression by kind, the zone, the session: see EXPRESSIONS, time_zones and
    # SCHEDULE_SESSION; what no schema can say (a cron that never fires, a duration's bounds, an
    # `at` too far ahead) is still refused with schedule_invalid.
    spec["allOf"] = [
        {
            "if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
            "then": {"properties": {"expr": {"pattern": pattern, **NOT_ZERO.get(kind, {})}}},
        }
        for kind, pattern in EXPRESSIONS.items()
    ]
    spec["properties"]["expr"]["description"] = (
        "By `kind`: cron, 5 fields (or 6, seconds first) that must fire some day; every, a "
        "duration like `1h30m` from 1 s to 366 days; at, ISO 8601 at most ten years ahead "
        "(without an offset it is read in `timezone`)"
    )
    spec["properties"]["timezone"]["anyOf"][0] = {"type": "string", "enum": time_zones()}
    spec["properties"]["timezone"]["description"] = (
        "An IANA name of the node's tz database (listed); null or empty is UTC"
    )
    # null is the type's "not given", refused like a missing delivery (schedule_missing_delivery).
    deliver = spec["properties"]["deliver"]
    deliver["anyOf"] = [kind for kind in deliver["anyOf"] if kind != {"type": "null"}]
    deliver.pop("default", None)
    spec["properties"]["session"].update(
        pattern=SCHEDULE_SESSION, maxLength=len("shared:") + MAX_SESSION_KEY
    )
    # A stream token is for one turn, one session, or (neither) the agent's whole stream; not
    # both (stream_token_target_invalid).
    token = components["TokenRequest"]
    token["properties"].update(
        agentId={"type": "string", "minLength": 1},
        turnId={"type": "string", "minLength": 1},
        sessionKey={"type": "string", **session},
        ttlS={"type": "integer", "minimum": 1, "maximum": MAX_TTL_S},
    )
    token["not"] = {"required": ["turnId", "sessionKey"]}
