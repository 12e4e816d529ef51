"""``actingFor`` in the dev configuration: an agent identity acting for a person of its tenant
becomes a caller with ``on_behalf_of``; every misuse is a ``ConfigError`` naming the line and
the path; the shipped demo's agent is held by its ``@confirm`` policy for alice's yes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bettercompute.dev import applying, config
from bettercompute.dev.config import ConfigError
from tests.dev.test_config import BASE, _create, write

PEOPLE = BASE.replace(
    "identities:\n",
    "identities:\n"
    "  - id: bob@acme\n    tenant: acme\n    token: token-of-bob\n"
    "  - id: ops\n    tenant: acme\n    token: token-of-ops\n    kind: service\n"
    "  - id: gina\n    tenant: root\n    token: token-of-gina\n",
)


def agent(acting_for: str, *, kind: str = "agent", name: str = "bot") -> str:
    return (
        PEOPLE.replace("pools:\n", "").split("  - id: pool_h100")[0].rstrip("\n")
        + f"\n  - id: {name}\n    tenant: acme\n    token: token-of-{name}\n"
        f"    kind: {kind}\n    actingFor: {acting_for}\n"
        + "pools:\n  - id: pool_h100"
        + PEOPLE.split("  - id: pool_h100")[1]
    )


def test_an_agent_acting_for_a_person_is_a_delegated_caller(tmp_path: Path) -> None:
    loaded = config.load(write(tmp_path, agent("alice@acme")))
    bot = applying.callers(loaded)["token-of-bot"]
    assert (bot.identity_id, bot.kind, bot.on_behalf_of) == ("bot", "agent", "alice@acme")
    assert applying.callers(loaded)["token-of-alice"].on_behalf_of is None


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        pytest.param(
            agent("alice@acme", kind="user"), "only an identity of kind 'agent'", id="user"
        ),
        pytest.param(agent("alicia@acme"), "unknown identity 'alicia@acme'", id="unknown"),
        pytest.param(agent("bot"), "cannot act for itself", id="itself"),
        pytest.param(agent("ops"), "ops is a service", id="a-service"),
        pytest.param(agent("gina"), "of tenant root, not acme", id="other-tenant"),
        pytest.param(agent("not a name!"), "String should match pattern", id="bad-id"),
    ],
)
def test_a_bad_acting_for_names_the_line_and_the_field(
    tmp_path: Path, text: str, reason: str
) -> None:
    file = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        config.load(file)
    error = caught.value
    assert error.path.endswith(".actingFor"), error
    assert reason in error.reason
    assert error.line is not None
    line = file.read_text().splitlines()[error.line - 1]
    assert "actingFor" in line


async def test_the_demo_agent_is_held_for_alice_above_4_gpus() -> None:
    loaded = config.load()
    engine = loaded.policy_engine()
    assistant = applying.callers(loaded)["bcdev_assistant_acme"]
    assert assistant.on_behalf_of == "alice@acme"
    big = dataclasses.replace(_create(6, 2), principal=assistant)
    decision = await engine.decide(big)
    assert not decision.allowed
    assert decision.held_for_confirmation
    assert decision.reasons == ("agents-confirm-more-than-4-gpus",)
    assert (await engine.decide(dataclasses.replace(_create(4, 2), principal=assistant))).allowed
    # alice herself is not held
    assert (await engine.decide(_create(6, 2))).allowed
