"""The OpenAPI 3.1 document of the HTTP API, generated from the input models.

Why generated: the request schemas are the pydantic models the service validates with
(``core.requests``), so the document cannot drift from what the server accepts. The answers'
schemas are generated the same way from their types (``core.answers``; the error envelope from
``api.errors.CODES``), which tests validate real answers against, closed.

The document says exactly what the server accepts (schemathesis checks it against a live server
in ``tests/api/test_schemathesis.py``): the rules the models check in code rather than by type
are added by ``_exact`` as JSON Schema (``oneOf`` for exclusive fields, the device classes,
the node binding; the duration grammar; ``binding: 'instance'``, which the server answers
``UNSUPPORTED``, left out). Integers are JSON's: ``168.0`` is the integer 168, as JSON Schema
and the server both read it. Where a rule is arithmetic across fields (``start`` plus
``duration`` within the calendar; a duration's total at most 366 days), the document states a
narrower range that the server always accepts, and says so in the field's description.

Pure: builds a dict; never reads a request, a database or a file.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Annotated, Any

from pydantic import ConfigDict, TypeAdapter, WithJsonSchema, with_config
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from typing_extensions import TypedDict

from bettercompute.api import errors, operations
from bettercompute.core import answers, durations, requests, states

_REF = "#/components/schemas/{model}"

# The error answers every operation may give: status -> (component name, description).
_ERRORS: Mapping[int, tuple[str, str]] = {
    400: (
        "BadRequest",
        "INVALID_INPUT (naming the field: a body field, 'body' for a body that is not a JSON "
        "object, 'request' for a request that is not valid HTTP, or the 'X-Better-Compute' "
        "header; also a request the pool cannot serve: a device class or binding it does not "
        "offer) or UNSUPPORTED",
    ),
    401: (
        "Unauthenticated",
        "ACCESS_DENIED: the bearer token (or the console's session cookie) is missing or not valid",
    ),
    402: ("SpendLimitReached", "SPEND_LIMIT_REACHED: the caller's budget is spent"),
    403: (
        "Forbidden",
        "ACCESS_DENIED (tenant pre-check or policy), CONFIRMATION_REQUIRED, or QUOTA_EXCEEDED"
        " (details.quota lists what is short; retrying unchanged fails again)",
    ),
    404: ("NotFound", "NOT_FOUND: the reservation or pool, or the route, does not exist"),
    408: ("TimedOut", "INVALID_INPUT with field 'body': the body did not arrive in time"),
    405: ("MethodNotAllowed", "INVALID_INPUT with field 'method': operations are POST only"),
    409: (
        "Conflict",
        "CONFLICT (details.reservationId), INVALID_STATE, or CAPACITY_UNAVAILABLE",
    ),
    413: ("TooLarge", "INVALID_INPUT with field 'body': the body is over the size limit"),
    429: (
        "TooManyRequests",
        "TOO_MANY_REQUESTS: this client is over its share; retry after Retry-After seconds",
    ),
    500: ("Internal", "INTERNAL: an unexpected server error; details.requestId identifies it"),
    503: (
        "Unavailable",
        "UNAVAILABLE: the database cannot be reached or the server is full; retry after"
        " Retry-After seconds",
    ),
}

#: The answers, by the name ``Operation.answer`` gives: the types in ``core.answers``.
ANSWERS: Mapping[str, Any] = {
    name: getattr(answers, name)
    for name in (
        "Reservation",
        "ReservationList",
        "ExtendResult",
        "Preview",
        "Whoami",
        "PoolList",
        "QuotaList",
        "UsageReport",
        "SearchResult",
        "Subscription",
        "SubscriptionList",
        "DeliveryList",
        "Confirmation",
        "ConfirmationList",
        "Timeline",
        "History",
    )
}


@with_config(ConfigDict(extra="forbid"))
class ErrorBody(TypedDict):
    code: Annotated[str, WithJsonSchema({"enum": list(errors.CODES)})]
    message: str
    details: dict[str, Any]


@with_config(ConfigDict(extra="forbid"))
class Error(TypedDict):
    """The error envelope every refusal answers with."""

    error: ErrorBody


def _answer_schemas() -> dict[str, Any]:
    """The answers' schemas (and what they refer to), generated from their types."""
    kinds = {**ANSWERS, "Error": Error}
    adapters: list[tuple[str, JsonSchemaMode, TypeAdapter[Any]]] = [
        (name, "serialization", TypeAdapter(kind)) for name, kind in kinds.items()
    ]
    _, top = TypeAdapter.json_schemas(adapters, ref_template=_REF, by_alias=True)
    return dict(top.get("$defs", {}))


def document(ops: Sequence[operations.Operation] = operations.OPERATIONS) -> dict[str, Any]:
    """The whole document, for ``GET /api/compute/openapi.json``."""
    models = list({op.model: None for op in ops})
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas: dict[str, Any] = {
        name: _nullable(schema) for name, schema in top.get("$defs", {}).items()
    }
    _exact(schemas)
    for op in ops:
        if op.optional:
            schemas[op.schema_name] = _relaxed(schemas[op.model.__name__], op.optional)
    schemas.update(_answer_schemas())
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Better Compute",
            "version": _version(),
            "description": (
                "GPU reservations. Every operation is a POST with a JSON body, a bearer token "
                "and the header 'X-Better-Compute: 1'; it answers {\"data\": …} or "
                '{"error": {"code", "message", "details"}}. The event stream '
                "(GET events/watch) and the probes are the GET routes."
            ),
        },
        "paths": {
            **{op.path: {"post": _operation(op)} for op in ops},
            **_plain_paths(),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "parameters": {
                "XBetterCompute": {
                    "name": "X-Better-Compute",
                    "in": "header",
                    "required": True,
                    "description": "Must be '1': a browser cannot send it cross-site unasked.",
                    "schema": {"type": "string", "const": "1"},
                },
                "XRequestId": {
                    "name": "X-Request-Id",
                    "in": "header",
                    "required": False,
                    "description": (
                        "Echoed in the answer when it is 1-128 characters of "
                        "[A-Za-z0-9._:-]; otherwise (or when absent) a new one is made up."
                    ),
                    "schema": {"type": "string"},
                },
            },
            "responses": {
                name: {
                    "description": description,
                    "content": {"application/json": {"schema": _ref("Error")}},
                }
                for name, description in _ERRORS.values()
            },
        },
    }


def _operation(op: operations.Operation) -> dict[str, Any]:
    return {
        "operationId": op.name,
        "summary": op.summary,
        "tags": [op.name.split(".")[0]],
        "security": [{"bearer": []}],
        "parameters": [
            {"$ref": "#/components/parameters/XBetterCompute"},
            {"$ref": "#/components/parameters/XRequestId"},
        ],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _ref(op.schema_name)}},
        },
        "responses": {
            "200": {
                "description": "The answer, in the data envelope.",
                **({"links": _LINKS} if op.name == "reservations.create" else {}),
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["data"],
                            "additionalProperties": False,
                            "properties": {"data": _ref(op.answer)},
                        }
                    }
                },
            },
            **{
                str(status): {"$ref": f"#/components/responses/{name}"}
                for status, (name, _) in _ERRORS.items()
            },
        },
    }


# What a client can do next with the reservation a create answered (stateful tests follow these).
_LINKS = {
    f"{verb.capitalize()}It": {
        "operationId": f"reservations.{verb}",
        "requestBody": {
            "tenantId": "$response.body#/data/tenantId",
            "reservationId": "$response.body#/data/id",
        },
        "description": f"reservations.{verb} on the reservation just created.",
    }
    for verb in ("get", "extend", "renew", "release", "cancel")
}


def _plain_paths() -> dict[str, Any]:
    def get(summary: str, content_type: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "get": {
                "summary": summary,
                "security": [],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {content_type: {"schema": schema}},
                    }
                },
            }
        }

    status = {"type": "object", "properties": {"status": {"type": "string"}}}
    readyz = get("Ready to serve: the caller's readiness check passes", "application/json", status)
    readyz["get"]["responses"]["503"] = {
        "description": "Not ready",
        "content": {"application/json": {"schema": status}},
    }
    return {
        f"{operations.PREFIX}/openapi.json": get(
            "This document", "application/json", {"type": "object"}
        ),
        "/healthz": get("The process is alive", "application/json", status),
        "/readyz": readyz,
        f"{operations.PREFIX}/events/watch": _events_watch(),
    }


def _events_watch() -> dict[str, Any]:
    """The event stream: documented here, though no generated test can call an endless one."""
    return {
        "get": {
            "operationId": "events.watch",
            "summary": "The tenant's events as Server-Sent Events, as they commit",
            "description": (
                "Each message: 'id' the event's id, 'event' its type (reservation.placed …), "
                "'data' the JSON event {id, type, reservationId, at, data}. A comment line "
                "every 15 s keeps a quiet stream open. Resume with the header Last-Event-ID "
                "(or ?after=); without either, the stream starts with the next event. The "
                "caller must be a member of the tenant; a refusal is the usual JSON error, "
                "before anything is streamed."
            ),
            "tags": ["events"],
            "security": [{"bearer": []}],
            "parameters": [
                # Not empty: the server refuses an empty tenantId (INVALID_INPUT, field tenantId).
                {
                    "name": "tenantId",
                    "in": "query",
                    "required": True,
                    "schema": {"type": "string", "minLength": 1},
                },
                {
                    "name": "after",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"},
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[0-9]{1,18}$"},
                },
            ],
            "responses": {
                "200": {
                    "description": "The stream (text/event-stream), open until the caller ends it.",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                **{
                    str(status): {"$ref": f"#/components/responses/{name}"}
                    for status, (name, _) in _ERRORS.items()
                    if status in (400, 401, 403, 503)
                },
            },
        }
    }


# A duration as text, largest unit first: the server's grammar (``core.durations``), with each
# part at most a few digits and the first not zero, so that every text the pattern admits is
# between 1 ms and 366 days (the server also reads longer spellings within that range).
_UNIT_DIGITS = (("d", 2), ("h", 3), ("m", 4), ("s", 5), ("ms", 8))


def _duration_pattern() -> str:
    firsts = []
    for i, (unit, digits) in enumerate(_UNIT_DIGITS):
        rest = "".join(f"(?:[0-9]{{1,{d}}}{u})?" for u, d in _UNIT_DIGITS[i + 1 :])
        firsts.append(f"[1-9][0-9]{{0,{digits - 1}}}{unit}{rest}")
    return "^(?:[1-9][0-9]{0,9}|" + "|".join(firsts) + ")$"


_DURATION_TEXT = {
    "type": "string",
    "pattern": _duration_pattern(),
    "description": (
        "A duration such as '8h', '90m' or '2h30m' (units d, h, m, s, ms, largest first, "
        "ASCII digits), or a bare number of milliseconds; 1 ms to 366 days."
    ),
}
_DURATION_MS = {
    "type": "integer",
    "minimum": 1,
    "maximum": durations.MAX_DURATION_MS,
    "description": "Milliseconds.",
}
_NULL = {"type": "null"}


def _nullable(node: Any) -> Any:
    """pydantic's ``anyOf: [{type: integer, minimum: 60}, {type: null}]`` as ``{type: [integer,
    null], minimum: 60}``: the same set of values, in the form OpenAPI tools read best
    (schemathesis's boundary cases ignore the bounds inside such an ``anyOf``)."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    options = node.get("anyOf")
    if (
        isinstance(options, list)
        and len(options) == 2
        and options[1] == _NULL
        and isinstance(options[0].get("type"), str)
        and "$ref" not in options[0]
    ):
        rest = {key: value for key, value in node.items() if key != "anyOf"}
        node = {**options[0], **rest, "type": [options[0]["type"], "null"]}
    return node


def _exact(schemas: dict[str, Any]) -> None:
    """Add to the generated schemas the rules the input models check in code."""
    device = schemas["DeviceRequest"]
    device["oneOf"] = [
        {"properties": {"class": {"const": "gpu"}, "profile": _NULL}},
        {
            "required": ["profile"],
            "properties": {
                "class": {"const": "mig"},
                "profile": {**device["properties"]["profile"], "type": "string"},
                "topology": {"const": "any"},
            },
        },
        {
            "properties": {
                "class": {"const": "slot"},
                "profile": _NULL,
                "topology": {"const": "any"},
            }
        },
    ]
    device["description"] = (
        "'profile' is for class 'mig' (and required there); 'nvlink-all' is for class 'gpu'."
    )

    create = schemas["CreateInput"]
    props = create["properties"]
    props["binding"]["enum"] = [b for b in props["binding"]["enum"] if b != "instance"]
    props["binding"]["description"] = "'instance' is not served yet (400 UNSUPPORTED)."
    props["duration"] = {"oneOf": [_DURATION_MS, _DURATION_TEXT]}
    latest_start = requests.MAX_EPOCH_MS - durations.MAX_DURATION_MS
    props["start"]["maximum"] = latest_start
    props["start"]["description"] = (
        "Epoch milliseconds. start + duration must end by 9999-12-31; any start up to "
        f"{latest_start} always does."
    )
    create["oneOf"] = [
        {
            "required": ["binding", "node"],
            "properties": {
                "binding": {"const": "node"},
                "node": _ref("NodeProfile"),
                "spot": {"const": False},
            },
        },
        {"properties": {"binding": {"enum": ["hold", "kubernetes"]}, "node": _NULL}},
    ]
    create["description"] = (
        "binding 'node' needs 'node' and is never spot; no other binding has 'node'."
    )

    search = schemas["SearchInput"]
    found = search["properties"]
    found["binding"] = props["binding"]
    found["duration"] = props["duration"]
    found["start"] = {**_NULL, "default": None, "description": "Not taken: give 'from'."}
    found["horizon"] = {
        "anyOf": [_DURATION_MS, _DURATION_TEXT, _NULL],
        "default": None,
        "description": "How far ahead the windows may start (default 14 days; more reads as 90).",
    }
    search["oneOf"] = create["oneOf"]
    search["description"] = (
        "The create input without 'start' (idempotencyKey optional), plus 'from', 'horizon' and "
        "'limit'. binding 'node' needs 'node' and is never spot."
    )

    schemas["ListInput"]["properties"]["state"] = {
        "enum": [*(state.value for state in states.State), None],
        "default": None,
        "description": "Only reservations in this state.",
    }

    extend = schemas["ExtendInput"]
    until = {**extend["properties"]["until"], "type": "integer"}
    del until["default"]
    by: dict[str, Any] = {"oneOf": [_DURATION_MS, _DURATION_TEXT]}
    extend["properties"]["by"] = {"anyOf": [*by["oneOf"], _NULL], "default": None}
    extend["oneOf"] = [
        {"required": ["until"], "properties": {"until": until, "by": _NULL}},
        {"required": ["by"], "properties": {"by": by, "until": _NULL}},
    ]
    extend["description"] = "Exactly one of 'until' (epoch ms) or 'by' (a duration), not null."


def _relaxed(schema: Mapping[str, Any], optional: Sequence[str]) -> dict[str, Any]:
    relaxed = copy.deepcopy(dict(schema))
    relaxed["required"] = [f for f in relaxed.get("required", []) if f not in optional]
    relaxed["title"] = "PreviewInput"
    relaxed["description"] = (
        "The create input; idempotencyKey is optional (a preview stores nothing)."
    )
    return relaxed


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _version() -> str:
    try:
        return metadata.version("better-compute")
    except metadata.PackageNotFoundError:
        return "0.0.0"
