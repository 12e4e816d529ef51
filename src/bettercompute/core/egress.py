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

    def describe(self) -> str:
        """The allowlist, for a log line."""
        entries = [str(n) for n in self.networks] + sorted(self.hosts)
        return ", ".join(entries) if entries else "(none)"
