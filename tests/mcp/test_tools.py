"""The MCP tools against the live API, called through the SDK's in-process client as an agent
calls them: the schemas it reads, and each tool's answer compared with the server's own."""

from __future__ import annotations

from typing import Any

from tests.mcp.conftest import Server, called, error_text, tools

HOUR_MS = 3_600_000
TOOLS = {
    "reserve_gpus",
    "get_reservation",
    "list_reservations",
    "extend_reservation",
    "release_reservation",
    "find_capacity",
}


async def reserve(client: Any, **arguments: Any) -> dict[str, Any]:
    answer = called(
        await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 2, "duration": "8h", **arguments}
        )
    )
    assert answer["outcome"] == "created", answer
    reservation: dict[str, Any] = answer["reservation"]
    return reservation


# --- what the agent reads --------------------------------------------------------------------


async def test_the_tools_are_listed_with_descriptions_and_typed_schemas(url: str):
    async with tools(url) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(listed) == TOOLS
    for name, tool in listed.items():
        assert len(tool.description or "") > 80, name
        assert tool.input_schema["type"] == "object", name
        assert tool.input_schema["additionalProperties"] is False, name
        for field, schema in tool.input_schema["properties"].items():
            assert schema.get("description"), (name, field)

    reserve_schema = listed["reserve_gpus"].input_schema
    assert set(reserve_schema["required"]) == {"pool", "count", "duration"}
    props = reserve_schema["properties"]
    assert props["count"]["type"] == "integer"
    assert props["count"]["minimum"] == 1
    assert props["device_class"]["enum"] == ["gpu", "mig", "slot"]
    assert props["device_class"]["default"] == "gpu"
    assert props["nvlink"]["type"] == "boolean"
    assert "earliest" in props["start"]["description"]
    assert props["wait_seconds"]["maximum"] == 30
    assert "confirmation-required" in (listed["reserve_gpus"].description or "")

    assert listed["list_reservations"].input_schema["properties"]["scope"]["enum"] == [
        "mine",
        "all",
    ]
    assert set(listed["extend_reservation"].input_schema["required"]) == {"reservation_id"}
    assert set(listed["find_capacity"].input_schema["required"]) == {"pool", "count", "duration"}

    # Hints a client may show: what only reads, what ends something, what is safe to retry.
    for name in ("get_reservation", "list_reservations", "find_capacity"):
        annotations = listed[name].annotations
        assert annotations is not None, name
        assert annotations.read_only_hint is True, name
    for name in ("reserve_gpus", "extend_reservation"):
        annotations = listed[name].annotations
        assert annotations is not None, name
        assert annotations.idempotent_hint is True, name
        assert annotations.read_only_hint is False, name
    released = listed["release_reservation"].annotations
    assert released is not None
    assert released.destructive_hint is True


# --- reserve_gpus ----------------------------------------------------------------------------


async def test_reserve_places_and_answers_the_id_state_and_window(url: str, server: Server):
    async with tools(url) as client:
        made = await reserve(client, nvlink=True)
    assert made["id"].startswith("rsv_")
    assert made["state"] == "placed"
    during = made["during"]
    assert during["end"] - during["start"] == 8 * HOUR_MS
    assert during["startTime"].endswith("Z")
    assert during["endTime"].endswith("Z")
    assert made["request"]["devices"] == [{"class": "gpu", "count": 2, "topology": "nvlink-all"}]
    # The API's duration, and beside it the one a person or a model reads.
    assert made["request"]["duration"] == "28800000ms"
    assert made["request"]["durationText"] == "8h"
    assert made["idempotencyKey"].startswith("mcp-")
    stored = await server.call(
        "reservations/get", {"tenantId": "acme", "reservationId": made["id"]}
    )
    assert stored["state"] == "placed"
    assert stored["during"] == {"start": during["start"], "end": during["end"]}


async def test_the_same_arguments_again_reach_the_same_reservation(url: str, server: Server):
    async with tools(url) as client:
        first = await reserve(client, wait_seconds=5)
        # A retry (after a timeout, or a person's approval): the same request, one booking.
        again = await reserve(client)
        other = await reserve(client, count=1)
        earliest = await reserve(client, count=3, start="earliest")
        earliest_again = await reserve(client, count=3, start="earliest")
    assert again["id"] == first["id"]
    assert again["idempotencyKey"] == first["idempotencyKey"]
    assert other["id"] != first["id"]
    assert earliest_again["id"] == earliest["id"]
    assert earliest["state"] == "placed"
    listed = await server.call("reservations/list", {"tenantId": "acme"})
    assert len(listed["items"]) == 3

    # Another session (another `better-compute mcp`) asking the same is a new request.
    async with tools(url) as client:
        fresh = await reserve(client)
    assert fresh["id"] != first["id"]


async def test_reserve_at_a_given_start(url: str):
    async with tools(url) as client:
        later = (
            called(
                await client.call_tool(
                    "find_capacity",
                    {"pool": "pool_a", "count": 2, "duration": "1h", "limit": 1},
                )
            )["windows"][0]["start"]
            + 2 * HOUR_MS
        )
        from bettercompute.core import moments

        made = await reserve(client, duration="1h", start=moments.rfc3339(later, exact=True))
        bad = await client.call_tool(
            "reserve_gpus",
            {"pool": "pool_a", "count": 1, "duration": "1h", "start": "tomorrow morning"},
        )
    assert made["during"]["start"] == later
    assert bad.is_error
    assert "INVALID_INPUT: start: must be an RFC 3339 time" in error_text(bad)


async def test_refusals_are_tool_errors_naming_the_code(url: str):
    async with tools(url) as client:
        unknown_pool = await client.call_tool(
            "reserve_gpus", {"pool": "pool_nope", "count": 1, "duration": "1h"}
        )
        no_profile = await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 1, "duration": "1h", "device_class": "mig"}
        )
        bad_duration = await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 1, "duration": "forever"}
        )
        too_many = await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 0, "duration": "1h"}
        )
        unknown = await client.call_tool("get_reservation", {"reservation_id": "rsv_nope"})
    assert unknown_pool.is_error
    assert "NOT_FOUND: pool not found" in error_text(unknown_pool)
    assert no_profile.is_error
    assert "INVALID_INPUT: profile:" in error_text(no_profile)
    assert bad_duration.is_error
    assert "INVALID_INPUT: duration" in error_text(bad_duration)
    assert too_many.is_error  # the schema's minimum, checked before anything is sent
    assert "count" in error_text(too_many)
    assert unknown.is_error
    assert "NOT_FOUND" in error_text(unknown)


async def test_an_unknown_argument_is_refused_by_name_and_nothing_is_booked(
    url: str, server: Server
):
    # An agent guessing the HTTP API's vocabulary: read as a whole GPU, this would book one.
    async with tools(url) as client:
        guessed = await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 1, "duration": "1h", "mig": "1g.10gb"}
        )
        two = await client.call_tool(
            "find_capacity",
            {"pool": "pool_a", "count": 1, "duration": "1h", "gpus": 2, "class": "mig"},
        )
        on_a_reader = await client.call_tool("list_reservations", {"tenant": "other"})
        known = await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 1, "duration": "1h"}
        )
    assert guessed.is_error
    text = error_text(guessed)
    assert "INVALID_INPUT: unknown argument(s) mig;" in text
    assert "this tool takes pool, count, duration, device_class, profile" in text
    assert two.is_error
    assert "unknown argument(s) gpus, class;" in error_text(two)
    assert on_a_reader.is_error
    assert "unknown argument(s) tenant;" in error_text(on_a_reader)
    # Only the call with known arguments booked anything.
    assert not known.is_error
    listed = await server.call("reservations/list", {"tenantId": "acme"})
    assert [r["id"] for r in listed["items"]] == [called(known)["reservation"]["id"]]


async def test_without_a_token_the_refusal_says_so(url: str):
    async with tools(url, token=None, tenant="acme") as client:
        refused = await client.call_tool("list_reservations", {})
    assert refused.is_error
    text = error_text(refused)
    assert "ACCESS_DENIED" in text
    assert "Hint: no token was sent" in text


async def test_an_unreachable_server_is_an_error_that_says_to_retry(tmp_path: Any):
    async with tools("http://127.0.0.1:9", tenant="acme") as client:
        lost = await client.call_tool(
            "reserve_gpus", {"pool": "pool_a", "count": 1, "duration": "1h"}
        )
    assert lost.is_error
    text = error_text(lost)
    assert "UNREACHABLE: cannot reach the Better Compute server at http://127.0.0.1:9" in text
    assert "call reserve_gpus again with the same arguments" in text


# --- get, list, extend, release, find ---------------------------------------------------------


async def test_get_by_id_and_by_prefix(url: str):
    async with tools(url) as client:
        made = await reserve(client)
        by_id = called(await client.call_tool("get_reservation", {"reservation_id": made["id"]}))
        by_prefix = called(
            await client.call_tool("get_reservation", {"reservation_id": made["id"][:12]})
        )
    assert by_id["id"] == by_prefix["id"] == made["id"]
    assert by_id["state"] == "placed"
    assert by_id["during"]["startTime"] == made["during"]["startTime"]


async def test_list_filters_by_state_and_scope(url: str):
    async with tools(url) as client:
        kept = await reserve(client)
        ended = await reserve(client, count=1)
        called(await client.call_tool("release_reservation", {"reservation_id": ended["id"]}))
        everything = called(await client.call_tool("list_reservations", {}))
        placed = called(await client.call_tool("list_reservations", {"state": "placed"}))
        released = called(
            await client.call_tool("list_reservations", {"state": "released", "scope": "all"})
        )
        page = called(await client.call_tool("list_reservations", {"limit": 1}))
    assert {r["id"] for r in everything["items"]} == {kept["id"], ended["id"]}
    assert [r["id"] for r in placed["items"]] == [kept["id"]]
    assert [r["id"] for r in released["items"]] == [ended["id"]]
    assert len(page["items"]) == 1
    assert page["nextCursor"]
    assert all("createdAtTime" in r for r in everything["items"])


async def test_bobs_reservations_are_listed_only_with_scope_all(url: str):
    from tests.cli.conftest import BOB

    async with tools(url, token=BOB) as client:
        bobs = await reserve(client, count=1)
    async with tools(url) as client:
        mine = called(await client.call_tool("list_reservations", {}))
        everyone = called(await client.call_tool("list_reservations", {"scope": "all"}))
    assert bobs["id"] not in {r["id"] for r in mine["items"]}
    assert bobs["id"] in {r["id"] for r in everyone["items"]}


async def test_extend_by_and_until_and_a_retry_extends_once(url: str):
    from bettercompute.core import moments

    async with tools(url) as client:
        made = await reserve(client)
        end = made["during"]["end"]
        by = called(
            await client.call_tool("extend_reservation", {"reservation_id": made["id"], "by": "4h"})
        )
        again = called(
            await client.call_tool("extend_reservation", {"reservation_id": made["id"], "by": "4h"})
        )
        until_ms = end + 10 * HOUR_MS
        until = called(
            await client.call_tool(
                "extend_reservation",
                {"reservation_id": made["id"], "until": moments.rfc3339(until_ms, exact=True)},
            )
        )
        both = await client.call_tool(
            "extend_reservation", {"reservation_id": made["id"], "by": "1h", "until": "x"}
        )
        neither = await client.call_tool("extend_reservation", {"reservation_id": made["id"]})
    assert by["outcome"] == "extended"
    assert by["extended"] is True
    assert by["reservation"]["during"]["end"] == end + 4 * HOUR_MS
    # The same call again is a retry of that change, not a second one.
    assert again["reservation"]["during"]["end"] == end + 4 * HOUR_MS
    assert until["outcome"] == "extended"
    assert until["reservation"]["during"]["end"] == until_ms
    assert until["reservation"]["during"]["endTime"] == moments.rfc3339(until_ms, exact=True)
    for refused in (both, neither):
        assert refused.is_error
        assert "INVALID_INPUT: until: give exactly one of 'until'" in error_text(refused)


async def test_release_ends_it(url: str, server: Server):
    async with tools(url) as client:
        made = await reserve(client)
        released = called(
            await client.call_tool("release_reservation", {"reservation_id": made["id"]})
        )
        twice = await client.call_tool("release_reservation", {"reservation_id": made["id"]})
    assert released["id"] == made["id"]
    assert released["state"] in ("releasing", "released")
    stored = await server.call(
        "reservations/get", {"tenantId": "acme", "reservationId": made["id"]}
    )
    assert stored["state"] == released["state"]
    assert twice.is_error or called(twice)["state"] == released["state"]


async def test_find_capacity_answers_the_earliest_windows(url: str):
    async with tools(url) as client:
        # 5 of each node's 8 GPUs busy for 2 hours: 4 GPUs fit nowhere until then.
        # (Two spellings of the same request: the same arguments would be one retried call.)
        fills = [await reserve(client, count=5, duration=d) for d in ("2h", "120m")]
        assert fills[0]["id"] != fills[1]["id"]
        found = called(
            await client.call_tool(
                "find_capacity", {"pool": "pool_a", "count": 4, "duration": "1h", "limit": 3}
            )
        )
        none = called(
            await client.call_tool(
                "find_capacity",
                {"pool": "pool_a", "count": 4, "duration": "1h", "horizon": "30m"},
            )
        )
        earliest = await reserve(client, count=4, duration="1h", start="earliest")
    windows = found["windows"]
    assert 1 <= len(windows) <= 3
    first = windows[0]
    assert first["start"] > found["from"] + HOUR_MS  # not before the fills end
    assert first["end"] - first["start"] == HOUR_MS
    assert first["startTime"].endswith("Z")
    assert [w["start"] for w in windows] == sorted(w["start"] for w in windows)
    assert found["never"] is False
    assert none["windows"] == []
    assert earliest["during"]["start"] == first["start"]
