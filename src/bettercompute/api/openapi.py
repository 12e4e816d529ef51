"""The OpenAPI 3.1 document of the HTTP API, generated from the input models.

Why generated: the request schemas are the pydantic models the service validates with
(``core.requests``), so the document cannot drift from what the server accepts. The answers
(the reservation object, the list page, the extend result, the preview) have no input model;
their schemas are written here from the guide, and the error envelope from
``api.errors.CODES``.

Pure: builds a dict; never reads a request, a database or a file.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from pydantic.json_schema import models_json_schema

from bettercompute.api import errors, operations
from bettercompute.core import states

_REF = "#/components/schemas/{model}"

# The error answers every operation may give: status -> (component name, description).
_ERRORS: Mapping[int, tuple[str, str]] = {
    400: (
        "BadRequest",
        "INVALID_INPUT (naming the field: a body field, 'body' for a body that is not a JSON "
        "object, or the 'X-Better-Compute' header) or UNSUPPORTED",
    ),
    401: ("Unauthenticated", "ACCESS_DENIED: the bearer token is missing or not valid"),
    402: ("SpendLimitReached", "SPEND_LIMIT_REACHED: the caller's budget is spent"),
    403: ("Forbidden", "ACCESS_DENIED (tenant pre-check or policy) or CONFIRMATION_REQUIRED"),
    404: ("NotFound", "NOT_FOUND: the reservation or pool, or the route, does not exist"),
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
            "rejected": {
                "type": "object",
                "additionalProperties": {"type": "integer"},
                "description": "Nodes rejected per filter (ready, labels, health, capacity …).",
            },
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
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
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
                    "description": "Echoed in the answer; one is made up when absent.",
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
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
