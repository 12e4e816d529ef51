"""The MCP server of ``better-compute mcp``: six tools over the reservations API, on stdio.

Why it exists: an agent (Claude Desktop, an IDE, any MCP client) reserves GPUs by calling
tools, and what it can act on is the tools' names, descriptions and parameter schemas. Each
tool here is a typed function whose docstring says when to use it and what comes back; the
official SDK (``mcp``, the ``mcp`` extra) derives the JSON schemas from the signatures and
speaks the protocol. What a tool does is ``door``'s; this module only lays it out.

A refusal becomes a tool error (``is_error``) whose text starts with the server's code, so the
model reads ``NOT_FOUND: pool not found`` and can correct itself; ``CONFIRMATION_REQUIRED`` is
an ordinary answer telling the agent to ask the person and retry with the same arguments.

An argument a tool does not take is refused, naming it, and each tool's schema says so
(``additionalProperties: false``): the SDK's argument models ignore extra keys, so a model that
guessed ``{"mig": "1g.10gb"}`` would otherwise book a whole GPU without a word.

What this module must never do: write to stdout (the stdio transport owns it; the SDK logs to
stderr), open a connection of its own (the ``Api`` is handed in by the CLI command, which owns
the settings and the token), or raise anything but a ``ToolError`` out of a tool for a
refusal it expected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Annotated, Any, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase
from mcp.types import ToolAnnotations
from pydantic import ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from bettercompute.mcp import door
from bettercompute.mcp.door import Api, DeviceClass, Devices, Door, Refused, Scope

NAME = "better-compute"

INSTRUCTIONS = (
    "Better Compute reserves GPUs (whole GPUs, MIG instances or slots) from a pool for a time"
    " window, for the tenant of the token this server runs with. Reservations cost money:"
    " reserve only what the person asked for, and release what is no longer needed.\n"
    "Typical flow: find_capacity to see when a request fits, reserve_gpus to book it,"
    " get_reservation or list_reservations to follow it, extend_reservation to keep it"
    " longer, release_reservation to end it.\n"
    "reserve_gpus and extend_reservation are safe to retry: the same arguments in this session"
    " reach the same request, never a second booking. If one answers outcome"
    " 'confirmation-required', nothing is booked: ask the person to approve the confirmation"
    " it names, then call the same tool again with exactly the same arguments.\n"
    "Times in answers are epoch milliseconds, each with an RFC 3339 sibling named …Time"
    " (start → startTime). A failed call's text starts with the server's error code"
    " (NOT_FOUND, QUOTA_EXCEEDED, CAPACITY_UNAVAILABLE, ACCESS_DENIED, INVALID_INPUT, …)."
)

# --- parameters the tools share ---------------------------------------------------------------

Pool = Annotated[
    str,
    Field(
        description="The pool's id (pool_…) to take the devices from.",
        min_length=1,
        max_length=128,
    ),
]
Count = Annotated[
    int,
    Field(
        description="How many devices: whole GPUs, MIG instances or slots (see device_class).",
        ge=1,
        le=1024,
    ),
]
Class = Annotated[
    DeviceClass,
    Field(
        description="'gpu' for whole GPUs (default), 'mig' for MIG instances of a profile,"
        " 'slot' for shares of a GPU in a pool that sells slots."
    ),
]
Profile = Annotated[
    str | None,
    Field(
        description="The MIG profile, such as '1g.10gb' or '3g.40gb'; only with device_class"
        " 'mig', and required there."
    ),
]
Nvlink = Annotated[
    bool,
    Field(description="All the GPUs on one NVLink domain (whole GPUs only)."),
]
Duration = Annotated[
    str,
    Field(
        description="How long: a duration such as '8h', '90m', '2h30m' or '3d' (at most 366d).",
        min_length=1,
        max_length=64,
    ),
]
ReservationId = Annotated[
    str,
    Field(
        description="The reservation's id (rsv_…), or the first 8 or more characters of one"
        " of yours that no other shares.",
        min_length=1,
        max_length=128,
    ),
]


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """A refusal becomes the tool's error text: ``CODE: message``, details, hint."""
    try:
        yield
    except Refused as e:
        raise ToolError(e.text()) from None


class _KnownArgumentsOnly(ArgModelBase):
    """Mixed into each tool's argument model: an unknown key is refused, naming it."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        # Before field validation, so the one error the model reads names every unknown key
        # and what the tool does take (pydantic's own extra_forbid errors list them one by one).
        if isinstance(data, dict):
            known = [field.alias or name for name, field in cls.model_fields.items()]
            unknown = [str(key) for key in data if key not in known]
            if unknown:
                raise PydanticCustomError(
                    "unknown_argument",
                    "INVALID_INPUT: unknown argument(s) {unknown}; this tool takes {known}",
                    {"unknown": ", ".join(unknown), "known": ", ".join(known)},
                )
        return data


def _strict(tool: Tool) -> Tool:
    """``tool`` with an argument model (and so an advertised schema) that refuses extra keys."""
    loose = tool.fn_metadata.arg_model
    strict = create_model(loose.__name__, __base__=(loose, _KnownArgumentsOnly))
    metadata_ = tool.fn_metadata.model_copy(update={"arg_model": strict})
    return tool.model_copy(
        update={"fn_metadata": metadata_, "parameters": strict.model_json_schema(by_alias=True)}
    )


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def build(
    api: Api,
    *,
    refusal: type[Exception] | tuple[type[Exception], ...],
    tenant: str | None = None,
    nonce: str | None = None,
) -> MCPServer[Any]:
    """The MCP server over ``api``; ``refusal`` is the exception type its ``call`` raises
    (with ``code``, ``message``, ``details``, ``hint`` and ``exit_code``)."""
    actions = Door(api, refusal=refusal, tenant=tenant, nonce=nonce)
    tools: list[Tool] = []

    def tool(annotations: ToolAnnotations) -> Callable[[_Fn], _Fn]:
        def register(fn: _Fn) -> _Fn:
            tools.append(_strict(Tool.from_function(fn, annotations=annotations)))
            return fn

        return register

    @tool(
        annotations=ToolAnnotations(
            title="Reserve GPUs",
            read_only_hint=False,
            destructive_hint=False,
            idempotent_hint=True,
            open_world_hint=False,
        )
    )
    def reserve_gpus(
        pool: Pool,
        count: Count,
        duration: Duration,
        device_class: Class = "gpu",
        profile: Profile = None,
        nvlink: Nvlink = False,
        start: Annotated[
            str | None,
            Field(
                description="When it starts: an RFC 3339 time with a zone"
                " ('2026-09-24T08:00:00Z'), or 'earliest' for the first window that fits"
                " (as find_capacity finds it). Default: now."
            ),
        ] = None,
        wait_seconds: Annotated[
            int,
            Field(
                description="Seconds the server may hold the answer while a queued (pending)"
                " reservation waits to be placed; 0 answers at once. Not reaching 'placed'"
                " is not an error.",
                ge=0,
                le=door.WAIT_CAP_S,
            ),
        ] = 0,
    ) -> dict[str, Any]:
        """Reserve devices of a pool for a time window (this books them and costs money).

        Use it when the person asked for GPUs. Answers outcome 'created' with the
        reservation: its id (rsv_…), state ('placed': devices chosen, 'active': in use,
        'pending': queued until devices free up) and its window (during.startTime,
        during.endTime). Calling it again with the same arguments in this session is a safe
        retry: it reaches the same reservation, never a second one. If it answers outcome
        'confirmation-required', nothing is booked yet: ask the person to approve the
        confirmation it names, then call reserve_gpus again with exactly the same arguments.
        A refusal is an error starting with its code: QUOTA_EXCEEDED, CAPACITY_UNAVAILABLE,
        ACCESS_DENIED, NOT_FOUND (pool), INVALID_INPUT (a field).
        """
        devices = Devices(count=count, device_class=device_class, profile=profile, nvlink=nvlink)
        with _refusals():
            return actions.reserve_gpus(
                pool=pool,
                devices=devices,
                duration=duration,
                start=start,
                wait_seconds=wait_seconds,
            )

    @tool(
        annotations=ToolAnnotations(
            title="Get a reservation", read_only_hint=True, open_world_hint=False
        )
    )
    def get_reservation(reservation_id: ReservationId) -> dict[str, Any]:
        """Show one reservation: its state, devices, window, nodes, conditions and binding.

        Use it to follow a reservation after reserve_gpus (a 'pending' one becomes 'placed'
        when devices free up) or to check one the person names. 'conditions' explain why a
        reservation waits or failed. NOT_FOUND when no reservation of this tenant has that id.
        """
        with _refusals():
            return actions.get_reservation(reservation_id)

    @tool(
        annotations=ToolAnnotations(
            title="List reservations", read_only_hint=True, open_world_hint=False
        )
    )
    def list_reservations(
        state: Annotated[
            str | None,
            Field(
                description="Only reservations in this state: pending, placed, binding,"
                " active, releasing, released, cancelled, expired, failed, denied,"
                " awaiting-confirmation.",
                max_length=32,
            ),
        ] = None,
        scope: Annotated[
            Scope,
            Field(description="'mine' (default): yours; 'all': every one of the tenant's."),
        ] = "mine",
        pool: Annotated[
            str | None, Field(description="Only this pool's (pool_…).", max_length=128)
        ] = None,
        limit: Annotated[int, Field(description="At most this many (1-200).", ge=1, le=200)] = 50,
        cursor: Annotated[
            str | None,
            Field(
                description="Continue after this id: the nextCursor of the previous page.",
                max_length=128,
            ),
        ] = None,
    ) -> dict[str, Any]:
        """List reservations, newest first: yours by default, the tenant's with scope 'all'.

        Answers 'items' (each a reservation as get_reservation shows it) and 'nextCursor'
        (pass it as cursor for the next page; null on the last page).
        """
        with _refusals():
            return actions.list_reservations(
                state=state, scope=scope, pool=pool, limit=limit, cursor=cursor
            )

    @tool(
        annotations=ToolAnnotations(
            title="Extend a reservation",
            read_only_hint=False,
            destructive_hint=False,
            idempotent_hint=True,
            open_world_hint=False,
        )
    )
    def extend_reservation(
        reservation_id: ReservationId,
        until: Annotated[
            str | None,
            Field(
                description="The new end, an RFC 3339 time with a zone"
                " ('2026-09-25T08:00:00Z'). Give this or 'by'."
            ),
        ] = None,
        by: Annotated[
            str | None,
            Field(
                description="Move the end later by this much: '4h', '30m'. Give this or 'until'.",
                max_length=64,
            ),
        ] = None,
    ) -> dict[str, Any]:
        """Move a reservation's end later (it costs more); decided by policy like a reservation.

        Give exactly one of until or by. Answers outcome 'extended' with the reservation and
        its new window, or 'not-extended' when another booking starts first: then
        availableUntil(Time) says until when the devices are free, and nothing changed. The
        same arguments again in this session are a retry of the same change, never a second
        extension: to extend further, give a later 'until'. A 'confirmation-required' answer
        works as for reserve_gpus: ask the person, then call again with the same arguments.
        """
        with _refusals():
            return actions.extend_reservation(reservation_id, until=until, by=by)

    @tool(
        annotations=ToolAnnotations(
            title="Release a reservation",
            read_only_hint=False,
            destructive_hint=True,
            idempotent_hint=True,
            open_world_hint=False,
        )
    )
    def release_reservation(reservation_id: ReservationId) -> dict[str, Any]:
        """End a reservation now: its devices go back to the pool, future bookings are
        dropped, quota is refunded and billing stops (a pending one is cancelled).

        Only when the person asked for it or the work is done: anything running on the
        devices loses them. Answers the reservation, in state 'releasing' or 'released'.
        """
        with _refusals():
            return actions.release_reservation(reservation_id)

    @tool(
        annotations=ToolAnnotations(
            title="Find capacity", read_only_hint=True, open_world_hint=False
        )
    )
    def find_capacity(
        pool: Pool,
        count: Count,
        duration: Duration,
        device_class: Class = "gpu",
        profile: Profile = None,
        nvlink: Nvlink = False,
        not_before: Annotated[
            str | None,
            Field(
                description="The earliest start to consider, an RFC 3339 time with a zone."
                " Default: now."
            ),
        ] = None,
        horizon: Annotated[
            str | None,
            Field(
                description="How far past not_before a window may start: a duration such as"
                " '7d' (default 14d, at most 90d).",
                max_length=64,
            ),
        ] = None,
        limit: Annotated[
            int, Field(description="At most this many windows (1-50).", ge=1, le=50)
        ] = 5,
    ) -> dict[str, Any]:
        """Find the earliest windows in which such a reservation would fit; books nothing.

        Use it before reserve_gpus when the person is flexible about when, or when a
        reservation would wait. Answers 'windows' (each with start/end and
        startTime/endTime, earliest first), 'never' (true when no wait would ever fit it:
        change the request) and 'message'. To book the first window, call reserve_gpus with
        the same devices and duration and start set to its startTime (or 'earliest').
        """
        devices = Devices(count=count, device_class=device_class, profile=profile, nvlink=nvlink)
        with _refusals():
            return actions.find_capacity(
                pool=pool,
                devices=devices,
                duration=duration,
                not_before=not_before,
                horizon=horizon,
                limit=limit,
            )

    return MCPServer(
        NAME,
        title="Better Compute",
        instructions=INSTRUCTIONS,
        version=_version(),
        log_level="WARNING",
        tools=tools,
    )


def serve(
    api: Api,
    *,
    refusal: type[Exception] | tuple[type[Exception], ...],
    tenant: str | None = None,
) -> None:
    """Serve the tools on stdin/stdout until the client closes them."""
    build(api, refusal=refusal, tenant=tenant).run("stdio")


def _version() -> str:
    try:
        return metadata.version("better-compute")
    except metadata.PackageNotFoundError:
        return "0.0.0"
