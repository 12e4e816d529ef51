"""The operator notices a renewed webhook certificate (and only a real change)."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
from pathlib import Path

import httpx

from bettercompute.operator import certificates


async def test_a_changed_certificate_is_noticed(tmp_path: Path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_text("cert v1")
    key.write_text("key v1")
    watching = asyncio.create_task(certificates.changed([cert, key], interval_s=0.01))
    await asyncio.sleep(0.1)
    assert not watching.done()  # nothing changed yet
    cert.write_text("cert v2")
    await asyncio.wait_for(watching, timeout=2)


async def test_a_briefly_missing_file_is_not_a_change(tmp_path: Path):
    cert = tmp_path / "tls.crt"
    cert.write_text("cert v1")
    watching = asyncio.create_task(certificates.changed([cert], interval_s=0.01))
    cert.unlink()  # a Secret update swapping its symlink
    await asyncio.sleep(0.1)
    cert.write_text("cert v1")
    await asyncio.sleep(0.1)
    assert not watching.done()
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)


def _self_signed(tmp_path: Path, *, days: int) -> tuple[Path, Path, float]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    ends = now + dt.timedelta(days=days)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(ends)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert, key_path = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key_path, ends.timestamp()


def test_the_expiry_is_read_from_the_certificate_and_nothing_from_junk(tmp_path: Path):
    cert, _, ends = _self_signed(tmp_path, days=20)
    assert certificates.expiry(cert) == ends
    junk = tmp_path / "junk.crt"
    junk.write_text("not a certificate")
    assert certificates.expiry(junk) is None
    assert certificates.expiry(tmp_path / "missing.crt") is None


async def test_the_operator_reports_when_its_webhook_certificate_expires(
    tmp_path: Path, start_operator
):
    cert, key, ends = _self_signed(tmp_path, days=20)
    async with (
        start_operator(webhook_cert=cert, webhook_key=key) as op,
        httpx.AsyncClient(base_url=op.metrics_url) as client,
    ):
        text = (await client.get("/metrics")).text
    [line] = [
        line
        for line in text.splitlines()
        if line.startswith("bettercompute_webhook_certificate_expiry_timestamp_seconds ")
    ]
    assert float(line.split()[1]) == ends
