"""The EC certificate authority and serving certificates of our TLS servers, as PEM bytes.

Why it exists: two parts of the product make a small CA of their own and sign serving
certificates with it. The operator's admission webhooks (``operator.webhookcerts``, which
keeps them in a Secret and renews them) and ``better-compute dev --kube``, whose real
Kubernetes control plane on loopback needs a cluster CA (``dev.controlplane.pki``). Both use
these functions, so there is one way we make a CA and one way we sign a server's certificate.

What it must never do: any I/O or clock read (callers pass ``now``), or log key material.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: A certificate is valid from a little before it is made: clocks of the API server differ.
BACKDATE = dt.timedelta(minutes=5)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    """An EC private key as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def new_authority(
    *, now: dt.datetime, lifetime: dt.timedelta, name: str = "better-compute webhook CA"
) -> tuple[bytes, bytes]:
    """A self-signed CA: (certificate PEM, key PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM), pem_key(key)


def issue(
    *,
    ca_pem: bytes,
    ca_key_pem: bytes,
    names: Sequence[str],
    now: dt.datetime,
    lifetime: dt.timedelta,
) -> tuple[bytes, bytes]:
    """A serving certificate for ``names`` (DNS names, or IP addresses), signed by the CA."""
    authority = x509.load_pem_x509_certificate(ca_pem)
    signer = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(signer, ec.EllipticCurvePrivateKey):
        raise ValueError("the webhook CA's key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    ends = min(now + lifetime, authority.not_valid_after_utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(authority.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(ends)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM), pem_key(key)
