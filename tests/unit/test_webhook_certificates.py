"""When the operator's webhook certificate is made, kept and renewed (``operator.webhookcerts``),
judged with a clock the test moves: the pure half, no cluster."""

from __future__ import annotations

import datetime as dt

from cryptography import x509

from bettercompute.operator import webhookcerts

NAMES = ["bcd-operator.bcd.svc", "bcd-operator.bcd.svc.cluster.local", "127.0.0.1"]
T0 = dt.datetime(2026, 12, 4, tzinfo=dt.UTC)


def _authorities(bundle: webhookcerts.Bundle) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(bundle.ca_bundle)


def test_a_missing_certificate_is_made_for_every_name_and_chains_to_its_authority():
    bundle = webhookcerts.renewed(None, names=NAMES, now=T0)
    assert bundle is not None
    serving, authority = bundle.serving(), bundle.authority()
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == NAMES[:2]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    serving.verify_directly_issued_by(authority)
    assert serving.not_valid_after_utc == T0 + webhookcerts.SERVING_LIFETIME
    assert serving.not_valid_before_utc < T0  # backdated for clocks that differ
    assert [a.serial_number for a in _authorities(bundle)] == [authority.serial_number]


def test_a_fresh_certificate_stands_and_is_renewed_once_a_third_is_left():
    bundle = webhookcerts.renewed(None, names=NAMES, now=T0)
    assert bundle is not None
    assert webhookcerts.renewed(bundle, names=NAMES, now=T0 + dt.timedelta(days=200)) is None
    later = T0 + dt.timedelta(days=250)  # 115 days left of 365: due
    again = webhookcerts.renewed(bundle, names=NAMES, now=later)
    assert again is not None
    assert again.serving().serial_number != bundle.serving().serial_number
    # Same authority: the caBundle the webhook configurations hold does not change.
    assert (again.ca_pem, again.ca_bundle) == (bundle.ca_pem, bundle.ca_bundle)
    assert again.serving().not_valid_before_utc < later


def test_a_name_the_certificate_lacks_gets_a_new_one_at_once():
    bundle = webhookcerts.renewed(None, names=NAMES[:1], now=T0)
    assert bundle is not None
    again = webhookcerts.renewed(bundle, names=NAMES, now=T0 + dt.timedelta(minutes=1))
    assert again is not None
    assert again.ca_pem == bundle.ca_pem


def test_a_renewed_authority_is_trusted_beside_the_old_one_until_that_expires():
    ten_years = webhookcerts.CA_LIFETIME
    bundle = webhookcerts.renewed(None, names=NAMES, now=T0)
    assert bundle is not None
    late = T0 + ten_years * 0.7
    again = webhookcerts.renewed(bundle, names=NAMES, now=late)
    assert again is not None
    assert again.ca_pem != bundle.ca_pem
    assert [a.serial_number for a in _authorities(again)] == [
        again.authority().serial_number,
        bundle.authority().serial_number,
    ]
    again.serving().verify_directly_issued_by(again.authority())
    # Once the old authority has expired, the bundle lets it go.
    gone = webhookcerts.renewed(again, names=NAMES, now=T0 + ten_years + dt.timedelta(days=1))
    assert gone is not None
    assert bundle.authority().serial_number not in [a.serial_number for a in _authorities(gone)]


def test_a_secret_that_is_incomplete_or_not_base64_reads_as_none():
    bundle = webhookcerts.renewed(None, names=NAMES, now=T0)
    assert bundle is not None
    secret = webhookcerts.secret_manifest(bundle, name="s", namespace="n")
    assert webhookcerts.bundle_of(secret) == bundle
    del secret["data"]["ca.key"]
    assert webhookcerts.bundle_of(secret) is None
    assert (
        webhookcerts.bundle_of(
            {"data": {k: "!!" for k in ("tls.crt", "tls.key", "ca.crt", "ca.key")}}
        )
        is None
    )
    assert webhookcerts.bundle_of(None) is None
