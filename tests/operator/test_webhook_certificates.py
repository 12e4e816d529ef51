"""The operator makes, shares and rotates its admission webhook certificate itself, against the
Kubernetes API stand-in: the stand-in calls the webhooks over HTTPS and trusts only the
caBundle of the configurations, so an admitted Reservation is proof that the certificate served
chains to what the configurations hold. Time is a clock the test moves."""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import ssl
from collections.abc import AsyncIterator
from typing import Any

import helm_python
import pytest
from cryptography import x509

from bettercompute.kube.client import KubeClient, read_kubeconfig
from bettercompute.operator import webhookcerts
from bettercompute.operator.running import started
from bettercompute.store.database import Database
from tests.chart import rendering
from tests.operator.conftest import apply_world, operator_config, trust_test_authority
from tests.support import kubeworld
from tests.support.kubeobjects import SECRETS, Ref
from tests.support.kubeserver import KubeApi
from tests.support.policies import CountingPolicy

NS = kubeworld.OPERATOR_NAMESPACE
SECRET = "bcd-webhook-tls"
MUTATING = Ref(
    group="admissionregistration.k8s.io",
    version="v1",
    plural="mutatingwebhookconfigurations",
    namespaced=False,
)


class Clock:
    """The operator's clock for certificates; it may start in the past (a certificate made
    then is one that is old now), since the TLS peers check validity against real time."""

    def __init__(self, *, ago: dt.timedelta = dt.timedelta(0)) -> None:
        self.now = dt.datetime.now(dt.UTC) - ago

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture(scope="module")
def chart_webhooks() -> list[dict[str, Any]]:
    chart = helm_python.Chart.load(rendering.CHART)
    try:
        rendered = rendering.render(chart, {})
    finally:
        chart.close()
    return [
        *rendered.of("MutatingWebhookConfiguration"),
        *rendered.of("ValidatingWebhookConfiguration"),
    ]


def _secret_bundle(kube: KubeApi) -> webhookcerts.Bundle | None:
    return webhookcerts.bundle_of(kube.stored(SECRETS, NS, SECRET))


async def _until(check, *, within: float = 10.0) -> None:
    for _ in range(int(within / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {within} s")


async def _served_serial(port: int, ca_bundle: bytes) -> int:
    """The serial of the certificate a new TLS handshake gets, verified against the bundle."""
    context = ssl.create_default_context(cadata=ca_bundle.decode())
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        await writer.wait_closed()
    return x509.load_der_x509_certificate(der).serial_number


VALIDATING = Ref(
    group="admissionregistration.k8s.io",
    version="v1",
    plural="validatingwebhookconfigurations",
    namespaced=False,
)


@pytest.fixture
async def cluster(
    kube_api: KubeApi, db: Database, chart_webhooks: list[dict[str, Any]]
) -> AsyncIterator[tuple[Any, Clock]]:
    """The chart's webhook configurations (with the Helm-made caBundle, which the operator
    must replace) routed over HTTPS to an operator keeping its own certificate."""
    clock = Clock(ago=dt.timedelta(days=250))  # what it makes at start is due for renewal now
    names = sorted({c["metadata"]["name"] for c in chart_webhooks})
    config = operator_config(
        kube_api,
        db,
        webhook_secret=SECRET,
        webhook_extra_names=("127.0.0.1",),
        webhook_configurations=tuple(names),
        webhook_check_s=0.1,
    )
    port = config.webhook_port
    assert port is not None
    for configuration in chart_webhooks:
        for webhook in configuration["webhooks"]:
            service = webhook["clientConfig"]["service"]
            kube_api.emulator.webhook_services[(service["namespace"], service["name"])] = (
                f"https://127.0.0.1:{port}"
            )
        await kube_api.create(copy.deepcopy(configuration))
    await trust_test_authority(kube_api, config)
    async with started(config, db=db, policy=CountingPolicy(), certificate_clock=clock) as op:
        await op.ready.wait()
        await apply_world(kube_api, db)
        yield op, clock


def _ca_bundles(kube: KubeApi, names: list[str]) -> set[str]:
    """Every caBundle of every webhook of the named configurations, of both kinds."""
    found: set[str] = set()
    for ref in (MUTATING, VALIDATING):
        for name in names:
            obj = kube.stored(ref, None, name) or {}
            found |= {(w.get("clientConfig") or {}).get("caBundle") for w in obj["webhooks"]}
    return found


async def _admitted(kube: KubeApi, name: str) -> dict[str, Any]:
    """A Reservation created through the webhooks (over HTTPS): stamped, so they answered."""
    obj = kubeworld.reservation(name).obj()
    obj["metadata"]["annotations"] = {}  # stamped by the mutating webhook, or not at all
    created = await kube.create(obj)
    assert created["metadata"]["annotations"].get("bcd.dev/requested-by"), created
    return created


async def test_the_operator_makes_its_certificate_and_the_configurations_trust_it(
    kube_api: KubeApi, cluster
):
    op, _ = cluster
    bundle = _secret_bundle(kube_api)
    assert bundle is not None
    wanted = base64.b64encode(bundle.ca_bundle).decode()
    names = list(op.runtime.config.webhook_configurations)
    assert names
    assert _ca_bundles(kube_api, names) == {wanted}
    port = op.runtime.config.webhook_port
    assert await _served_serial(port, bundle.ca_bundle) == bundle.serving().serial_number
    await _admitted(kube_api, "first")


async def test_the_certificate_is_renewed_in_place_before_it_expires(kube_api: KubeApi, cluster):
    op, clock = cluster
    port = op.runtime.config.webhook_port
    first = _secret_bundle(kube_api)
    assert first is not None
    clock.now += dt.timedelta(days=250)  # now: a third of its year left, so it is due

    async def renewed() -> bool:
        return (_secret_bundle(kube_api) or first).cert_pem != first.cert_pem

    await _until(renewed)
    second = _secret_bundle(kube_api)
    assert second is not None
    assert second.ca_bundle == first.ca_bundle  # the same authority: caBundle unchanged

    async def presented() -> bool:
        return await _served_serial(port, second.ca_bundle) == second.serving().serial_number

    await _until(presented)
    # No restart: the same process, its tasks running, admitting as before.
    assert not [t for t in op.tasks if t.done()]
    await _admitted(kube_api, "after-renewal")
    # Past the old certificate's end, only the new one is presented, and it is valid then.
    assert second.serving().not_valid_after_utc > first.serving().not_valid_after_utc


async def test_replicas_agree_on_one_certificate_through_the_secret(kube_api: KubeApi):
    await kube_api.create(kubeworld.namespace(NS, tenant=None))
    clock = Clock()
    config, _ = read_kubeconfig(kube_api.kubeconfig)
    async with KubeClient(config) as kube:
        replicas = [
            webhookcerts.WebhookCertificates(
                kube,
                namespace=NS,
                secret_name="shared-webhook",
                names=["svc.ns.svc"],
                configurations=[],
                clock=clock,
            )
            for _ in range(3)
        ]
        bundles = await asyncio.gather(*(r.ensure() for r in replicas))
        assert len({b.cert_pem for b in bundles}) == 1  # one writer won, the others read it
        stored = webhookcerts.bundle_of(kube_api.stored(SECRETS, NS, "shared-webhook"))
        assert stored == bundles[0]
        # All due at once: still one renewal, which every replica then serves.
        clock.now += dt.timedelta(days=300)
        renewed = await asyncio.gather(*(r.ensure() for r in replicas))
        assert len({b.cert_pem for b in renewed}) == 1
        assert renewed[0].cert_pem != bundles[0].cert_pem
        for replica in replicas:
            replica.close()
