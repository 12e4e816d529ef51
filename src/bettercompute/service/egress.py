"""An HTTP client that connects only where ``core.egress`` allows: for webhook deliveries.

Why it exists: checking a subscription's URL when it is created is not enough. A name resolves
anew at every connection (DNS rebinding: public when checked, ``127.0.0.1`` when used), a
redirect points elsewhere, and an environment proxy would connect for us. So the check sits
where the socket is opened: ``_GuardedBackend`` is httpcore's network backend, it resolves the
host itself, asks the policy about every address, and connects to an address it checked (TLS
still verifies and sends the URL's host name). Every connection goes through it: the first,
each retry, and any other. Redirects are not followed (a 3xx answer is a failed attempt), and
no proxy from the environment is used.

A refused address raises ``Blocked`` (an ``httpx.ConnectError``); its message is generic. The
details (the host, the address, why) go to this process's log at INFO, for the operator.

``url_refusal`` is the early answer for a subscription's URL, made when it is created or
changed: only a host that is an address written out, or ``localhost``, is judged then
(``core.egress.literal_address``); a name is never resolved there.

What it must never do: connect to an address it has not checked, or put a resolved address,
a port or the system's error text in an exception a tenant may be shown.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable

import httpcore
import httpx

from bettercompute.core.egress import EgressPolicy, refusal

log = logging.getLogger(__name__)


class Blocked(httpcore.ConnectError):
    """No address of the host may be connected to."""


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                found = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
        except (OSError, UnicodeError, TimeoutError) as e:
            log.info("webhook: cannot resolve %s: %s", host, e)
            raise httpcore.ConnectError("the receiver could not be reached") from None
        addresses: list[str] = []
        for *_, sockaddr in found:
            address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
            if self.policy.allows(address, host=host):
                if str(address) not in addresses:
                    addresses.append(str(address))
            else:
                log.info(
                    "webhook: refused to connect to %s (%s: %s); allowed beyond global "
                    "addresses: %s",
                    host,
                    address,
                    refusal(address) or "a cloud metadata address",
                    self.policy.describe(),
                )
        if not addresses:
            raise Blocked("the receiver's address is not allowed")
        last: Exception | None = None
        for allowed in addresses:
            try:
                return await self.inner.connect_tcp(
                    allowed,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                log.info("webhook: cannot connect to %s (%s) port %d: %s", host, allowed, port, e)
                last = e
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Blocked("unix sockets are not allowed")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, policy: EgressPolicy) -> None:
        super().__init__(trust_env=False)
        # httpx builds its pool without a way to name the network backend: made again here,
        # with httpx's own defaults, around the guarded one.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=_GuardedBackend(policy),
        )


def url_refusal(url: str, policy: EgressPolicy) -> tuple[str, str] | None:
    """``(host, why)`` when no delivery to ``url`` could ever be made under ``policy``, judged
    without DNS; ``None`` when it may be (a name is judged at each delivery). The host is read
    as this client reads it to connect."""
    try:
        host = httpx.URL(url).raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError):
        return None  # the URL's own check refuses what cannot be parsed
    why = policy.refuses_host(host)
    return None if why is None else (host, why)


def client(policy: EgressPolicy, *, timeout_s: float) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose every connection ``policy`` allowed; no redirects
    followed, no proxy from the environment."""
    return httpx.AsyncClient(
        transport=_GuardedTransport(policy),
        timeout=timeout_s,
        follow_redirects=False,
        trust_env=False,
    )
