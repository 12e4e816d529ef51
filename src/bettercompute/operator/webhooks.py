"""What the admission webhooks decide about a Reservation: who asked, and whether it may be.

- The mutating webhook stamps the requesting user (``userInfo`` from the API server, which a
  client cannot forge) as annotations on every Reservation created.
- The validating webhook refuses a create whose stamp is not the requesting user's (a forged
  stamp, or one made before the mutating webhook ran), an update that changes a stamp or an
  immutable ``spec`` field, and a spec the core would refuse, naming the field and the reason.
- A person answers a confirmation by annotating the Reservation ``bcd.dev/confirmation:
  approve`` (or ``deny``). The mutating webhook stamps who did in ``bcd.dev/confirmed-by``;
  the validating webhook refuses an answer whose stamp is not the requesting user's, and both
  annotations on a create (nobody may answer a question before it is asked). Whether that user
  may answer is the service's decision: only the person the confirmation names can.

Why here and not only in the CRD schema: the schema cannot know who asked, and the core's
rules (a mig device needs a profile, nvlink-all only for whole GPUs, a window that ends by
9999-12-31) are the core's own validation, run as is.

Pure: nothing here does I/O; the kopf handlers in ``handlers`` are a line around each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bettercompute.core import requests
from bettercompute.core.errors import ComputeError
from bettercompute.kube import names
from bettercompute.operator import definitions

#: Stands in for the namespace's tenant when validating a spec: the core's rules on the
#: request do not depend on who the tenant is.
_ANY_TENANT = "tenant"
_ANY_KEY = "key"

#: What a person may write in ``bcd.dev/confirmation``.
CONFIRMATION_ANSWERS = ("approve", "deny")


def stamps(userinfo: Mapping[str, Any]) -> dict[str, str]:
    """The annotations that record who asked, from the API server's ``userInfo``."""
    return {
        names.REQUESTED_BY: str(userinfo.get("username") or ""),
        names.REQUESTED_BY_GROUPS: json.dumps(sorted(userinfo.get("groups") or [])),
    }


def confirmation_stamp(
    userinfo: Mapping[str, Any], new: Mapping[str, Any] | None, old: Mapping[str, Any] | None
) -> dict[str, str]:
    """On an update that sets or changes ``bcd.dev/confirmation``: who set it."""
    if new is None or old is None:
        return {}
    if _annotation(new, names.CONFIRMATION) == _annotation(old, names.CONFIRMATION):
        return {}
    if _annotation(new, names.CONFIRMATION) is None:
        return {}
    return {names.CONFIRMED_BY: str(userinfo.get("username") or "")}


def refusal(
    *,
    operation: str | None,
    userinfo: Mapping[str, Any],
    new: Mapping[str, Any] | None,
    old: Mapping[str, Any] | None,
) -> str | None:
    """Why this create or update must be refused, or ``None`` to allow it."""
    if new is None:
        return None
    annotations = (new.get("metadata") or {}).get("annotations") or {}
    if operation == "CREATE":
        if not userinfo.get("username"):
            return "the request carries no user: the API server must authenticate it"
        for key in (names.CONFIRMATION, names.CONFIRMED_BY):
            if key in annotations:
                return (
                    f"metadata.annotations[{key}]: cannot be set on a new Reservation; the "
                    "person answers once the reservation awaits confirmation"
                )
        expected = stamps(userinfo)
        for key, value in expected.items():
            if annotations.get(key) != value:
                return (
                    f"metadata.annotations[{key}]: must be the requesting user's "
                    f"({value!r}); it is set by the mutating webhook and cannot be chosen"
                )
        return spec_problem(new.get("spec") or {})
    if operation == "UPDATE" and old is not None:
        old_annotations = (old.get("metadata") or {}).get("annotations") or {}
        for key in names.STAMPS:
            if annotations.get(key) != old_annotations.get(key):
                return f"metadata.annotations[{key}]: is immutable"
        if (problem := _confirmation_problem(userinfo, annotations, old_annotations)) is not None:
            return problem
        old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
        for field in sorted(set(old_spec) | set(new_spec)):
            if field in names.MUTABLE_SPEC:
                continue
            if old_spec.get(field) != new_spec.get(field):
                return f"spec.{field}: is immutable; make a new Reservation instead"
        return mutable_problem(new_spec)
    return None


def _confirmation_problem(
    userinfo: Mapping[str, Any], new: Mapping[str, Any], old: Mapping[str, Any]
) -> str | None:
    answer = new.get(names.CONFIRMATION)
    if answer == old.get(names.CONFIRMATION):
        if new.get(names.CONFIRMED_BY) != old.get(names.CONFIRMED_BY):
            return (
                f"metadata.annotations[{names.CONFIRMED_BY}]: is set by the webhook when "
                f"{names.CONFIRMATION} changes"
            )
        return None
    if answer is None:
        return None  # taking an answer back changes nothing already decided
    if answer not in CONFIRMATION_ANSWERS:
        return (
            f"metadata.annotations[{names.CONFIRMATION}]: must be one of "
            f"{', '.join(CONFIRMATION_ANSWERS)}, not {answer!r}"
        )
    user = str(userinfo.get("username") or "")
    if new.get(names.CONFIRMED_BY) != user:
        return (
            f"metadata.annotations[{names.CONFIRMED_BY}]: must be the requesting user's "
            f"({user!r}); it is set by the mutating webhook and cannot be chosen"
        )
    return None


def _annotation(obj: Mapping[str, Any], key: str) -> str | None:
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    return None if value is None else str(value)


def spec_problem(spec: Mapping[str, Any]) -> str | None:
    """The core's verdict on a Reservation's request, as ``spec.<field>: reason``."""
    try:
        request = definitions.create_request(spec, tenant_id=_ANY_TENANT, uid=_ANY_KEY)
        requests.parse(requests.CreateInput, request)
    except ComputeError as e:
        return "spec." + e.message if e.details.get("field") else e.message
    return mutable_problem(spec)


def mutable_problem(spec: Mapping[str, Any]) -> str | None:
    """Extend fields come as ``until`` or ``extendBy``, not both, and with an ``extendKey``."""
    has_until, has_by = spec.get("until") is not None, spec.get("extendBy") is not None
    if has_until and has_by:
        return "spec.until: give until or extendBy, not both"
    if (has_until or has_by) and not spec.get("extendKey"):
        return "spec.extendKey: required with until or extendBy (the extend's own key)"
    if spec.get("release") is not None and not isinstance(spec.get("release"), bool):
        return "spec.release: must be true or false"
    if has_until or has_by:
        body: dict[str, Any] = {
            "tenantId": _ANY_TENANT,
            "reservationId": "rsv_x",
            "idempotencyKey": spec.get("extendKey"),
        }
        try:
            if has_until:
                body["until"] = definitions.moment_ms(spec["until"], field="until")
            else:
                body["by"] = spec.get("extendBy")
            requests.parse(requests.ExtendInput, body)
        except ComputeError as e:
            field = e.details.get("field")
            renamed = {"until": "until", "by": "extendBy", "idempotencyKey": "extendKey"}
            return f"spec.{renamed.get(str(field), field)}: {e.details.get('reason', e.message)}"
    return None
