"""The local plane's certificates: right subjects, groups and names; made once."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harness.localkube.pki import ensure_pki


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certificates_carry_the_identities_kubernetes_reads(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path, {"admin": "shoal-admin|system:masters", "cm": None})
    ca = load(pki.ca_cert)
    admin = load(pki.client("admin")[0])
    assert admin.issuer == ca.subject
    assert admin.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "shoal-admin"
    # Kubernetes maps O to groups: system:masters is cluster-admin.
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
        "system:masters"
    )
    usage = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usage
    cm = load(pki.client("cm")[0])
    assert cm.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "cm"

    serving = load(pki.serving_cert)
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)
    assert pki.sa_key.stat().st_mode & 0o077 == 0
    assert b"PUBLIC KEY" in pki.sa_pub.read_bytes()


def test_existing_files_are_kept(tmp_path: Path) -> None:
    first = ensure_pki(tmp_path, {"admin": None})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ensure_pki(tmp_path, {"admin": None, "extra": None})
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {k: after[k] for k in before} == before
    assert first.client("extra")[0].name in after
