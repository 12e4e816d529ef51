"""Which service accounts are agents acting for a person, read from the API stand-in.

A service account annotated ``bcd.dev/acting-for`` is an agent for that person, through both
of the operator's doors (the TokenReview callers of its HTTP API here; the Reservation door in
``test_confirmations.py``). Attack tests: a user cannot make itself an agent of someone, a
changed annotation is seen within the cache's time, and an API server that does not answer is
an error, never "no delegation".
"""

from __future__ import annotations

from typing import Any

import pytest

from bettercompute.core import ports
from bettercompute.kube.client import KubeClient, KubeError, read_kubeconfig
from bettercompute.operator.authenticating import TokenReviewAuthenticator
from bettercompute.operator.delegating import Delegations, service_account_of
from tests.support import kubeworld
from tests.support.kubeobjects import SERVICE_ACCOUNTS
from tests.support.kubeserver import KubeApi, write_kubeconfig

TRAINER = "system:serviceaccount:team-a:trainer"


def _account(name: str, *, acting_for: str | None) -> dict[str, Any]:
    annotations = {} if acting_for is None else {"bcd.dev/acting-for": acting_for}
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": "team-a", "annotations": annotations},
    }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("username", "expected"),
    [
        (TRAINER, ("team-a", "trainer")),
        ("alice@acme", None),
        ("system:serviceaccount:team-a", None),
        ("system:serviceaccount::trainer", None),
        ("system:serviceaccount:team-a:x:y", None),
    ],
)
def test_only_a_service_accounts_username_names_one(username, expected):
    assert service_account_of(username) == expected


async def test_an_annotated_service_account_is_an_agent_for_its_person(kube_api: KubeApi):
    await kube_api.create(kubeworld.namespace("team-a", tenant="acme"))
    await kube_api.create(_account("trainer", acting_for="alice@acme"))
    await kube_api.create(_account("plain", acting_for=None))
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    kube_api.tokens["t-trainer"] = {"username": TRAINER, "groups": ["bcd.dev:tenant:acme"]}
    kube_api.tokens["t-plain"] = {
        "username": "system:serviceaccount:team-a:plain",
        "groups": ["bcd.dev:tenant:acme"],
    }
    kube_api.tokens["t-alice"] = {"username": "alice@acme", "groups": ["bcd.dev:tenant:acme"]}
    async with KubeClient(config) as kube:
        doors = TokenReviewAuthenticator(kube)
        agent = await doors.authenticate("t-trainer")
        assert agent == ports.Caller(
            identity_id=TRAINER,
            tenant_id="acme",
            kind="agent",
            groups=("bcd.dev:tenant:acme",),
            on_behalf_of="alice@acme",
        )
        plain = await doors.authenticate("t-plain")
        assert plain is not None
        assert plain.kind == "service"
        assert plain.on_behalf_of is None
        alice = await doors.authenticate("t-alice")
        assert alice is not None
        assert alice.kind == "user"
        assert alice.on_behalf_of is None


async def test_a_user_is_never_an_agent_and_an_account_cannot_act_for_itself(kube_api: KubeApi):
    """Attack: a user names a service account's annotation style in its own name, or an
    account names itself as its person; neither becomes a delegation."""
    await kube_api.create(kubeworld.namespace("team-a", tenant="acme"))
    await kube_api.create(_account("trainer", acting_for=TRAINER))
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    async with KubeClient(config) as kube:
        delegations = Delegations(kube)
        user = ports.Caller(identity_id="mallory@acme", tenant_id="acme")
        assert await delegations.caller(user) == user
        itself = ports.Caller(identity_id=TRAINER, tenant_id="acme", kind="service")
        assert await delegations.caller(itself) == itself


async def test_a_changed_annotation_is_seen_once_the_cache_lapses(kube_api: KubeApi):
    await kube_api.create(kubeworld.namespace("team-a", tenant="acme"))
    await kube_api.create(_account("trainer", acting_for="alice@acme"))
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    clock = Clock()
    async with KubeClient(config) as kube:
        delegations = Delegations(kube, ttl_s=30, clock=clock)
        assert await delegations.acting_for(TRAINER) == "alice@acme"
        await kube_api.patch(
            SERVICE_ACCOUNTS,
            "team-a",
            "trainer",
            {"metadata": {"annotations": {"bcd.dev/acting-for": "bob@acme"}}},
        )
        clock.now = 29
        assert await delegations.acting_for(TRAINER) == "alice@acme"
        clock.now = 31
        assert await delegations.acting_for(TRAINER) == "bob@acme"
        await kube_api.delete(SERVICE_ACCOUNTS, "team-a", "trainer")
        clock.now = 62
        assert await delegations.acting_for(TRAINER) is None


async def test_an_api_server_that_does_not_answer_is_an_error_not_no_delegation(tmp_path):
    kubeconfig = write_kubeconfig(path=tmp_path / "config", url="http://127.0.0.1:9")
    config, _ = read_kubeconfig(kubeconfig)
    async with KubeClient(config, timeout_s=0.5) as kube:
        with pytest.raises(KubeError):
            await Delegations(kube).acting_for(TRAINER)
