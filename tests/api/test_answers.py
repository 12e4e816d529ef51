"""The answers' types (``core.answers``) are the answers: every key a real answer carries over
HTTP is one the type names, with the value type it names, and the OpenAPI document describes
the same keys. A key added to an answer without its type (or the other way round) fails here."""

from __future__ import annotations

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


@pytest.mark.parametrize("schema", [*openapi.ANSWERS, "Window", "Operation"])
def test_the_openapi_document_is_generated_from_the_answer_types(schema: str):
    documented = openapi.document()["components"]["schemas"][schema]
    answer = getattr(answers, schema)
    expected = TypeAdapter(answer).json_schema(
        mode="serialization", by_alias=True, ref_template="#/components/schemas/{model}"
    )
    expected.pop("$defs", None)
    assert documented == expected
    assert documented["additionalProperties"] is False  # closed: an undocumented key fails


async def test_the_other_operations_answer_what_their_types_name(api: Api):
    body = {k: v for k, v in create_body().items() if k != "idempotencyKey"}
    previewed = await api.ok("capacity/preview", body)
    TypeAdapter(answers.Preview).validate_python(previewed, strict=True)
    nofit = await api.ok("capacity/preview", {**body, "devices": [{"class": "gpu", "count": 99}]})
    TypeAdapter(answers.Preview).validate_python(nofit, strict=True)
    searched = await api.ok("capacity/search", body)
    TypeAdapter(answers.SearchResult).validate_python(searched, strict=True)
    assert searched["windows"]
    TypeAdapter(answers.Whoami).validate_python(await api.ok("whoami", {}), strict=True)
    pools = await api.ok("pools/list", {"tenantId": "acme"})
    TypeAdapter(answers.PoolList).validate_python(pools, strict=True)
    quotas = await api.ok("quotas/get", {"tenantId": "acme"})
    TypeAdapter(answers.QuotaList).validate_python(quotas, strict=True)
    assert quotas["quotas"]
