"""The OpenAPI 3.1 document of the HTTP API, generated from the input models.

Why generated: the request schemas are the pydantic models the service validates with
(``core.requests``), so the document cannot drift from what the server accepts. The answers
(the reservation object, the list page, the extend result, the preview) have no input model;
their schemas are written here from the guide, and the error envelope from
``api.errors.CODES``.

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
from typing import Any

from pydantic.json_schema import models_json_schema

from bettercompute.api import errors, operations
from bettercompute.core import durations, requests, states

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
    401: ("Unauthenticated", "ACCESS_DENIED: the bearer token is missing or not valid"),
    402: ("SpendLimitReached", "SPEND_LIMIT_REACHED: the caller's budget is spent"),
    403: ("Forbidden", "ACCESS_DENIED (tenant pre-check or policy) or CONFIRMATION_REQUIRED"),
    404: ("NotFound", "NOT_FOUND: the reservation or pool, or the route, does not exist"),
    408: ("TimedOut", "INVALID_INPUT with field 'body': the body did not arrive in time"),
    405: ("MethodNotAllowed", "INVALID_INPUT with field 'method': operations are POST only"),
    409: ("Conflict", "CONFLICT (details.reservationId) or INVALID_STATE"),
    413: ("TooLarge", "INVALID_INPUT with field 'body': the body is over the size limit"),
    429: ("QuotaExceeded", "QUOTA_EXCEEDED: details.quota lists what is short"),
    500: ("Internal", "INTERNAL: an unexpected server error; details.requestId identifies it"),
    503: (
        "Unavailable",
        "CAPACITY_UNAVAILABLE, or UNAVAILABLE when the database cannot be reached",
    ),
}

_RESERVATION: dict[str, Any] = {
    "type": "object",
    "description": "The guide's reservation object.",
    "required": [
        "id",
        "tenantId",
        "poolId",
        "state",
        "request",
        "during",
        "ownerIdentityId",
        "idempotencyKey",
        "conditions",
        "operation",
        "version",
    ],
    "properties": {
        "id": {"type": "string", "pattern": "^rsv_"},
        "tenantId": {"type": "string"},
        "poolId": {"type": "string"},
        "state": {"enum": [s.value for s in states.State]},
        "request": {"type": "object", "description": "The normalised request as stored."},
        "during": {
            "oneOf": [{"$ref": "#/components/schemas/Window"}, {"type": "null"}],
            "description": "The booked window; null until placed.",
        },
        "ownerIdentityId": {"type": "string"},
        "idempotencyKey": {"type": "string"},
        "conditions": {"type": "array", "items": {"type": "object"}},
        "binding": {"type": ["object", "null"]},
        "operation": {
            "type": "object",
            "required": ["id", "state"],
            "properties": {
                "id": {"type": "string"},
                "state": {"enum": ["running", "pending", "succeeded", "failed"]},
                "error": {"type": "object"},
            },
        },
        "version": {"type": "integer"},
        "createdAt": {"type": "integer", "description": "Epoch milliseconds."},
        "updatedAt": {"type": "integer", "description": "Epoch milliseconds."},
        "requestedStart": {"type": "integer"},
        "leaseExpiresAt": {"type": "integer"},
        "releaseReason": {"type": "string"},
        "hostShare": {"type": "object"},
        "resourceName": {
            "type": "string",
            "description": "The extended resource a kubernetes binding's devices are advertised"
            " as, which only pods labelled with this reservation may ask for.",
        },
    },
}

_ANSWERS: dict[str, Any] = {
    "Window": {
        "type": "object",
        "required": ["start", "end"],
        "properties": {
            "start": {"type": "integer", "description": "Epoch milliseconds."},
            "end": {"type": "integer", "description": "Epoch milliseconds, exclusive."},
        },
    },
    "Reservation": _RESERVATION,
    "ReservationList": {
        "type": "object",
        "required": ["items", "nextCursor"],
        "properties": {
            "items": {"type": "array", "items": {"$ref": "#/components/schemas/Reservation"}},
            "nextCursor": {
                "type": ["string", "null"],
                "description": "Pass as 'cursor' for the next page; null on the last page.",
            },
        },
    },
    "ExtendResult": {
        "type": "object",
        "required": ["reservation", "extended"],
        "properties": {
            "reservation": {"$ref": "#/components/schemas/Reservation"},
            "extended": {"type": "boolean"},
            "availableUntil": {
                "type": "integer",
                "description": "When another booking starts first: how far it could extend.",
            },
        },
    },
    "Preview": {
        "type": "object",
        "required": ["fits", "poolId", "during", "nodeIds", "devices", "message", "rejected"],
        "properties": {
            "fits": {"type": "boolean"},
            "poolId": {"type": "string"},
            "during": {"$ref": "#/components/schemas/Window"},
            "nodeIds": {"type": "array", "items": {"type": "string"}},
            "devices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["nodeId", "deviceIds"],
                    "properties": {
                        "nodeId": {"type": "string"},
                        "deviceIds": {"type": "array", "items": {"type": "string"}},
                    },
                },
            },
            "message": {"type": "string", "description": "'fits', or the placer's summary."},
            "resources": {
                "type": "object",
                "description": "What each node would book of its host (vcpu, memoryGiB, "
                "hugepages1Gi): the request's resources, raised to the pool's share.",
            },
            "hostShare": {
                "type": "object",
                "description": "The part of it that is the pool's per-GPU share (rides on the "
                "GPUs' quota); {} when the pool has none.",
            },
            "never": {
                "type": "boolean",
                "description": "true: no node of the pool could hold it even with every device "
                "free (message starts 'never fits this pool:'); waiting will not help.",
            },
            "rejected": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "description": "Nodes rejected per filter (ready, labels, health, capacity …).",
            },
        },
    },
    "Whoami": {
        "type": "object",
        "required": ["identityId", "tenantId", "kind", "groups"],
        "properties": {
            "identityId": {"type": "string"},
            "tenantId": {"type": "string"},
            "kind": {"type": "string"},
            "groups": {"type": "array", "items": {"type": "string"}},
        },
    },
    "PoolList": {
        "type": "object",
        "required": ["items"],
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["poolId", "nodes", "nodesReady", "devices"],
                    "properties": {
                        "poolId": {"type": "string"},
                        "name": {"type": "string"},
                        "region": {"type": "string"},
                        "gpuModel": {"type": ["string", "null"]},
                        "sharing": {"type": "string"},
                        "nodes": {"type": "integer"},
                        "nodesReady": {"type": "integer"},
                        "devices": {
                            "type": "object",
                            "description": "By class (gpu, mig, slot): total, healthy, booked "
                            "now (of them bound: held by an active reservation), and free now "
                            "(healthy, unbooked, on a ready node).",
                            "additionalProperties": {
                                "type": "object",
                                "required": ["total", "healthy", "booked", "bound", "free"],
                                "properties": {
                                    "total": {"type": "integer"},
                                    "healthy": {"type": "integer"},
                                    "booked": {"type": "integer"},
                                    "bound": {"type": "integer"},
                                    "free": {"type": "integer"},
                                },
                            },
                        },
                        "nextFreeAt": {
                            "type": "integer",
                            "description": "When none is free: when the first booked one frees.",
                        },
                    },
                },
            }
        },
    },
    "QuotaList": {
        "type": "object",
        "required": ["tenantId", "quotas"],
        "properties": {
            "tenantId": {"type": "string"},
            "quotas": {
                "type": "array",
                "description": "By resource (gpu:<model>, gpuSlices:<model>, vcpu, memoryGiB, "
                "hugepages1Gi); a resource not listed grants nothing.",
                "items": {
                    "type": "object",
                    "required": ["resource", "limit", "used"],
                    "properties": {
                        "resource": {"type": "string"},
                        "limit": {"type": "integer"},
                        "used": {
                            "type": "integer",
                            "description": "Charged now by live reservations (may exceed a "
                            "limit lowered since).",
                        },
                    },
                },
            },
        },
    },
    "SearchResult": {
        "type": "object",
        "required": ["poolId", "from", "horizonEnd", "windows", "never", "message"],
        "properties": {
            "poolId": {"type": "string"},
            "from": {"type": "integer", "description": "The earliest start considered (ms)."},
            "horizonEnd": {"type": "integer", "description": "The latest start considered."},
            "windows": {
                "type": "array",
                "description": "In start order; each is what a preview at its start answers.",
                "items": {
                    "type": "object",
                    "required": ["start", "end", "nodeIds"],
                    "properties": {
                        "start": {"type": "integer"},
                        "end": {"type": "integer"},
                        "nodeIds": {"type": "array", "items": {"type": "string"}},
                    },
                },
            },
            "never": {
                "type": "boolean",
                "description": "true: no node of the pool could hold it even at rest.",
            },
            "message": {"type": "string"},
            "resources": {"type": "object"},
            "hostShare": {"type": "object"},
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message", "details"],
                "properties": {
                    "code": {"enum": list(errors.CODES)},
                    "message": {"type": "string"},
                    "details": {"type": "object"},
                },
            }
        },
    },
}


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
    schemas.update(copy.deepcopy(_ANSWERS))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Better Compute",
            "version": _version(),
            "description": (
                "GPU reservations. Every operation is a POST with a JSON body, a bearer token "
                "and the header 'X-Better-Compute: 1'; it answers {\"data\": …} or "
                '{"error": {"code", "message", "details"}}.'
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
        "/metrics": get("Prometheus metrics", "text/plain", {"type": "string"}),
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
