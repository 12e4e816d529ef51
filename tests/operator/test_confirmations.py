"""Delegated confirmation on Kubernetes: an agent's Reservation waits for its person's answer.

The real operator against the API stand-in and PostgreSQL. The agent is a service account
annotated ``bcd.dev/acting-for``; a ``@confirm`` forbid holds its bigger requests; the person
answers by annotating the Reservation (``bcd.dev/confirmation``, with ``bcd.dev/confirmed-by``
as the mutating webhook stamps it: the stand-in calls no webhook here, so the tests stamp it
as ``tests/operator/test_webhooks.py`` shows the webhook does). Attack tests: the agent
answering its own request, and a teammate who is not the person, are refused and nothing is
booked.
"""

from __future__ import annotations

import datetime as dt
import io
from typing import Any

import pytest
from rich.console import Console

from bettercompute.iam import policies
from bettercompute.kubectl import tables
from bettercompute.operator.running import Operator
from tests.operator.conftest import World
from tests.support import epochs, kubeworld
from tests.support.kubeobjects import EVENTS, RESERVATIONS, SERVICE_ACCOUNTS
from tests.support.policies import CountingPolicy

AGENT = "system:serviceaccount:ml:trainer"
CONFIRM_BIG = """
@id("agents-confirm-big") @confirm
forbid (principal, action == Compute::Action::"compute:reservations:create", resource)
when { principal has actingFor && resource.gpuCount > 1 };
"""


@pytest.fixture
def policy() -> CountingPolicy:
    return CountingPolicy(policies.DEFAULT_POLICIES + CONFIRM_BIG)


def _state(state: str):
    return lambda o: bool(o) and (o.get("status") or {}).get("state") == state


def _refused(code: str):
    def check(o: dict[str, Any] | None) -> bool:
        for c in ((o or {}).get("status") or {}).get("conditions") or ():
            if c.get("type") == "Refused" and c.get("reason") == code and c["status"] == "True":
                return True
        return False

    return check


async def _agent_account(world: World) -> None:
    """The agent's service account, acting for alice."""
    if world.kube.stored(SERVICE_ACCOUNTS, "ml", "trainer") is not None:
        return
    await world.kube.create(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": "trainer",
                "namespace": "ml",
                "annotations": {"bcd.dev/acting-for": "alice@acme"},
            },
        }
    )


async def _agent_asks(world: World, name: str, gpus: int) -> dict[str, Any]:
    await _agent_account(world)
    await world.kube.create(kubeworld.reservation(name).gpus(gpus).by(AGENT).obj())
    return await world.kube.wait_for(
        RESERVATIONS, "ml", name, _state("awaiting-confirmation"), timeout=5.0
    )


async def _answer(world: World, name: str, answer: str, *, by: str) -> None:
    annotations = {"bcd.dev/confirmation": answer, "bcd.dev/confirmed-by": by}
    await world.kube.patch(RESERVATIONS, "ml", name, {"metadata": {"annotations": annotations}})


async def test_the_agents_request_waits_for_the_person_and_is_placed_once_approved(
    world: World, operator: Operator
):
    waiting = await _agent_asks(world, "train", 2)
    status = waiting["status"]
    confirmation = status["confirmation"]
    assert confirmation["id"].startswith("cnf_")
    assert confirmation["person"] == "alice@acme"
    assert confirmation["expiresAt"].endswith("Z")
    kinds = {c["type"]: c for c in status["conditions"]}
    assert kinds["ConfirmationRequired"]["status"] == "True"
    assert kinds["ConfirmationRequired"]["reason"] == confirmation["id"]
    assert kinds["Ready"]["status"] == "False"
    events = await world.kube.list(EVENTS, "ml")
    told = [e for e in events if e["reason"] == "ConfirmationRequired"]
    assert told, events
    assert (
        "kubectl annotate reservation train -n ml bcd.dev/confirmation=approve"
        in (told[0]["message"])
    )
    # Nothing is booked while it waits.
    stored = await operator.runtime.service.snapshot(status["id"])
    assert stored is not None
    assert stored["state"] == "awaiting-confirmation"
    assert not stored.get("during")

    await _answer(world, "train", "approve", by="alice@acme")
    placed = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"), timeout=5)
    assert placed["status"]["id"] == status["id"]  # the same draft, not a new reservation
    assert placed["status"]["confirmation"]["answer"] == "approve by alice@acme"
    assert placed["status"]["gpus"] == 2
    assert await shown_to_people(world, waiting, placed) == []


#: Human surfaces that keep an epoch-ms time because the guide fixes it: the
#: ``ConfirmationRequired`` condition's message is "the deadline in epoch milliseconds" (tables
#: show it as RFC 3339, ``moments.readable_message``).
EPOCH_MS_BY_THE_GUIDE = {"ConfirmationRequired"}


async def shown_to_people(world: World, *objs: dict[str, Any]) -> list[str]:
    """Epoch-ms times and ms durations in what people read of ``objs``: the condition messages
    the operator wrote, the Events it posted, and ``kubectl bcd``'s tables of them."""
    found = []
    for obj in objs:
        for c in obj["status"].get("conditions") or ():
            if c["type"] not in EPOCH_MS_BY_THE_GUIDE and epochs.found(c.get("message") or ""):
                found.append(f"condition {c['type']}: {c['message']}")
        now = dt.datetime.now(dt.UTC)
        console = Console(width=100, record=True, file=io.StringIO())
        console.print(tables.reservations([obj], now=now, wide=True))
        console.print(tables.reservation(obj, now=now))
        if hits := epochs.found(console.export_text()):
            found.append(f"kubectl bcd tables: {hits}\n{console.export_text()}")
    for event in await world.kube.list(EVENTS, "ml"):
        if hits := epochs.found(event.get("message") or ""):
            found.append(f"event {event.get('reason')}: {event.get('message')} {hits}")
    return found


async def test_a_denied_request_is_denied_and_books_nothing(world: World, operator: Operator):
    waiting = await _agent_asks(world, "train", 2)
    await _answer(world, "train", "deny", by="alice@acme")
    denied = await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("denied"), timeout=5)
    assert denied["status"]["id"] == waiting["status"]["id"]


@pytest.mark.parametrize("who", [AGENT, "bob@acme"], ids=["the-agent-itself", "a-teammate"])
async def test_only_the_person_can_answer(world: World, operator: Operator, who: str):
    """Attack: the agent (who may update its own Reservation) approves its own request, or a
    teammate who is not the person approves it: refused, still waiting, nothing booked."""
    waiting = await _agent_asks(world, "train", 2)
    await _answer(world, "train", "approve", by=who)
    refused = await world.kube.wait_for(
        RESERVATIONS, "ml", "train", _refused("ACCESS_DENIED"), timeout=5
    )
    assert refused["status"]["state"] == "awaiting-confirmation"
    stored = await operator.runtime.service.snapshot(waiting["status"]["id"])
    assert stored is not None
    assert stored["state"] == "awaiting-confirmation"
    # The person can still answer afterwards.
    await _answer(world, "train", "approve", by="alice@acme")
    await world.kube.wait_for(RESERVATIONS, "ml", "train", _state("placed"), timeout=5)


async def test_a_request_the_policy_does_not_hold_is_placed_at_once(world: World):
    await _agent_account(world)
    await world.kube.create(kubeworld.reservation("small").gpus(1).by(AGENT).obj())
    await world.kube.wait_for(RESERVATIONS, "ml", "small", _state("placed"), timeout=5)
