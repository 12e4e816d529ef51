"""The operator's own Kubernetes calls (TokenReviews, Events, status patches) go out as the
identity kopf logged in with: a ``kopf.ConnectionInfo`` becomes the kube client's configuration,
whatever form kopf was given the certificates in.

Checked over real mutual TLS: a small HTTPS server that trusts only a test CA and requires a
client certificate signed by it. In a pod kopf logs in with the service account's token, which
the kubelet rotates: checked with a server that accepts one token at a time.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import ipaddress
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bettercompute.kube import resources
from bettercompute.kube.client import KubeClient, KubeError, from_kopf
from bettercompute.operator.config import OperatorConfig
from bettercompute.operator.running import connection_info, service_account_token


@dataclass
class Pem:
    cert: bytes
    key: bytes


def _issue(name: str, *, issuer: tuple[x509.Certificate, Any] | None = None) -> tuple[Any, Pem]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    pem = Pem(
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return (cert, key), pem


@dataclass
class Cluster:
    url: str
    ca: Pem
    operator: Pem
    #: The common name of each client certificate the server saw.
    callers: list[str]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    ca, ca_pem = _issue("test-ca")
    _, server_pem = _issue("127.0.0.1", issuer=ca)
    _, operator_pem = _issue("better-compute-operator", issuer=ca)
    callers: list[str] = []

    async def namespace(request: aiohttp.web.Request) -> aiohttp.web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(pair[0] for pair in (peer or {}).get("subject", ()))
        callers.append(str(subject.get("commonName", "")))
        name = request.match_info["name"]
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        return aiohttp.web.json_response(body)

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/{name}", namespace)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=ca_pem.cert.decode())
    tls.verify_mode = ssl.CERT_REQUIRED
    async with _serving(app, tls, server_pem, tmp_path) as port:
        yield Cluster(
            url=f"https://127.0.0.1:{port}", ca=ca_pem, operator=operator_pem, callers=callers
        )


@contextlib.asynccontextmanager
async def _serving(
    app: aiohttp.web.Application, tls: ssl.SSLContext, server_pem: Pem, tmp_path: Path
) -> AsyncIterator[int]:
    """``app`` over HTTPS on a free loopback port with ``server_pem``; yields the port."""
    served = tmp_path / "server"
    served.mkdir()
    (served / "tls.crt").write_bytes(server_pem.cert)
    (served / "tls.key").write_bytes(server_pem.key)
    tls.load_cert_chain(served / "tls.crt", served / "tls.key")
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize("form", ["kubeconfig data", "PEM", "files"])
async def test_the_operator_calls_the_api_as_kopf_logged_in(
    cluster: Cluster, tmp_path: Path, form: str
):
    if form == "kubeconfig data":
        # What kopf.login_with_kubeconfig passes on: the kubeconfig's *-data fields, base64.
        info = kopf.ConnectionInfo(
            server=cluster.url,
            ca_data=_b64(cluster.ca.cert),
            certificate_data=_b64(cluster.operator.cert),
            private_key_data=_b64(cluster.operator.key),
        )
    elif form == "PEM":
        info = kopf.ConnectionInfo(
            server=cluster.url,
            ca_data=cluster.ca.cert,
            certificate_data=cluster.operator.cert,
            private_key_data=cluster.operator.key,
        )
    else:
        (tmp_path / "ca.crt").write_bytes(cluster.ca.cert)
        (tmp_path / "tls.crt").write_bytes(cluster.operator.cert)
        (tmp_path / "tls.key").write_bytes(cluster.operator.key)
        info = kopf.ConnectionInfo(
            server=cluster.url,
            ca_path=str(tmp_path / "ca.crt"),
            certificate_path=str(tmp_path / "tls.crt"),
            private_key_path=str(tmp_path / "tls.key"),
        )
    async with KubeClient(from_kopf(info)) as kube:
        found = await kube.get(resources.NAMESPACES, "team-a")
    assert found is not None
    assert found["metadata"]["name"] == "team-a"
    assert cluster.callers == ["better-compute-operator"]


@dataclass
class TokenCluster:
    url: str
    port: int
    ca: Pem
    #: The one bearer token the server accepts now.
    accepted: list[str]
    #: Every Authorization header the server saw, in order.
    seen: list[str]


@pytest.fixture
async def token_cluster(tmp_path: Path) -> AsyncIterator[TokenCluster]:
    ca, ca_pem = _issue("test-ca")
    _, server_pem = _issue("127.0.0.1", issuer=ca)
    accepted = ["first"]
    seen: list[str] = []

    async def namespace(request: aiohttp.web.Request) -> aiohttp.web.Response:
        header = request.headers.get("Authorization", "")
        seen.append(header)
        if header != f"Bearer {accepted[0]}":
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 401}
            return aiohttp.web.json_response({**status, "reason": "Unauthorized"}, status=401)
        name = request.match_info["name"]
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        return aiohttp.web.json_response(body)

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/{name}", namespace)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    async with _serving(app, tls, server_pem, tmp_path) as port:
        yield TokenCluster(
            url=f"https://127.0.0.1:{port}", port=port, ca=ca_pem, accepted=accepted, seen=seen
        )


async def test_in_a_pod_the_operator_follows_its_rotated_service_account_token(
    token_cluster: TokenCluster, tmp_path: Path
):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("first\n")
    (account / "ca.crt").write_bytes(token_cluster.ca.cert)
    (account / "namespace").write_text("better-compute")
    environ = {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(token_cluster.port),
    }
    config = OperatorConfig(database_url="postgresql://unused")

    info = connection_info(config, service_account_dir=account, environ=environ)
    assert (info.server, info.token, info.default_namespace) == (
        token_cluster.url,
        "first",
        "better-compute",
    )
    token_file = service_account_token(config, account)
    assert token_file == account / "token"
    async with (
        KubeClient(from_kopf(info, token_file=token_file)) as kube,
        KubeClient(from_kopf(info)) as kept_copy,
    ):
        assert await kube.get(resources.NAMESPACES, "team-a") is not None
        assert await kept_copy.get(resources.NAMESPACES, "team-a") is not None

        # The kubelet writes a new token; the server stops accepting the old one.
        (account / "token").write_text("second\n")
        token_cluster.accepted[0] = "second"
        token_cluster.seen.clear()
        found = await kube.get(resources.NAMESPACES, "team-b")
        assert found is not None
        assert found["metadata"]["name"] == "team-b"
        # Refused once with the old token, then read again from the file.
        assert token_cluster.seen == ["Bearer first", "Bearer second"]
        # A copy of the token taken at start (what the operator kept before) fails for good.
        with pytest.raises(KubeError) as refused:
            await kept_copy.get(resources.NAMESPACES, "team-b")
        assert refused.value.status == 401

    # kopf, refused too, logs in again and gets the new token.
    again = connection_info(config, service_account_dir=account, environ=environ)
    assert again.token == "second"


def test_an_explicit_api_server_wins_over_the_service_account(tmp_path: Path):
    (tmp_path / "token").write_text("pod-token")
    config = OperatorConfig(
        database_url="postgresql://unused", api_server="http://127.0.0.1:1", api_token="given"
    )
    assert service_account_token(config, tmp_path) is None
    info = connection_info(config, service_account_dir=tmp_path, environ={})
    assert (info.server, info.token) == ("http://127.0.0.1:1", "given")
