"""Authentication: static tokens, and the 30-second cache in front of any authenticator."""

from __future__ import annotations

import pytest

from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.core.ports import Caller
from bettercompute.iam.identities import CachingAuthenticator, StaticTokenAuthenticator

ALICE = Caller(identity_id="alice", tenant_id="t1")
BOT = Caller(identity_id="bot", tenant_id="t1", kind="agent", groups=("ops",))


class CountingAuthenticator:
    """The inner authenticator: knows a few tokens and counts how often it is asked."""

    def __init__(self, callers: dict[str, Caller]) -> None:
        self.callers = callers
        self.calls: list[str] = []

    async def authenticate(self, token: str) -> Caller | None:
        self.calls.append(token)
        return self.callers.get(token)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_static_tokens_name_their_callers() -> None:
    auth = StaticTokenAuthenticator({"tok-alice": ALICE, "tok-bot": BOT})

    assert await auth.authenticate("tok-alice") == ALICE
    assert await auth.authenticate("tok-bot") == BOT


@pytest.mark.parametrize("token", ["", "tok-alic", "tok-alice ", "TOK-ALICE", "\udcff"])
async def test_static_tokens_refuse_anything_else(token: str) -> None:
    auth = StaticTokenAuthenticator({"tok-alice": ALICE})

    assert await auth.authenticate(token) is None


def test_an_empty_static_token_is_refused_at_configuration() -> None:
    with pytest.raises(ComputeError) as raised:
        StaticTokenAuthenticator({"": ALICE})

    assert raised.value.code is ErrorCode.INVALID_INPUT


async def test_a_success_is_cached_within_the_ttl() -> None:
    inner = CountingAuthenticator({"tok": ALICE})
    clock = FakeClock()
    auth = CachingAuthenticator(inner, clock=clock)

    assert await auth.authenticate("tok") == ALICE
    clock.now += 29.9
    assert await auth.authenticate("tok") == ALICE

    assert inner.calls == ["tok"]


async def test_a_cached_success_expires_after_30_seconds() -> None:
    inner = CountingAuthenticator({"tok": ALICE})
    clock = FakeClock()
    auth = CachingAuthenticator(inner, clock=clock)

    await auth.authenticate("tok")
    clock.now += 30.0
    assert await auth.authenticate("tok") == ALICE
    assert inner.calls == ["tok", "tok"]

    # Revoked upstream: once the entry is stale the refusal shows.
    del inner.callers["tok"]
    clock.now += 30.0
    assert await auth.authenticate("tok") is None


async def test_the_ttl_is_configurable() -> None:
    inner = CountingAuthenticator({"tok": ALICE})
    clock = FakeClock()
    auth = CachingAuthenticator(inner, ttl_seconds=5, clock=clock)

    await auth.authenticate("tok")
    clock.now += 5
    await auth.authenticate("tok")

    assert len(inner.calls) == 2


async def test_a_refusal_is_not_cached() -> None:
    inner = CountingAuthenticator({})
    auth = CachingAuthenticator(inner, clock=FakeClock())

    assert await auth.authenticate("new") is None
    # Issued a moment later: must work at once.
    inner.callers["new"] = ALICE
    assert await auth.authenticate("new") == ALICE

    assert inner.calls == ["new", "new"]


async def test_the_cache_is_bounded_and_evicts_the_oldest() -> None:
    inner = CountingAuthenticator({"a": ALICE, "b": BOT, "c": ALICE})
    auth = CachingAuthenticator(inner, max_entries=2, clock=FakeClock())

    for token in ("a", "b", "c"):  # c pushes a out
        await auth.authenticate(token)
    await auth.authenticate("b")
    await auth.authenticate("c")
    assert inner.calls == ["a", "b", "c"]

    await auth.authenticate("a")  # asked again, and now b is the oldest and goes
    await auth.authenticate("c")
    await auth.authenticate("b")
    assert inner.calls == ["a", "b", "c", "a", "b"]


@pytest.mark.parametrize(("ttl", "size"), [(0, 10), (-1, 10), (30, 0)])
def test_nonsense_settings_are_refused(ttl: float, size: int) -> None:
    with pytest.raises(ValueError, match="must"):
        CachingAuthenticator(CountingAuthenticator({}), ttl_seconds=ttl, max_entries=size)
