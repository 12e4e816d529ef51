"""The node key and signed reports: stored 0600 and reloaded, the documented key id and
canonical bytes, a good signature verifies and every kind of tampering does not."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from bettercompute.deviceplugin import signing
from bettercompute.deviceplugin.signing import NodeKey, Report, SignatureError, SigningError

REPORT = Report(
    node_name="gpu-node-1",
    allocation_id="alloc_01k",
    reservation_id="rsv_1",
    phase="Releasing",
    pods=("ml/trainer-1", "ml/trainer-0"),
    since=1_790_001_000_000,
    reported_at="2026-12-02T14:00:00.000Z",
)


def test_a_new_key_is_stored_0600_and_the_same_key_is_loaded_again(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "node.pem"

    created = NodeKey.load_or_create(path)
    loaded = NodeKey.load_or_create(path)

    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert loaded.key_id == created.key_id
    assert [p.name for p in path.parent.iterdir()] == ["node.pem"]  # no temporary file left
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_a_key_file_others_can_read_or_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.pem"
    NodeKey.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(SigningError, match="readable by others"):
        NodeKey.load(path)
    path.write_text("not a key")
    os.chmod(path, 0o600)
    with pytest.raises(SigningError, match="not an unencrypted PEM private key"):
        NodeKey.load(path)


def test_the_key_id_is_the_documented_hash_of_the_raw_public_key() -> None:
    key = NodeKey.generate()
    raw = key.public_key.public_bytes(
        encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw
    )
    assert key.key_id == "ed25519:" + hashlib.sha256(raw).hexdigest()[:32]


def test_canonical_bytes_are_sorted_compact_utf8() -> None:
    document = {**REPORT.document(), "nodeName": "nœud-1"}

    assert (
        signing.canonical_bytes(document)
        == (
            '{"allocationId":"alloc_01k","cdiDevices":[],"cgroupParent":null,"envFile":null,'
            '"intruders":[],"nodeName":"nœud-1",'
            '"phase":"Releasing","pods":["ml/trainer-0","ml/trainer-1"],'
            '"purpose":"attested-report","reportedAt":"2026-12-02T14:00:00.000Z",'
            '"reservationId":"rsv_1","since":1790001000000}'
        ).encode()
    )
    assert signing.rfc3339(1_790_001_000_123) == "2026-09-21T14:30:00.123Z"


def test_a_signed_report_verifies() -> None:
    key = NodeKey.generate()
    block = key.sign(REPORT)

    assert block["keyId"] == key.key_id
    assert block["algorithm"] == "ed25519"
    assert signing.verify(signature=block, public_key=key.public_key) == REPORT.document()
    public = signing.public_key_from_pem(key.public_pem())
    assert signing.verify(signature=block, public_key=public)["phase"] == "Releasing"


def _payload(block: dict[str, str]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(base64.b64decode(block["payload"]))
    return loaded


def _with_payload(block: dict[str, str], document: dict[str, Any], *, canonical: bool) -> Any:
    data = (
        signing.canonical_bytes(document) if canonical else json.dumps(document, indent=1).encode()
    )
    return {**block, "payload": base64.b64encode(data).decode()}


TAMPERING = {
    "other-allocation": (
        lambda b, k: _with_payload(
            b, {**_payload(b), "allocationId": "alloc_other"}, canonical=True
        ),
        "does not verify",
    ),
    "bound-instead": (
        lambda b, k: _with_payload(b, {**_payload(b), "phase": "Bound"}, canonical=True),
        "does not verify",
    ),
    "flipped-signature": (
        lambda b, k: {
            **b,
            "value": base64.b64encode(
                bytes([base64.b64decode(b["value"])[0] ^ 1]) + base64.b64decode(b["value"])[1:]
            ).decode(),
        },
        "does not verify",
    ),
    "other-key": (lambda b, k: NodeKey.generate().sign(REPORT), "not this key"),
    "other-key-claiming-ours": (
        lambda b, k: {**NodeKey.generate().sign(REPORT), "keyId": k.key_id},
        "does not verify",
    ),
    "algorithm": (lambda b, k: {**b, "algorithm": "rsa"}, "not ed25519"),
    "not-base64": (lambda b, k: {**b, "value": "***"}, "not valid base64"),
}


@pytest.mark.parametrize(("tamper", "reason"), TAMPERING.values(), ids=TAMPERING.keys())
def test_a_tampered_report_does_not_verify(tamper: Any, reason: str) -> None:
    key = NodeKey.generate()
    block = tamper(key.sign(REPORT), key)

    with pytest.raises(SignatureError, match=reason):
        signing.verify(signature=block, public_key=key.public_key)


def _signed_bytes(key: NodeKey, payload: bytes) -> dict[str, str]:
    """A genuine signature by ``key`` over any bytes: what a node running other code signs."""
    private = serialization.load_pem_private_key(key.private_pem(), password=None)
    return {
        "keyId": key.key_id,
        "algorithm": "ed25519",
        "payload": base64.b64encode(payload).decode(),
        "value": base64.b64encode(private.sign(payload)).decode(),  # type: ignore[union-attr, call-arg]
    }


def test_a_bound_hold_signs_its_cgroup_slice() -> None:
    key = NodeKey.generate()
    bound = Report(
        node_name="gpu-node-1",
        allocation_id="alloc_01k",
        reservation_id="rsv_1",
        phase="Bound",
        cdi_devices=("bcd.dev/gpu=GPU-0",),
        env_file="/run/bcd/allocations/alloc_01k.env",
        cgroup_parent="bcd-alloc-alloc_01k.slice",
        reported_at="2026-12-02T14:00:00.000Z",
    )
    block = key.sign(bound)
    assert _payload(block)["cgroupParent"] == "bcd-alloc-alloc_01k.slice"
    assert signing.verify(signature=block, public_key=key.public_key) == bound.document()
    # The slice is signed: a relay cannot swap it for another one.
    forged = _with_payload(block, {**_payload(block), "cgroupParent": "x.slice"}, canonical=True)
    with pytest.raises(SignatureError, match="does not verify"):
        signing.verify(signature=forged, public_key=key.public_key)


def test_a_report_in_the_previous_formats_still_verifies_with_no_slice_nor_intruders() -> None:
    """Agents not yet upgraded sign the fields without ``intruders``, or without
    ``cgroupParent`` either (the one before); each reads as none."""
    key = NodeKey.generate()
    for left_out in ({"intruders"}, {"intruders", "cgroupParent"}):
        previous = {k: v for k, v in REPORT.document().items() if k not in left_out}
        block = _signed_bytes(key, signing.canonical_bytes(previous))
        assert signing.verify(signature=block, public_key=key.public_key) == REPORT.document()
    # Any other field set is still refused: without cgroupParent but with intruders is no
    # format any agent signed.
    without_slice = {k: v for k, v in REPORT.document().items() if k != "cgroupParent"}
    for extra in (
        without_slice,
        {**previous, "cgroupPath": "/x"},
        {**REPORT.document(), "more": 1},
    ):
        block = _signed_bytes(key, signing.canonical_bytes(extra))
        with pytest.raises(SignatureError, match="must be an object with"):
            signing.verify(signature=block, public_key=key.public_key)


def test_a_genuinely_signed_but_non_canonical_or_incomplete_payload_is_refused() -> None:
    key = NodeKey.generate()
    private = serialization.load_pem_private_key(key.private_pem(), password=None)
    for payload, reason in [
        (json.dumps(REPORT.document(), indent=1).encode(), "canonical"),
        (signing.canonical_bytes({"purpose": "attested-report"}), "must be an object with"),
        (
            signing.canonical_bytes({**REPORT.document(), "purpose": "login"}),
            "purpose",
        ),
    ]:
        block = {
            "keyId": key.key_id,
            "algorithm": "ed25519",
            "payload": base64.b64encode(payload).decode(),
            "value": base64.b64encode(private.sign(payload)).decode(),  # type: ignore[union-attr, call-arg]
        }
        with pytest.raises(SignatureError, match=reason):
            signing.verify(signature=block, public_key=key.public_key)
