"""The local control plane's certificates and keys.

One self-signed CA signs the API server's serving certificate and the client
certificates (admin in system:masters, the controller manager, the kubelet); a separate
RSA key pair signs service-account tokens. Everything is written once into a directory
and reused while it is there.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.directory / "sa.pub"

    def client(self, name: str) -> tuple[Path, Path]:
        return self.directory / f"{name}.crt", self.directory / f"{name}.key"


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: object) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _load_ca(pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def _issue(
    pki: Pki,
    cert_path: Path,
    key_path: Path,
    subject: x509.Name,
    usage: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None = None,
) -> None:
    ca_cert, ca_key = _load_ca(pki)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure_serving_cert(
    pki: Pki,
    name: str,
    dns_names: tuple[str, ...] = ("localhost",),
    ip_addresses: tuple[str, ...] = ("127.0.0.1",),
) -> tuple[Path, Path]:
    """A server certificate `<name>.crt`/`<name>.key` signed by the CA (written once), for
    other TLS servers than the API server, e.g. an etcd with client-certificate auth."""
    cert_path, key_path = pki.client(name)
    if not cert_path.exists():
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        _issue(pki, cert_path, key_path, _name(name), [ExtendedKeyUsageOID.SERVER_AUTH], sans)
    return cert_path, key_path


def ensure_pki(directory: Path, client_names: dict[str, str | None]) -> Pki:
    """Create (once) the CA, serving cert, SA key pair and the named client certs.

    client_names maps a file name to "CN" or "CN|O" (O: the group, e.g. system:masters).
    """
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory)
    if not pki.ca_cert.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        name = _name("shoal-localkube-ca")
        cert = (
            _builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
        _write_key(pki.ca_key, key)
        pki.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if not pki.serving_cert.exists():
        sans: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
        ]
        _issue(
            pki,
            pki.serving_cert,
            pki.serving_key,
            _name("kube-apiserver"),
            [ExtendedKeyUsageOID.SERVER_AUTH],
            sans,
        )
    if not pki.sa_key.exists():
        sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(pki.sa_key, sa)
        pki.sa_pub.write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
    for file_name, identity in client_names.items():
        cert_path, key_path = pki.client(file_name)
        if cert_path.exists():
            continue
        common_name, _, organization = (identity or file_name).partition("|")
        _issue(
            pki,
            cert_path,
            key_path,
            _name(common_name, organization or None),
            [ExtendedKeyUsageOID.CLIENT_AUTH],
        )
    return pki
