"""The node's enroller against the Kubernetes API stand-in over HTTP.

The test plays the operator's signer by hand, through the same ``/approval`` and ``/status``
subresources (``tests/operator/test_node_certificates.py`` runs the real operator), so each
case can answer what it needs: a good certificate, a denial, a certificate for another key, a
short lifetime, an API that fails.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import logging
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bettercompute import supervising
from bettercompute.core import attestation
from bettercompute.deviceplugin import enrolling
from bettercompute.deviceplugin.agent import started
from bettercompute.deviceplugin.signing import NodeKey
from bettercompute.kube.client import KubeClient, kube_config
from tests.deviceplugin import agents
from tests.deviceplugin.conftest import Node, allocation_spec
from tests.support import kubeworld
from tests.support.csrs import CSRS
from tests.support.kubeobjects import DEVICEALLOCATIONS, GPUNODES
from tests.support.kubeserver import KubeApi

NODE = "gpu-node-1"
AGENT = "system:serviceaccount:better-compute:better-compute-node-agent"


@pytest.fixture
def authority() -> attestation.CertificateAuthority:
    return attestation.CertificateAuthority.generate(now=dt.datetime.now(dt.UTC))


@pytest.fixture
def key(tmp_path: Path) -> NodeKey:
    return NodeKey.load_or_create(tmp_path / "node" / "node-key.pem")


@pytest.fixture
async def client(kube_api: KubeApi) -> AsyncIterator[KubeClient]:
    kube_api.tokens["agent"] = {
        "username": AGENT,
        "uid": "sa",
        "groups": ["system:serviceaccounts"],
        "extra": {"authentication.kubernetes.io/node-name": [NODE]},
    }
    config, _ = kube_config(api_server=kube_api.url, api_token="agent")
    async with KubeClient(config) as kube:
        yield kube


def enroller(
    client: KubeClient, key: NodeKey, tmp_path: Path, **options: Any
) -> enrolling.Enroller:
    handed: list[bytes] = options.pop("handed", [])
    settings: dict[str, Any] = {
        "wait_s": 1.0,
        "backoff": supervising.Backoff(first_s=0.01, max_s=0.05),
        **options,
    }
    return enrolling.Enroller(
        client=client,
        node_name=NODE,
        key=key,
        certificate_file=tmp_path / "node" / "node-cert.pem",
        on_certificate=handed.append,
        **settings,
    )


@contextlib.asynccontextmanager
async def running(e: enrolling.Enroller) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(e.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def pending(kube_api: KubeApi, name: str | None = None) -> dict[str, Any]:
    """The first CSR (or the one named) that nobody has answered yet, once it exists."""

    def unanswered() -> dict[str, Any] | None:
        for obj in kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True):
            if (name is None or obj["metadata"]["name"] == name) and not obj.get("status"):
                return obj
        return None

    async with asyncio.timeout(5):
        while (found := unanswered()) is None:
            await kube_api.emulator.written(since=kube_api.emulator.revision)
    return found


async def answer(
    kube_api: KubeApi,
    obj: dict[str, Any],
    *,
    authority: attestation.CertificateAuthority | None = None,
    lifetime: dt.timedelta = dt.timedelta(days=7),
    public_key: Any = None,
    deny: str | None = None,
) -> None:
    """Approve and sign ``obj`` as the operator would (or deny it)."""
    kind = "Denied" if deny else "Approved"
    condition = {"type": kind, "status": "True", "reason": deny or "Test", "message": kind}
    path = CSRS.path(name=obj["metadata"]["name"], subresource="approval")
    approved = await kube_api._call(
        "PUT", path, body={**obj, "status": {"conditions": [condition]}}
    )
    if deny or authority is None:
        return
    request = attestation.read_request(base64.b64decode(obj["spec"]["request"]))
    cert = authority.issue(
        public_key=public_key or request.public_key,
        node_name=request.node_name,
        role=request.role,
        now=dt.datetime.now(dt.UTC),
        lifetime=lifetime,
    )
    status = {
        **approved["status"],
        "certificate": base64.b64encode(attestation.certificate_pem(cert)).decode(),
    }
    path = CSRS.path(name=obj["metadata"]["name"], subresource="status")
    await kube_api._call("PUT", path, body={**approved, "status": status})


async def until(condition: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while True:
            if condition():  # files and callbacks: nothing to wait on
                return
            await asyncio.sleep(0.01)


async def test_the_agent_asks_for_its_own_node_and_key_and_keeps_the_certificate(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    handed: list[bytes] = []
    e = enroller(client, key, tmp_path, handed=handed)
    async with running(e):
        obj = await pending(kube_api)
        spec = obj["spec"]
        assert obj["metadata"]["name"] == enrolling.csr_name(
            node_name=NODE, key=key, predecessor=None, attempt=0
        )
        assert obj["metadata"]["name"].startswith(f"bcd-node-{NODE}-")
        assert spec["signerName"] == "bcd.dev/node-report"
        assert spec["usages"] == ["digital signature"]
        assert spec["expirationSeconds"] == 7 * 24 * 3600
        assert spec["username"] == AGENT  # the API server's record of who asked
        request = attestation.read_request(base64.b64decode(spec["request"]))
        assert (request.node_name, request.role) == (NODE, "node")
        assert request.public_key == key.public_key
        await answer(kube_api, obj, authority=authority)
        await until(lambda: bool(handed))
    saved = tmp_path / "node" / "node-cert.pem"
    assert handed == [saved.read_bytes()]
    assert stat.S_IMODE(saved.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "node" / "node-key.pem").stat().st_mode) == 0o600
    cert = attestation.verify_certificate(
        saved.read_bytes(),
        authorities=[authority.certificate],
        node_name=NODE,
        now=dt.datetime.now(dt.UTC),
        grace=attestation.OFFLINE_GRACE,
        revoked=lambda _: False,
    )
    assert cert.public_key() == key.public_key
    assert b"PRIVATE" not in base64.b64decode(spec["request"])


async def test_a_restart_uses_the_saved_certificate_and_asks_for_nothing(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    first: list[bytes] = []
    async with running(enroller(client, key, tmp_path, handed=first)):
        await answer(kube_api, await pending(kube_api), authority=authority)
        await until(lambda: bool(first))
    asked = len(kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True))
    again: list[bytes] = []
    async with running(enroller(client, key, tmp_path, handed=again)):
        await until(lambda: bool(again))
        await asyncio.sleep(0.2)
    assert again == first
    assert len(kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True)) == asked


async def test_a_restart_while_waiting_finds_its_own_request(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    async with running(enroller(client, key, tmp_path)):
        obj = await pending(kube_api)
    handed: list[bytes] = []
    async with running(enroller(client, key, tmp_path, handed=handed)):
        await asyncio.sleep(0.1)
        await answer(kube_api, obj, authority=authority)
        await until(lambda: bool(handed))
    assert len(kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True)) == 1


async def test_a_denied_request_is_logged_and_asked_again_under_the_next_name(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    handed: list[bytes] = []
    caplog.set_level(logging.WARNING, logger="bettercompute.deviceplugin.enrolling")
    async with running(enroller(client, key, tmp_path, handed=handed)):
        first = await pending(kube_api)
        await answer(kube_api, first, deny="NoSuchNode")
        second = await pending(kube_api)
        assert second["metadata"]["name"] == enrolling.csr_name(
            node_name=NODE, key=key, predecessor=None, attempt=1
        )
        await answer(kube_api, second, authority=authority)
        await until(lambda: bool(handed))
    assert "Denied: NoSuchNode" in caplog.text


async def test_a_certificate_for_another_key_is_not_used(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    handed: list[bytes] = []
    caplog.set_level(logging.WARNING, logger="bettercompute.deviceplugin.enrolling")
    async with running(enroller(client, key, tmp_path, handed=handed)):
        other = Ed25519PrivateKey.generate().public_key()
        await answer(kube_api, await pending(kube_api), authority=authority, public_key=other)
        await answer(kube_api, await pending(kube_api), authority=authority)
        await until(lambda: bool(handed))
    assert len(handed) == 1
    cert = x509.load_pem_x509_certificate(handed[0])
    assert cert.public_key() == key.public_key
    assert "not for this node's key" in caplog.text


async def test_api_errors_are_retried_and_never_end_the_enroller(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    # The first three creates fail as an overloaded API server answers; then it is back.
    path = "post /apis/certificates.k8s.io/v1/certificatesigningrequests"
    failing = kube_api.emulator[path][:3] << 503
    handed: list[bytes] = []
    async with running(enroller(client, key, tmp_path, handed=handed)) as task:
        await answer(kube_api, await pending(kube_api), authority=authority)
        await until(lambda: bool(handed))
        assert not task.done()
    assert len(failing) == 3


async def test_the_certificate_is_renewed_at_two_thirds_of_its_life(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    handed: list[bytes] = []
    e = enroller(client, key, tmp_path, handed=handed)
    async with running(e):
        first = await pending(kube_api)
        # A certificate this short is past 2/3 of its life at once (its start is backdated).
        await answer(kube_api, first, authority=authority, lifetime=dt.timedelta(seconds=1.5))
        await until(lambda: bool(handed))
        issued = e.current
        assert issued is not None
        renewal = await pending(kube_api)
        assert renewal["metadata"]["name"] == enrolling.csr_name(
            node_name=NODE, key=key, predecessor=issued, attempt=0
        )
        assert renewal["metadata"]["name"] != first["metadata"]["name"]
        await answer(kube_api, renewal, authority=authority)
        await until(lambda: len(handed) == 2)
    assert handed[0] != handed[1]
    assert (tmp_path / "node" / "node-cert.pem").read_bytes() == handed[1]


async def test_the_answer_is_seen_through_the_watch_not_a_later_read(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    handed: list[bytes] = []
    async with running(enroller(client, key, tmp_path, handed=handed, wait_s=60.0)):
        obj = await pending(kube_api)
        await asyncio.sleep(0.2)  # the enroller is watching by now
        await answer(kube_api, obj, authority=authority)
        await until(lambda: bool(handed), within=2.0)


def test_renewal_is_due_at_two_thirds_of_the_lifetime(
    key: NodeKey, authority: attestation.CertificateAuthority
) -> None:
    now = dt.datetime.now(dt.UTC)
    cert = authority.issue(
        public_key=key.public_key,
        node_name=NODE,
        role="node",
        now=now,
        lifetime=dt.timedelta(days=7),
    )
    issued = enrolling.check_issued(
        attestation.certificate_pem(cert), key=key, node_name=NODE, now=now
    )
    life = issued.not_after - issued.not_before
    assert issued.renew_at == issued.not_before + life * 2 / 3
    with pytest.raises(enrolling.Refused, match="expired"):
        enrolling.check_issued(
            attestation.certificate_pem(cert), key=key, node_name=NODE, now=issued.not_after
        )
    with pytest.raises(enrolling.Refused, match="not node"):
        enrolling.check_issued(
            attestation.certificate_pem(cert), key=key, node_name="other", now=now
        )


def test_the_request_name_is_a_valid_name_for_long_node_names(key: NodeKey) -> None:
    long_node = ".".join(["a" * 60] * 4)  # 243 characters, a valid node name
    name = enrolling.csr_name(node_name=long_node, key=key, predecessor=None, attempt=12)
    assert len(name) <= 253
    assert name.endswith("-first-12")
    assert all(part and part[0] != "-" and part[-1] != "-" for part in name.split("."))


async def test_the_agent_enrols_and_holds_the_certificate(
    kube_api: KubeApi, kubelet_node: Node, authority: attestation.CertificateAuthority
) -> None:
    config = agents.agent_config(
        kube=kube_api, node=kubelet_node, certificate_lifetime=dt.timedelta(days=2)
    )
    async with started(config) as agent:
        obj = await pending(kube_api)
        assert obj["spec"]["expirationSeconds"] == 2 * 24 * 3600
        assert obj["metadata"]["labels"] == {"bcd.dev/node": agents.NODE}
        request = attestation.read_request(base64.b64decode(obj["spec"]["request"]))
        assert request.node_name == agents.NODE
        await answer(kube_api, obj, authority=authority)
        await until(lambda: agent.certificate_pem is not None)
        saved = config.node_key.with_name("node-cert.pem")
        assert agent.certificate_pem == saved.read_bytes()


async def test_the_agent_asks_nothing_when_enrolment_is_off(
    kube_api: KubeApi, kubelet_node: Node
) -> None:
    config = agents.agent_config(kube=kube_api, node=kubelet_node, enrol=False)
    async with started(config) as agent:
        await agents.wait_gpunode(kube_api, lambda o: bool(o.get("status")))
        assert agent.enroller is None
    assert kube_api.emulator._snapshot(CSRS.resource, None, lambda _: True) == []


async def test_reports_carry_the_certificate_and_go_again_once_it_arrives(
    kube_api: KubeApi, kubelet_node: Node, authority: attestation.CertificateAuthority
) -> None:
    config = agents.agent_config(kube=kube_api, node=kubelet_node)
    async with started(config) as agent:
        obj = await pending(kube_api)
        await kube_api.create(agents.device_allocation(allocation_spec("alloc_c1", ["GPU-1"])))
        bound = await kube_api.wait_for(
            DEVICEALLOCATIONS, agents.OPERATOR_NAMESPACE, "alloc-c1", agents.phase_is("Bound")
        )
        assert bound is not None
        assert "certificate" not in bound["status"]["signature"]  # not enrolled yet
        await answer(kube_api, obj, authority=authority)
        await until(lambda: agent.certificate_pem is not None)
        assert agent.certificate_pem is not None
        expected = agent.certificate_pem.decode("ascii")

        def signed_with_it(o: dict[str, Any] | None) -> bool:
            signature = ((o or {}).get("status") or {}).get("signature") or {}
            return bool(signature.get("certificate") == expected)

        again = await kube_api.wait_for(
            DEVICEALLOCATIONS, agents.OPERATOR_NAMESPACE, "alloc-c1", signed_with_it
        )
        assert again is not None
        signature = again["status"]["signature"]
        report = attestation.verify_report(
            signature=signature, public_key=agent.plugin.converger.key.public_key
        )
        assert (report["allocationId"], report["phase"]) == ("alloc_c1", "Bound")


async def test_a_revocation_replaces_the_key_and_enrols_again(
    kube_api: KubeApi,
    client: KubeClient,
    key: NodeKey,
    authority: attestation.CertificateAuthority,
    tmp_path: Path,
) -> None:
    await kube_api.create(kubeworld.gpunode(NODE, pool="h100"))
    key_file = tmp_path / "node" / "node-key.pem"
    handed: list[bytes] = []
    keys: list[NodeKey] = []
    e = enroller(
        client, key, tmp_path, handed=handed, key_file=key_file, on_key=keys.append, check_s=0.05
    )
    async with running(e):
        await answer(kube_api, await pending(kube_api), authority=authority)
        await until(lambda: bool(handed))
        # A revocation from before this certificate was issued is not about it.
        before = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
        await _revoke_at(kube_api, before)
        await asyncio.sleep(0.2)
        assert keys == []
        await _revoke_at(kube_api, dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))
        second = await pending(kube_api)
        await until(lambda: bool(keys))
        (new_key,) = keys
        assert new_key.key_id != key.key_id
        assert NodeKey.load(key_file).key_id == new_key.key_id  # stored in place, mode 0600
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        request = attestation.read_request(base64.b64decode(second["spec"]["request"]))
        assert request.public_key == new_key.public_key
        await answer(kube_api, second, authority=authority)
        await until(lambda: len(handed) == 2)
    assert x509.load_pem_x509_certificate(handed[1]).public_key() == new_key.public_key


async def _revoke_at(kube_api: KubeApi, when: dt.datetime) -> None:
    stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
    annotations = {"bcd.dev/revoked-certificates": stamp, "bcd.dev/revoked-certificates-at": stamp}
    await kube_api.patch(GPUNODES, None, NODE, {"metadata": {"annotations": annotations}})
