"""Which addresses the server may connect to on a tenant's behalf (webhook deliveries).

Why it exists: a subscription's URL is written by a tenant, and the server that POSTs to it sits
inside the cluster, next to the database, the kubelet, the cloud's metadata service and every
other internal port. Without a rule, a tenant could make the server send requests there (SSRF)
and read from the delivery log which ports answered. So by default only globally routable
unicast addresses may be connected to; loopback, link-local (cloud metadata lives there),
private, shared (CGNAT), multicast, unspecified, reserved and documentation addresses are
refused, also when they hide inside an IPv6 address (IPv4-mapped, 6to4, Teredo, NAT64). An
operator allows more with an allowlist of CIDRs and host names (``EgressPolicy.parse``).

The cloud metadata addresses (``METADATA``) are refused even when an allowed CIDR covers them:
no webhook receiver lives there, and their answers are credentials.

The same rule answers early, when a subscription is made or changed (``literal_address``):
a URL whose host is an address written out (in any form a resolver reads as one: dotted,
``2130706433``, ``0x7f.1``, ``[::1]``) or a name that is loopback by definition (``localhost``
and ``*.localhost``, RFC 6761) is checked there, so a tenant learns at once that it will never
be delivered to. Other names are not resolved then: the answer to an internal name would tell
a tenant what the cluster's DNS holds, and a name resolves anew at every delivery anyway.

What it must never do: resolve a name or open a connection (``service.egress`` does, and asks
this module about every address it is about to connect to), or allow by default anything that
is not a global unicast address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Instance metadata services of the clouds: never connected to, whatever the allowlist says.
METADATA: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean …
        "169.254.170.2",  # AWS ECS task metadata
        "fd00:ec2::254",  # AWS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for, when it stands for one."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def refusal(address: IPAddress) -> str | None:
    """Why ``address`` is not a global unicast address (``None`` when it is one)."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_v4(address)
        if inner is not None and (why := refusal(inner)) is not None:
            return why
    if address in METADATA:
        return "a cloud metadata address"
    for why, flagged in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        # Shared address space (100.64.0.0/10), documentation ranges and the like.
        ("not globally routable", not address.is_global),
    ):
        if flagged:
            return why
    return None


def _host_key(host: str) -> str:
    return host.strip().rstrip(".").lower()


#: What a name that is loopback by definition (``localhost``) stands for.
LOOPBACK: tuple[IPAddress, ...] = (
    ipaddress.IPv4Address("127.0.0.1"),
    ipaddress.IPv6Address("::1"),
)


def _number(part: str) -> int | None:
    """One part of an IPv4 address as ``inet_aton`` reads it: decimal, octal (a leading 0)
    or hexadecimal (``0x``); ``None`` when it is none of these."""
    digits, base = part, 10
    if part[:2] in ("0x", "0X"):
        digits, base = part[2:], 16
    elif len(part) > 1 and part[0] == "0":
        digits, base = part[1:], 8
    allowed = {10: "0123456789", 8: "01234567", 16: "0123456789abcdefABCDEF"}[base]
    if not digits or any(c not in allowed for c in digits):
        return None
    return int(digits, base)


def _ipv4_numbers(text: str) -> ipaddress.IPv4Address | None:
    """``text`` as the C library's resolver reads an IPv4 address (``inet_aton``): one to four
    parts, the last filling the bytes left (``127.1``, ``2130706433``, ``0x7f.0.0.01``)."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = [_number(p) for p in parts]
    if any(v is None for v in values):
        return None
    *head, last = [v for v in values if v is not None]
    if any(v > 255 for v in head) or last >= 256 ** (4 - len(head)):
        return None
    value = 0
    for v in head:
        value = value * 256 + v
    return ipaddress.IPv4Address((value << (8 * (4 - len(head)))) | last)


def literal_address(host: str) -> tuple[IPAddress, ...] | None:
    """The addresses a URL's host stands for without asking DNS: an address written out in any
    form a resolver takes as one (IPv6 with or without brackets and zone, IPv4 in the
    ``inet_aton`` forms), or loopback for ``localhost`` and ``*.localhost``. ``None`` for any
    other name (resolved only when a delivery connects)."""
    text = host.strip().removeprefix("[").removesuffix("]").partition("%")[0]
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]
    if not text:
        return None
    if ":" in text:
        try:
            return (ipaddress.IPv6Address(text),)
        except ValueError:
            return None
    name = text.lower()
    if name == "localhost" or name.endswith(".localhost"):
        return LOOPBACK
    v4 = _ipv4_numbers(text)
    return None if v4 is None else (v4,)


@dataclass(frozen=True)
class EgressPolicy:
    """Global unicast addresses, plus ``networks`` and the addresses of the names in ``hosts``
    (an operator's allowlist); never ``METADATA``."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> EgressPolicy:
        """An allowlist from text: each entry a CIDR (``10.0.0.0/8``), an address
        (``127.0.0.1``) or a host name (``hooks.internal.example``). ``ValueError`` names a bad
        entry."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = _host_key(entry)
            labels = name.split(".")
            if not all(
                0 < len(label) <= 63
                and label.replace("-", "").isalnum()
                and label.isascii()
                and not label.startswith("-")
                for label in labels
            ) or any(c in entry for c in "/:"):
                raise ValueError(
                    f"{entry!r} is neither a CIDR, an IP address nor a host name"
                ) from None
            hosts.add(name)
        return cls(networks=tuple(networks), hosts=frozenset(hosts))

    def allows(self, address: IPAddress, *, host: str | None = None) -> bool:
        """May a connection go to ``address`` (resolved from ``host``, when a name)?"""
        if address in METADATA or (
            isinstance(address, ipaddress.IPv6Address)
            and (inner := _embedded_v4(address)) is not None
            and inner in METADATA
        ):
            return False
        if refusal(address) is None:
            return True
        if host is not None and _host_key(host) in self.hosts:
            return True
        return any(address.version == n.version and address in n for n in self.networks)

    def refuses_host(self, host: str) -> str | None:
        """Why no delivery to a URL with this host could ever be made, judged without DNS
        (``literal_address``): the reason of its address, or ``None`` when it is allowed or
        is a name to resolve at delivery."""
        addresses = literal_address(host)
        if addresses is None or any(self.allows(a, host=host) for a in addresses):
            return None
        first = addresses[0]
        return refusal(first) or "a cloud metadata address"

    def describe(self) -> str:
        """The allowlist, for a log line."""
        entries = [str(n) for n in self.networks] + sorted(self.hosts)
        return ", ".join(entries) if entries else "(none)"
