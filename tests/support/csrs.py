"""The API server's rules for CertificateSigningRequests, for the stand-in.

Why it exists: node certificates are requested through ``certificates.k8s.io/v1``
``CertificateSigningRequest`` objects, and what makes the operator's approval rule sound is
what the real API server does with them, so the stand-in does the same:

- create: ``spec.username``, ``spec.uid``, ``spec.groups`` and ``spec.extra`` are the
  caller's, whatever the body said (a client cannot claim to be someone else);
  ``spec.request`` must be a PEM ``CERTIFICATE REQUEST`` that parses, ``spec.signerName`` a
  ``<domain>/<path>`` name, ``spec.usages`` present, ``spec.expirationSeconds`` at least 600;
  ``status`` is dropped. Each failure is 422 ``Invalid`` naming the field.
- the main resource: ``spec`` never changes after creation, nor does ``status`` through it
  (the server keeps the stored ones, as its update strategy does).
- ``/approval``: only ``status.conditions`` changes; ``Approved`` and ``Denied`` cannot both be
  there and, once there, cannot be removed (422).
- ``/status``: the ``Approved``/``Denied`` conditions stay as they were; ``status.certificate``
  must be PEM ``CERTIFICATE`` blocks, only on an approved request, and never changes once set.

Not done: the API server's own authorization (``approve`` and ``sign`` on ``signers``); the
stand-in authorizes every caller, and the chart's RBAC is checked by ``tests/chart``.

Who calls it: ``tests/support/kube.py``. What it must never do: keep state, or import
``bettercompute`` (it stands in for Kubernetes).
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from collections.abc import Mapping
from typing import Any

import kmock
from cryptography import x509

from tests.support.kubeobjects import Ref, failure

CSRS = Ref(
    group="certificates.k8s.io",
    version="v1",
    plural="certificatesigningrequests",
    namespaced=False,
)
#: The fields of ``spec`` the API server derives from the caller.
REQUESTER_FIELDS = ("username", "uid", "groups", "extra")
APPROVAL_CONDITIONS = ("Approved", "Denied")
_SIGNER = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def invalid(field: str, why: str) -> kmock.KubernetesError:
    return failure(422, "Invalid", f"CertificateSigningRequest is invalid: {field}: {why}")


def prepare_create(obj: dict[str, Any], user: Mapping[str, Any]) -> None:
    """Fill the requester from ``user`` (the caller's userInfo) and check the spec."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise invalid("spec", "Required value")
    for field in REQUESTER_FIELDS:
        spec.pop(field, None)
    spec["username"] = str(user.get("username", ""))
    if user.get("uid"):
        spec["uid"] = str(user["uid"])
    if user.get("groups"):
        spec["groups"] = list(user["groups"])
    if user.get("extra"):
        spec["extra"] = {k: list(v) for k, v in user["extra"].items()}
    obj.pop("status", None)
    _check_request(spec.get("request"))
    signer = spec.get("signerName")
    if not isinstance(signer, str) or not _SIGNER.fullmatch(signer):
        raise invalid("spec.signerName", f"{signer!r} must be a fully qualified <domain>/<path>")
    usages = spec.get("usages")
    if not isinstance(usages, list) or not usages:
        raise invalid("spec.usages", "Required value")
    seconds = spec.get("expirationSeconds")
    if seconds is not None and (not isinstance(seconds, int) or seconds < 600):
        raise invalid("spec.expirationSeconds", f"{seconds!r} must be at least 600")


def _check_request(encoded: Any) -> None:
    if not isinstance(encoded, str) or not encoded:
        raise invalid("spec.request", "Required value")
    try:
        pem = base64.b64decode(encoded, validate=True)
    except binascii.Error as e:
        raise invalid("spec.request", f"not base64: {e}") from e
    if b"-----BEGIN CERTIFICATE REQUEST-----" not in pem:
        raise invalid("spec.request", "PEM block type must be CERTIFICATE REQUEST")
    try:
        x509.load_pem_x509_csr(pem)
    except ValueError as e:
        raise invalid("spec.request", f"cannot parse the certificate request: {e}") from e


def settle_update(
    subresource: str | None, current: dict[str, Any], result: dict[str, Any]
) -> dict[str, Any]:
    """The object a write through ``subresource`` stores, given what the generic update made."""
    settled = copy.deepcopy(result)
    settled["spec"] = copy.deepcopy(current.get("spec"))
    old_status: dict[str, Any] = current.get("status") or {}
    new_status: dict[str, Any] = settled.get("status") or {}
    if subresource is None:
        settled.pop("status", None)
        if "status" in current:
            settled["status"] = copy.deepcopy(current["status"])
        return settled
    if subresource == "approval":
        status = copy.deepcopy(old_status)
        status["conditions"] = copy.deepcopy(new_status.get("conditions") or [])
        _check_approval(old_status, status)
    elif subresource == "status":
        status = copy.deepcopy(new_status)
        was, asked = old_status.get("conditions") or (), status.get("conditions") or ()
        kept = [c for c in was if c.get("type") in APPROVAL_CONDITIONS]
        others = [c for c in asked if c.get("type") not in APPROVAL_CONDITIONS]
        status["conditions"] = kept + others
        _check_certificate(old_status, status)
    else:
        raise failure(404, "NotFound", f"no subresource {subresource!r}")
    if not status.get("conditions"):
        status.pop("conditions", None)
    settled["status"] = status
    if not status:
        settled.pop("status")
    return settled


def _types(status: Mapping[str, Any]) -> set[str]:
    return {str(c.get("type")) for c in status.get("conditions") or () if isinstance(c, dict)}


def _check_approval(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    for condition in new.get("conditions") or ():
        if not isinstance(condition, dict) or not condition.get("type"):
            raise invalid("status.conditions", "each condition needs a type")
        if condition.get("status") not in ("True", "False", "Unknown"):
            raise invalid("status.conditions[].status", "must be True, False or Unknown")
    now, before = _types(new), _types(old)
    if {"Approved", "Denied"} <= now:
        raise invalid("status.conditions", "Approved and Denied conditions are mutually exclusive")
    for kind in APPROVAL_CONDITIONS:
        if kind in before and kind not in now:
            why = f"Forbidden: updates may not remove a {kind} condition"
            raise invalid("status.conditions", why)


def _check_certificate(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    certificate = new.get("certificate")
    if old.get("certificate") and certificate != old["certificate"]:
        why = "Forbidden: updates may not modify existing certificate"
        raise invalid("status.certificate", why)
    if not certificate or certificate == old.get("certificate"):
        return
    if "Approved" not in _types(new) or "Denied" in _types(new):
        raise invalid(
            "status.certificate", "Forbidden: certificate can only be set on an approved request"
        )
    try:
        pem = base64.b64decode(certificate, validate=True)
        certificates = x509.load_pem_x509_certificates(pem)
    except (binascii.Error, TypeError, ValueError) as e:
        raise invalid("status.certificate", f"must be PEM CERTIFICATE blocks: {e}") from e
    if not certificates:
        raise invalid("status.certificate", "must hold at least one certificate")
