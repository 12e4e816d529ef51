"""The dev configuration: the shipped demo loads and means what it says; every mistake is a
``ConfigError`` naming the file, the line, the path in the file and the reason."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from bettercompute.core import ports
from bettercompute.dev import config
from bettercompute.dev.config import ConfigError
from bettercompute.iam import policies

# A small valid world the invalid cases below change one thing of.
BASE = """\
tenants:
  - id: root
    root: true
  - id: acme
identities:
  - id: alice@acme
    tenant: acme
    token: token-of-alice
pools:
  - id: pool_h100
    owner: acme
    region: eu-west-1
    model: H100
  - id: pool_mig
    owner: acme
    region: eu-west-1
    model: A100
    sharing: mig
"""


def write(tmp_path: Path, text: str, name: str = "dev.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- the shipped demo -------------------------------------------------------------------------


def test_the_shipped_demo_loads_with_the_world_the_guide_reserves_in() -> None:
    loaded = config.load()
    c = loaded.config
    assert loaded.source == config.demo_path()
    assert [(t.id, t.root) for t in c.tenants] == [
        ("root", True),
        ("acme", False),
        ("globex", False),
    ]
    assert {i.id: i.tenant for i in c.identities} == {
        "alice@acme": "acme",
        "bob@acme": "acme",
        "gina@globex": "globex",
        "ops@root": "root",
        "assistant@acme": "acme",
    }
    h100 = loaded.pool("pool_h100")
    assert (h100.owner, h100.region, h100.model, h100.sharing) == (
        "acme",
        "eu-west-1",
        "H100",
        "exclusive",
    )
    assert h100.policy.as_json() == {"kubernetes": True, "maxPending": "24h"}
    assert loaded.pool("pool_a100_mig").sharing == "mig"
    assert [(o.pool, o.tenant) for o in c.offers] == [("pool_h100", "globex")]
    assert loaded.policy_texts[0] == policies.DEFAULT_POLICIES
    tokens = [i.token for i in c.identities]
    assert len(set(tokens)) == len(tokens)


def _create(count: int, hours: float, *, region: str = "eu-west-1") -> ports.DecisionRequest:
    alice = ports.Caller(identity_id="alice@acme", tenant_id="acme")
    return ports.DecisionRequest(
        principal=alice,
        action=ports.CREATE,
        resource_type=policies.RESERVATION_RESOURCE,
        resource_id="rsv_x",
        tenant_id="acme",
        owner_identity_id="alice@acme",
        attributes={
            "gpuModel": "H100",
            "gpuCount": count,
            "gpuSlices": 0,
            "gangSize": 1,
            "durationHours": hours,
            "region": region,
            "binding": "hold",
            "spot": False,
            "renewable": False,
        },
        pool=ports.PoolRelation(
            pool_id="pool_h100", owner_tenant_id="acme", region=region, gpu_model="H100"
        ),
    )


@pytest.mark.parametrize(
    ("count", "hours", "region", "allowed"),
    [
        (4, 8, "eu-west-1", True),
        (8, 72, "eu-west-1", True),
        (9, 8, "eu-west-1", False),
        (4, 72.5, "eu-west-1", False),
        (9, 80, "us-east-1", True),  # the example limits eu regions only
    ],
)
async def test_the_demo_example_policy_caps_h100s_at_8_for_72h_in_eu(
    count: int, hours: float, region: str, allowed: bool
) -> None:
    engine = config.load().policy_engine()
    decision = await engine.decide(_create(count, hours, region=region))
    assert decision.allowed is allowed
    if not allowed:
        assert decision.reasons == ("h100-eu-at-most-8-for-72h",)


def test_sim_fills_the_first_pool_when_the_file_gives_it_no_nodes() -> None:
    loaded = config.load()
    nodes = config.sim_nodes(loaded, sim=3)
    h100 = [n for n in nodes if n.pool_id == "pool_h100"]
    mig = [n for n in nodes if n.pool_id == "pool_a100_mig"]
    assert [n.name for n in h100] == ["sim-h100-00", "sim-h100-01", "sim-h100-02"]
    assert all(len(n.gpus) == 8 and {a.kind for a in n.atoms} == {"gpu"} for n in h100)
    assert len(mig) == 1
    assert len(mig[0].atoms) == 28  # the file's 4 A100s x 7 instances
    assert [n.pool_id for n in config.sim_nodes(loaded, sim=0)] == ["pool_a100_mig"]


def test_nodes_the_file_gives_the_first_pool_win_over_sim(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "nodes:\n  - {pool: pool_h100, count: 1, gpus: 4}\n")
    nodes = config.sim_nodes(config.load(path), sim=5)
    assert [(n.name, len(n.gpus)) for n in nodes] == [("sim-h100-00", 4)]


def test_sim_nodes_of_a_mig_pool_get_the_default_layout(tmp_path: Path) -> None:
    path = write(tmp_path, BASE.replace("model: H100", "model: H100\n    sharing: mig"))
    nodes = config.sim_nodes(config.load(path), sim=1)
    assert {a.profile for a in nodes[0].atoms} == {"1g.10gb"}
    assert len(nodes[0].atoms) == 8 * 7


def test_a_policy_file_is_read_relative_to_the_yaml(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "deny.cedar").write_text(
        '@id("nobody")\nforbid (principal, action, resource);\n'
    )
    path = write(tmp_path, BASE + "policies:\n  - file: policies/deny.cedar\n")
    loaded = config.load(path)
    assert len(loaded.policy_texts) == 2
    assert "nobody" in loaded.policy_texts[1]


def test_default_policies_can_be_left_out(tmp_path: Path) -> None:
    text = BASE + "defaultPolicies: false\npolicies:\n  - permit (principal, action, resource);\n"
    loaded = config.load(write(tmp_path, text))
    assert loaded.policy_texts == ("permit (principal, action, resource);",)


# --- mistakes ---------------------------------------------------------------------------------

INVALID = [
    pytest.param(
        BASE + "tenant:\n  - id: x\n",
        "tenant",
        "unknown key 'tenant'; did you mean 'tenants'?",
        id="unknown-top-level-key",
    ),
    pytest.param(
        BASE.replace("    model: H100", "    model: H100\n    sharng: mig"),
        "pools[0].sharng",
        "unknown key 'sharng'; did you mean 'sharing'?",
        id="unknown-key-in-a-pool",
    ),
    pytest.param(
        BASE.replace("sharing: mig", "sharing: shared"),
        "pools[1].sharing",
        "Input should be 'exclusive', 'mig', 'timeslice' or 'mps' (got 'shared')",
        id="bad-sharing-mode",
    ),
    pytest.param(
        BASE.replace("tenant: acme", "tenant: acem"),
        "identities[0].tenant",
        "unknown tenant 'acem'; did you mean 'acme'?",
        id="identity-of-an-unknown-tenant",
    ),
    pytest.param(
        BASE.replace(
            "    owner: acme\n    region: eu-west-1\n    model: A100",
            "    owner: initech\n    region: eu-west-1\n    model: A100",
        ),
        "pools[1].owner",
        "unknown tenant 'initech' (defined: acme, root)",
        id="pool-of-an-unknown-owner",
    ),
    pytest.param(
        BASE + "offers:\n  - {pool: pool_h200, tenant: root}\n",
        "offers[0].pool",
        "unknown pool 'pool_h200'; did you mean 'pool_h100'?",
        id="offer-of-an-unknown-pool",
    ),
    pytest.param(
        BASE + "quotas:\n  - {tenant: acme, resource: 'gpus:H100', limit: 8}\n",
        "quotas[0].resource",
        "String should match pattern",
        id="bad-quota-resource",
    ),
    pytest.param(
        BASE + "quotas:\n  - {tenant: acme, resource: 'gpu:H100', limit: '8'}\n",
        "quotas[0].limit",
        "Input should be a valid integer (got '8')",
        id="strict-numbers",
    ),
    pytest.param(
        BASE.replace("    root: true", "    root: 'yes'"),
        "tenants[0].root",
        "Input should be a valid boolean (got 'yes')",
        id="strict-booleans",
    ),
    pytest.param(
        BASE + "  - id: pool_h100\n    owner: acme\n    region: eu-west-1\n",
        "pools[2].id",
        "duplicate id 'pool_h100'",
        id="duplicate-pool",
    ),
    pytest.param(
        BASE.replace("pools:", "  - {id: bob@acme, tenant: acme, token: token-of-alice}\npools:"),
        "identities[1].token",
        "this token is already another identity's",
        id="shared-token",
    ),
    pytest.param(
        BASE.replace("identities:", "  - {id: initech, root: true}\nidentities:"),
        "tenants[2].root",
        "only one tenant may be the root tenant",
        id="two-roots",
    ),
    pytest.param(
        BASE.replace("model: H100", "model: H100\n    policy: {maxPending: soon}"),
        "pools[0].policy.maxPending",
        "cannot read 'soon'",
        id="bad-max-pending",
    ),
    pytest.param(
        BASE.replace("model: H100", "model: H100\n    policy: {kubernetess: true}"),
        "pools[0].policy.kubernetess",
        "did you mean 'kubernetes'?",
        id="unknown-pool-policy-key",
    ),
    pytest.param(
        BASE + "nodes:\n  - {pool: pool_h100, mig: {1g.10gb: 7}}\n",
        "nodes[0].mig",
        "pool_h100 shares as 'exclusive', not by MIG",
        id="mig-nodes-in-an-exclusive-pool",
    ),
    pytest.param(
        BASE + "nodes:\n  - {pool: pool_mig, mig: {3g.40gb: 3}}\n",
        "nodes[0].mig",
        "take 9 of a GPU's 7 compute slices",
        id="too-many-mig-slices",
    ),
    pytest.param(
        BASE + "nodes:\n  - {pool: pool_gone}\n",
        "nodes[0].pool",
        "unknown pool 'pool_gone'",
        id="nodes-of-an-unknown-pool",
    ),
    pytest.param(
        BASE + "policies:\n  - 'permit (principal, action, resource'\n",
        "policies[0]",
        "policies do not parse",
        id="cedar-that-does-not-parse",
    ),
    pytest.param(
        BASE + "policies:\n  - 'permit (principal, action, resource) when { resource.x };'\n",
        "policies[0]",
        "do not match the schema",
        id="cedar-that-names-an-unknown-attribute",
    ),
    pytest.param(
        BASE + "policies:\n  - file: missing.cedar\n",
        "policies[0].file",
        "No such file or directory",
        id="missing-policy-file",
    ),
    pytest.param(
        BASE + "policies:\n  - {fil: x.cedar}\n",
        "policies[0].fil",
        "unknown key 'fil'; did you mean 'file'?",
        id="unknown-key-in-a-policy-file-entry",
    ),
]


@pytest.mark.parametrize(("text", "path", "reason"), INVALID)
def test_a_mistake_names_the_file_the_path_and_the_reason(
    tmp_path: Path, text: str, path: str, reason: str
) -> None:
    file = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        config.load(file)
    error = caught.value
    assert error.file == str(file)
    assert error.path == path
    assert reason in error.reason
    message = str(error)
    assert message.startswith(f"{file}:{error.line}: {path}: ")
    assert error.line is not None


def test_the_line_is_where_the_bad_value_is(tmp_path: Path) -> None:
    file = write(tmp_path, BASE.replace("sharing: mig", "sharing: shared"))
    with pytest.raises(ConfigError) as caught:
        config.load(file)
    lines = file.read_text().splitlines()
    assert caught.value.line is not None
    assert lines[caught.value.line - 1].strip() == "sharing: shared"


def test_invalid_yaml_names_the_file_and_the_line(tmp_path: Path) -> None:
    file = write(tmp_path, "tenants:\n  - id: acme\n  name: [unclosed\nidentities: []\n")
    with pytest.raises(ConfigError) as caught:
        config.load(file)
    assert caught.value.line == 3
    assert str(caught.value).startswith(f"{file}:3: invalid YAML: ")


@pytest.mark.parametrize(
    ("text", "reason"),
    [("", "the file is empty"), ("- a\n- b\n", "must be a mapping of sections")],
)
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        config.load(write(tmp_path, text))


def test_a_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(tmp_path / "nope.yaml")
    missing = tmp_path / "nope.yaml"
    assert str(caught.value) == f"{missing}: cannot read the file: No such file or directory"


def test_the_full_example_in_the_docs_loads(tmp_path: Path) -> None:
    page = Path(__file__).parents[2] / "docs" / "dev-config.md"
    example = page.read_text().split("## A full example", 1)[1].split("```yaml\n", 1)[1]
    path = write(tmp_path, example.split("```", 1)[0])
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "ops.cedar").write_text(
        '@id("ops-read")\npermit (principal in Compute::Tenant::"root",'
        ' action == Compute::Action::"compute:reservations:read", resource);\n'
    )
    loaded = config.load(path)
    assert [p.id for p in loaded.config.pools] == ["pool_h100", "pool_a100_mig"]
    assert len(loaded.policy_texts) == 3
    nodes = config.sim_nodes(loaded, sim=2)
    assert [n.name for n in nodes] == ["sim-h100-00", "sim-h100-01", "sim-a100-mig-00"]


def test_webhook_deliveries_go_to_internal_addresses_only_when_allowed(tmp_path: Path) -> None:
    plain = config.loads("tenants: [{id: acme}]\n", source=tmp_path / "dev.yaml")
    assert plain.config.webhooks.policy().networks == ()
    text = "webhooks:\n  allow: [127.0.0.1, 10.0.0.0/8, hooks.local]\n"
    allowed = config.loads(text, source=tmp_path / "dev.yaml").config.webhooks.policy()
    assert [str(n) for n in allowed.networks] == ["127.0.0.1/32", "10.0.0.0/8"]
    assert allowed.hosts == {"hooks.local"}
    with pytest.raises(ConfigError) as e:
        config.loads("webhooks:\n  allow: [127.0.0.1, 'x/y']\n", source=tmp_path / "dev.yaml")
    assert e.value.path == "webhooks.allow[1]"
    assert e.value.line == 2
