"""One pool model: the dev configuration and a GPUPool say the same thing about the same mistake,
and a pool row's policy reads back as the typed ``PoolPolicy``. Pure; no database."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pydantic
import pytest

from bettercompute.core import pools
from bettercompute.core.errors import ComputeError, ErrorCode
from bettercompute.dev import config
from bettercompute.operator import definitions

DEV = """\
tenants:
  - id: acme
pools:
  - id: p
    owner: acme
    region: eu-west-1
"""


def _dev_problem(tmp_path: Path, pool: dict[str, Any]) -> tuple[str, str]:
    lines = "".join(f"    {key}: {value}\n" for key, value in pool.items())
    file = tmp_path / "dev.yaml"
    file.write_text(textwrap.dedent(DEV) + lines)
    with pytest.raises(config.ConfigError) as caught:
        config.load(file)
    return caught.value.path, caught.value.reason


def _gpupool_problem(spec: dict[str, Any]) -> tuple[str, str]:
    base: dict[str, Any] = {"region": "eu-west-1", "owner": {"tenant": "acme"}}
    with pytest.raises(ComputeError) as caught:
        definitions.pool_definition("p", {**base, **spec})
    assert caught.value.code == ErrorCode.INVALID_INPUT
    return caught.value.details["field"], caught.value.details["reason"]


@pytest.mark.parametrize(
    ("dev", "gpupool", "where", "reason"),
    [
        (
            {"sharing": "shared"},
            {"sharing": {"mode": "shared"}},
            ("pools[0].sharing", "spec.sharing.mode"),
            "Input should be 'exclusive', 'mig', 'timeslice' or 'mps' (got 'shared')",
        ),
        (
            {"sharing": "mps"},
            {"sharing": {"mode": "mps", "replicas": 4}},
            ("pools[0].sharing", "spec.sharing.mode"),
            f"{pools.MPS_REFUSED} (got 'mps')",
        ),
        (
            {"replicas": 4},
            {"sharing": {"mode": "exclusive", "replicas": 4}},
            ("pools[0].replicas", "spec.sharing.replicas"),
            "replicas are for 'timeslice' and 'mps' pools only (got 4)",
        ),
        (
            {"policy": "{maxPending: soon}"},
            {"policy": {"maxPending": "soon"}},
            ("pools[0].policy.maxPending", "spec.policy.maxPending"),
            "cannot read 'soon'",
        ),
        (
            {"policy": "{kubernetess: true}"},
            {"policy": {"kubernetess": True}},
            ("pools[0].policy.kubernetess", "spec.policy.kubernetess"),
            "unknown key 'kubernetess'; did you mean 'kubernetes'?",
        ),
        (
            {"policy": "{perGpu: {vcpu: 5000}}"},
            {"policy": {"perGpu": {"vcpu": 5000}}},
            ("pools[0].policy.perGpu.vcpu", "spec.policy.perGpu.vcpu"),
            "Input should be less than or equal to 4096 (got 5000)",
        ),
        (
            {"region": "EU"},
            {"region": "EU"},
            ("pools[0].region", "spec.region"),
            "String should match pattern",
        ),
    ],
)
def test_a_mistake_in_a_pool_gets_the_same_words_in_the_dev_file_and_in_a_gpupool(
    tmp_path: Path,
    dev: dict[str, Any],
    gpupool: dict[str, Any],
    where: tuple[str, str],
    reason: str,
):
    dev_path, dev_reason = _dev_problem(tmp_path, dev)
    pool_path, pool_reason = _gpupool_problem(gpupool)
    assert (dev_path, pool_path) == where
    assert reason in dev_reason
    assert dev_reason == pool_reason


def test_a_gpupool_carrying_quotas_is_refused_pointing_at_gpuquota():
    field, reason = _gpupool_problem({"offers": [{"tenant": "g", "quotas": {"gpu:H100": 2}}]})
    assert field == "spec.offers[0].quotas"
    assert reason.startswith("quotas moved to GPUQuota objects")


def test_a_gpupool_becomes_the_pool_and_its_offers():
    definition = definitions.pool_definition(
        "h100",
        {
            "region": "eu-west-1",
            "model": "H100",
            "sharing": {"mode": "timeslice", "replicas": 4},
            "policy": {"kubernetes": True, "maxPending": "1h"},
            "owner": {"tenant": "acme"},
            "offers": [{"tenant": "globex", "onBudgetExceeded": "drain"}],
            "nodeSelector": {"matchLabels": {"bcd.dev/pool": "h100"}},
        },
    )
    assert definition.pool == pools.Pool(
        id="h100",
        name="h100",
        owner="acme",
        region="eu-west-1",
        model="H100",
        sharing="timeslice",
        replicas=4,
        policy=pools.PoolPolicy(kubernetes=True, maxPending="1h"),
    )
    assert definition.offers == (
        pools.Offer(pool="h100", tenant="globex", onBudgetExceeded="drain"),
    )
    assert definition.quotas == ()
    # What the store keeps is the policy as given.
    assert definition.pool.policy.as_json() == {"kubernetes": True, "maxPending": "1h"}


def test_a_stored_policy_reads_back_typed_and_a_key_that_no_longer_passes_costs_only_itself():
    policy = pools.PoolPolicy.stored(
        {"kubernetes": True, "maxPending": "forever", "admission": {"budgetCheck": "meter"}}
    )
    assert policy.kubernetes is True
    assert policy.maxPending is None
    assert policy.admission == pools.Admission(budgetCheck="meter")
    assert pools.PoolPolicy.stored(None) == pools.PoolPolicy()
    assert pools.PoolPolicy.stored({"retired": 1}) == pools.PoolPolicy()
    info = pools.PoolInfo(
        id="p",
        owner_tenant_id="acme",
        region="r",
        gpu_model=None,
        sharing_mode="exclusive",
        replicas=1,
        archived=False,
        policy=policy,
    )
    assert info.max_pending_ms == pools.DEFAULT_MAX_PENDING_MS
    assert info.wants_budget_check


@pytest.mark.parametrize(
    ("written", "takes", "api"),
    [
        (None, False, "devicePlugin"),
        (False, False, "devicePlugin"),
        (True, True, "devicePlugin"),
        ({}, True, "devicePlugin"),
        ({"api": "devicePlugin"}, True, "devicePlugin"),
        ({"api": "dra"}, True, "dra"),
    ],
)
def test_policy_kubernetes_is_true_or_an_object_naming_the_api(written, takes, api):
    policy = pools.PoolPolicy.model_validate({} if written is None else {"kubernetes": written})
    assert policy.takes_kubernetes is takes
    assert policy.kubernetes_api == api
    # The store reads it back from the JSON it kept, to the same answer.
    assert pools.kubernetes_api(policy.as_json()) == api


@pytest.mark.parametrize("written", ["yes", {"api": "cdi"}, {"api": "dra", "extra": 1}, 1])
def test_policy_kubernetes_of_another_shape_is_refused(written):
    with pytest.raises(pydantic.ValidationError):
        pools.PoolPolicy.model_validate({"kubernetes": written})
