"""The certificates and keys a small real cluster needs, made fresh for each start.

Why it exists: the real kube-apiserver serves TLS, trusts client certificates signed by its
client CA, and signs service-account tokens with a key of its own; a cluster made by kubeadm
has exactly these. We make them with ``cryptography`` in a few milliseconds instead of
shelling out to openssl; the CA is ``core.tls``'s, the one the operator's webhooks use.

What it must never do: write anywhere but the directory it is given, write a key readable by
others, or make a certificate that outlives its cluster by long (``lifetime``: a day for a
test session, longer for ``better-compute dev --kube``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bettercompute.core import tls

LIFETIME = dt.timedelta(days=1)


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


class Authority:
    """One CA: the cluster's (serving and client certificates alike, as kubeadm's ``ca``)."""

    def __init__(self, directory: Path, *, lifetime: dt.timedelta = LIFETIME) -> None:
        self.directory = directory
        self.lifetime = lifetime
        # The operator's own CA maker (core.tls): a self-signed EC CA.
        cert_pem, key_pem = tls.new_authority(
            now=dt.datetime.now(dt.UTC), lifetime=lifetime, name="better-compute cluster CA"
        )
        self._cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self.pair = self._write("ca", self._cert, self._key)

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def _write(self, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
        cert_path, key_path = self.directory / f"{stem}.crt", self.directory / f"{stem}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.touch(mode=0o600)
        key_path.chmod(0o600)
        key_path.write_bytes(_key_pem(key))
        return Pair(cert=cert_path, key=key_path)

    def issue(
        self,
        stem: str,
        *,
        common_name: str,
        organizations: tuple[str, ...] = (),
        hosts: tuple[str, ...] = (),
        client: bool = False,
    ) -> Pair:
        """A leaf certificate: for serving ``hosts`` (names or IPs), or a client (``client``)
        whose user is ``common_name`` and whose groups are ``organizations``."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organizations))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - tls.BACKDATE)
            .not_valid_after(min(now + self.lifetime, self._cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if hosts:
            sans: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    sans.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return self._write(stem, builder.sign(self._key, hashes.SHA256()), key)


def service_account_keys(directory: Path) -> Pair:
    """The key pair the API server signs service-account tokens with (``cert`` is the public
    key, as ``--service-account-key-file`` takes it)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public, private = directory / "sa.pub", directory / "sa.key"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    private.touch(mode=0o600)
    private.chmod(0o600)
    private.write_bytes(_key_pem(key))
    return Pair(cert=public, key=private)
