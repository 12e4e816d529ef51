"""``core.egress``: which addresses a webhook delivery may connect to, and the allowlist."""

from __future__ import annotations

import ipaddress

import pytest

from bettercompute.core.egress import LOOPBACK, EgressPolicy, literal_address, refusal

REFUSED = [
    "127.0.0.1",
    "127.9.9.9",
    "::1",
    "0.0.0.0",
    "::",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",
    "169.254.1.1",
    "fe80::1",
    "fd00:ec2::254",
    "fc00::1",
    "100.64.0.1",  # shared address space (carrier-grade NAT, some clouds' services)
    "100.100.100.200",
    "224.0.0.1",
    "239.255.255.250",
    "ff02::1",
    "240.0.0.1",
    "255.255.255.255",
    "192.0.2.1",  # documentation
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:169.254.169.254",
    "2002:7f00:1::",  # 6to4 of 127.0.0.1
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "93.184.216.34"]


@pytest.mark.parametrize("text", REFUSED)
def test_internal_addresses_are_refused_by_default(text: str) -> None:
    address = ipaddress.ip_address(text)
    assert refusal(address) is not None
    assert not EgressPolicy().allows(address)


@pytest.mark.parametrize("text", ALLOWED)
def test_global_addresses_are_allowed(text: str) -> None:
    address = ipaddress.ip_address(text)
    assert refusal(address) is None
    assert EgressPolicy().allows(address)


def test_the_allowlist_opens_networks_and_names_but_never_the_metadata_service() -> None:
    policy = EgressPolicy.parse(["10.0.0.0/8", "127.0.0.1", " Hooks.Internal.Example. ", ""])
    assert policy.allows(ipaddress.ip_address("10.20.30.40"))
    assert policy.allows(ipaddress.ip_address("127.0.0.1"))
    assert not policy.allows(ipaddress.ip_address("127.0.0.2"))
    assert not policy.allows(ipaddress.ip_address("192.168.0.1"))
    # A name allowed: whatever it resolves to.
    assert policy.allows(ipaddress.ip_address("192.168.0.1"), host="hooks.internal.example")
    assert not policy.allows(ipaddress.ip_address("192.168.0.1"), host="other.example")
    wide = EgressPolicy.parse(["0.0.0.0/0", "169.254.0.0/16", "::/0"])
    assert not wide.allows(ipaddress.ip_address("169.254.169.254"))
    assert not wide.allows(ipaddress.ip_address("::ffff:169.254.169.254"))
    assert wide.allows(ipaddress.ip_address("169.254.1.1"))


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "http://x", "bad_name", "-x.example", "a b"])
def test_a_bad_allowlist_entry_is_named(entry: str) -> None:
    with pytest.raises(ValueError, match="neither a CIDR"):
        EgressPolicy.parse([entry])


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"),  # the last part fills the bytes left, as inet_aton reads it
        ("2130706433", "127.0.0.1"),
        ("0x7f.0.0.1", "127.0.0.1"),
        ("0177.0.0.01", "127.0.0.1"),  # octal
        ("017700000001", "127.0.0.1"),
        ("10.0x10000", "10.1.0.0"),
        ("0", "0.0.0.0"),
        ("127.0.0.1.", "127.0.0.1"),
        ("[::1]", "::1"),
        ("fe80::1%25eth0", "fe80::1"),
        ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),
    ],
)
def test_an_address_written_out_is_read_as_a_resolver_reads_it(host: str, address: str) -> None:
    assert literal_address(host) == (ipaddress.ip_address(address),)


@pytest.mark.parametrize(
    "host",
    ["hooks.example.com", "256.1.1.1", "1.2.3.4.5", "0x", "08.1.1.1", "1_0.0.0.1", "+1.0.0.1", ""],
)
def test_a_name_is_not_an_address(host: str) -> None:
    assert literal_address(host) is None


def test_localhost_is_loopback_by_definition() -> None:
    for host in ("localhost", "LOCALHOST.", "hooks.localhost"):
        assert literal_address(host) == LOOPBACK
        assert EgressPolicy().refuses_host(host) == "loopback"
    assert EgressPolicy.parse(["localhost"]).refuses_host("localhost") is None
    assert EgressPolicy.parse(["::1"]).refuses_host("localhost") is None


def test_refuses_host_judges_only_what_needs_no_dns() -> None:
    policy = EgressPolicy.parse(["10.0.0.0/8", "169.254.0.0/16"])
    assert policy.refuses_host("10.1.2.3") is None
    assert policy.refuses_host("192.168.0.1") == "private"
    assert policy.refuses_host("169.254.169.254") == "a cloud metadata address"
    assert policy.refuses_host("[::ffff:169.254.169.254]") is not None
    assert policy.refuses_host("internal.example") is None  # resolved at each delivery
    assert policy.refuses_host("8.8.8.8") is None
