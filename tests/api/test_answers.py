"""The answers' types (``core.answers``) are the answers: every key a real answer carries over
HTTP is one the type names, with the value type it names, and the OpenAPI document describes
the same keys. A key added to an answer without its type (or the other way round) fails here."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from bettercompute.api import openapi
from bettercompute.core import answers
from tests.api.conftest import Api, create_body


def ref(rid: str) -> dict[str, str]:
    return {"tenantId": "acme", "reservationId": rid}


async def test_every_operation_answers_what_its_type_names(api: Api):
    created = await api.ok("reservations/create", create_body(leaseSeconds=3600))
    rid = created["id"]
    got = await api.ok("reservations/get", ref(rid))
    listed = await api.ok("reservations/list", {"tenantId": "acme"})
    extended = await api.ok("reservations/extend", {**ref(rid), "by": "1h", "idempotencyKey": "e"})
    renewed = await api.ok("reservations/renew", ref(rid))
    released = await api.ok("reservations/release", ref(rid))

    reservation = TypeAdapter(answers.Reservation)
    for answer in (created, got, renewed, released):
        reservation.validate_python(answer, strict=True)
    TypeAdapter(answers.ReservationList).validate_python(listed, strict=True)
    TypeAdapter(answers.ExtendResult).validate_python(extended, strict=True)
    # The optional keys are exercised, not only the required ones.
    assert "leaseExpiresAt" in created
    assert released["releaseReason"]
    assert listed["items"]
    assert listed["nextCursor"] is None


def test_a_key_the_type_does_not_name_is_refused():
    # What makes the test above able to fail: the types are closed.
    with pytest.raises(ValidationError, match="priority"):
        TypeAdapter(answers.Window).validate_python({"start": 1, "end": 2, "priority": 3})


@pytest.mark.parametrize(
    ("schema", "answer"),
    [
        ("Reservation", answers.Reservation),
        ("ReservationList", answers.ReservationList),
        ("ExtendResult", answers.ExtendResult),
        ("Window", answers.Window),
    ],
)
def test_the_openapi_document_names_the_keys_the_types_name(schema: str, answer: Any):
    documented = openapi.document()["components"]["schemas"][schema]
    keys = answer.__required_keys__ | answer.__optional_keys__
    assert set(documented["properties"]) == keys
    assert set(documented.get("required", ())) <= answer.__required_keys__
