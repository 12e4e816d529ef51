"""Identifiers: the deterministic draft id, time-ordered ids for everything else, and the
extended resource name a reservation's devices are advertised under.

The draft id is what makes a create idempotent per caller: the same tenant, identity and key
reach the same row, another identity's identical key reaches another row. Pure except for the
random bits and timestamp that ``new_id`` is *given* (see ``new_id``'s arguments).
"""

from __future__ import annotations

import base64
import hashlib
import os
import time

# Crockford's base32, lowercase: sortable, no ambiguous letters (ULID's alphabet).
_CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"


def _length_prefixed(*parts: str) -> bytes:
    # Why length prefixes and not a separator: no value of any part can forge a boundary, so
    # ('a:b', 'c') and ('a', 'b:c') can never hash alike.
    out = bytearray()
    for part in parts:
        data = part.encode("utf-8")
        out += len(data).to_bytes(4, "big") + data
    return bytes(out)


def draft_id(tenant_id: str, identity_id: str, idempotency_key: str) -> str:
    """``rsv_`` + lowercase unpadded base32 of SHA-256 over tenant, identity and key."""
    digest = hashlib.sha256(
        _length_prefixed("reservation", tenant_id, identity_id, idempotency_key)
    )
    return "rsv_" + base64.b32encode(digest.digest()).decode("ascii").rstrip("=").lower()


def idempotency_id(scope: str, tenant_id: str, identity_id: str, idempotency_key: str) -> str:
    """The row id of an idempotency key in a scope (``create``, ``extend``)."""
    digest = hashlib.sha256(_length_prefixed(scope, tenant_id, identity_id, idempotency_key))
    return "idem_" + base64.b32encode(digest.digest()).decode("ascii").rstrip("=").lower()


def new_id(prefix: str, *, now_ms: int | None = None, entropy: bytes | None = None) -> str:
    """A ULID-style id: 48 bits of milliseconds then 80 random bits, in Crockford base32.

    ``prefix_01k…``: sorting ids sorts them by creation time, which keeps indexes append-mostly.
    Tests may pass ``now_ms`` and ``entropy`` to get a fixed id.
    """
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    rand = os.urandom(10) if entropy is None else entropy
    value = (ms << 80) | int.from_bytes(rand[:10], "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return f"{prefix}_{''.join(reversed(chars))}"


#: Every resource a ``kubernetes`` binding in ``reservation`` pod-access mode is advertised as
#: starts with this prefix.
RESERVATION_RESOURCE_PREFIX = "bcd.dev/rsv-"
#: How many characters of a reservation id's body the resource name keeps: 24 base32
#: characters are 120 bits, and ``rsv-`` + 24 stays far inside a qualified name's 63.
_RESOURCE_ID_CHARS = 24


def reservation_resource_name(reservation_id: str) -> str:
    """The extended resource a ``reservation``-mode allocation is advertised as:
    ``rsv_abcd…`` → ``bcd.dev/rsv-abcd…`` (a qualified name of at most 28 characters)."""
    body = reservation_id.removeprefix("rsv_").lower()
    body = "".join(c for c in body if c.isascii() and c.isalnum())[:_RESOURCE_ID_CHARS]
    if not body:
        raise ValueError(f"reservation id {reservation_id!r} has no characters to name it by")
    return RESERVATION_RESOURCE_PREFIX + body


#: A ``hold`` allocation with host limits runs in the cgroup v2 slice ``bcd-alloc-<id>.slice``.
CGROUP_SLICE_PREFIX = "bcd-alloc-"
CGROUP_SLICE_SUFFIX = ".slice"


def cgroup_slice(allocation_id: str) -> str:
    """The cgroup slice of a ``hold`` allocation with limits: ``alloc_01k…`` →
    ``bcd-alloc-alloc_01k….slice``.

    Every character but an ASCII letter, a digit or ``_`` becomes ``_``: ``/`` or ``..`` could
    leave the cgroup root, and systemd reads a ``-`` in a slice name as nesting, so
    ``alloc-a`` would land inside another allocation's slice. The node and the control plane
    both name a slice with this function, so the control plane keeps a reported slice only
    when it is exactly this name of that allocation.
    """
    body = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in allocation_id)
    if not body:
        raise ValueError("an allocation id is needed to name its cgroup slice")
    return CGROUP_SLICE_PREFIX + body + CGROUP_SLICE_SUFFIX
