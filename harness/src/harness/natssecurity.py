"""A secured nats-server for tests and the local plane: TLS, passwords, permissions.

`NatsServerSecurity.generate(directory, users)` writes a private CA, the server's
certificate (valid for 127.0.0.1 and localhost) and a client certificate, and describes
the users (a password each and, optionally, subject permissions). Given to
``NatsServer(workdir, security=...)``, the server runs from a generated config file:

* ``tls { verify: true }``: every client must present a certificate from that CA, and
  still log in with a user and password (verify does not map certificates to users);
* one account, ``SHOAL``, with JetStream enabled, holding every user;
* each user's ``permissions`` as given (None: everything).

    security = NatsServerSecurity.generate(tmp_path / "pki", [NatsUser("member", "pw")])
    with NatsServer(tmp_path / "nats", security=security) as server:
        # server.url is tls://127.0.0.1:<port>; clients trust security.ca_file and
        # present security.client_cert / security.client_key; a member's environment:
        env = {"NATS_URL": server.url, **security.client_env("member")}

`server.reload(new_security)` rewrites the config and sends SIGHUP (rotate a password,
remove a user: nats-server drops the clients whose login no longer holds).

`issue_client_cert(...)` makes other client certificates from the same CA, e.g. one
that expired already (``expired=True``) for error tests.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from harness.localkube.pki import Pki, ensure_pki, ensure_serving_cert
from shoal.clients.natsauth import NatsSecurity

__all__ = ["NatsServerSecurity", "NatsUser", "issue_client_cert", "subject_matches"]

#: The account every user of a secured server belongs to (JetStream enabled).
ACCOUNT = "SHOAL"
CLIENT_CERT = "nats-client"


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more trailing tokens. The tests'
    own reading of an allow list, independent of the code that writes the lists."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


@dataclass(frozen=True)
class NatsUser:
    """One user of a secured nats-server. `publish` / `subscribe`: the subjects the user
    may use (NATS wildcards allowed); None allows everything."""

    name: str
    password: str
    publish: tuple[str, ...] | None = None
    subscribe: tuple[str, ...] | None = None

    def config(self) -> dict[str, object]:
        entry: dict[str, object] = {"user": self.name, "password": self.password}
        permissions: dict[str, object] = {}
        if self.publish is not None:
            permissions["publish"] = {"allow": list(self.publish)}
        if self.subscribe is not None:
            permissions["subscribe"] = {"allow": list(self.subscribe)}
        if permissions:
            entry["permissions"] = permissions
        return entry


@dataclass(frozen=True)
class NatsServerSecurity:
    """What a secured NatsServer needs (and what its clients need to reach it)."""

    ca_file: Path  # the CA clients trust, and whose client certificates the server takes
    server_cert: Path
    server_key: Path
    client_cert: Path  # a client certificate from the CA, valid for a year
    client_key: Path
    users: tuple[NatsUser, ...]
    verify: bool = True  # require a client certificate
    # A whole NATS ``accounts`` block to run with instead of the one SHOAL account (e.g.
    # `shoal-consumer permissions --accounts`); `users` then only name the passwords.
    accounts: str | None = None

    @classmethod
    def generate(
        cls,
        directory: str | Path,
        users: Sequence[NatsUser],
        *,
        verify: bool = True,
        dns_names: Sequence[str] = ("localhost",),
        ip_addresses: Sequence[str] = ("127.0.0.1",),
    ) -> NatsServerSecurity:
        """Write (once) the CA and certificates into `directory`; describe `users`.

        The server's certificate is valid for `dns_names` and `ip_addresses` (e.g. a
        Service's name, for pods that reach the server through it)."""
        pki = ensure_pki(Path(directory), {CLIENT_CERT: "shoal-nats-client"})
        server_cert, server_key = ensure_serving_cert(
            pki, "nats-server", tuple(dns_names), tuple(ip_addresses)
        )
        client_cert, client_key = pki.client(CLIENT_CERT)
        return cls(
            ca_file=pki.ca_cert,
            server_cert=server_cert,
            server_key=server_key,
            client_cert=client_cert,
            client_key=client_key,
            users=tuple(users),
            verify=verify,
        )

    def user(self, name: str) -> NatsUser:
        for user in self.users:
            if user.name == name:
                return user
        raise KeyError(name)

    def client_env(self, user: str, inbox_prefix: str | None = None) -> dict[str, str]:
        """The NATS_* environment a Shoal member (or produce, or the export) needs to
        reach this server as `user` (shoal.group.config: NATS_CA_FILE ...)."""
        env = {
            "NATS_CA_FILE": str(self.ca_file),
            "NATS_CERT_FILE": str(self.client_cert),
            "NATS_KEY_FILE": str(self.client_key),
            "NATS_USER": user,
            "NATS_PASSWORD": self.user(user).password,
        }
        if inbox_prefix:
            env["NATS_INBOX_PREFIX"] = inbox_prefix
        return env

    def client(self, user: str, inbox_prefix: str | None = None) -> NatsSecurity:
        """The settings a test's own client needs to reach this server as `user` (the
        same files and password as `client_env`, as shoal.clients.natsauth takes them)."""
        return NatsSecurity(
            ca_file=str(self.ca_file),
            cert_file=str(self.client_cert),
            key_file=str(self.client_key),
            user=user,
            password=self.user(user).password,
            inbox_prefix=inbox_prefix,
        )

    def config_text(self) -> str:
        """The config file's tls and accounts blocks (NATS config accepts JSON values)."""
        tls = {
            "cert_file": str(self.server_cert),
            "key_file": str(self.server_key),
            "ca_file": str(self.ca_file),
            "verify": self.verify,
            "timeout": 2,
        }
        if self.accounts is not None:
            return f"tls: {json.dumps(tls)}\n{self.accounts}"
        accounts = {ACCOUNT: {"jetstream": "enabled", "users": [u.config() for u in self.users]}}
        return f"tls: {json.dumps(tls)}\naccounts: {json.dumps(accounts)}\n"


def issue_client_cert(
    ca_file: Path, directory: Path, name: str, *, expired: bool = False
) -> tuple[Path, Path]:
    """A client certificate `<name>.crt`/`.key` in `directory`, signed by the CA whose
    certificate is `ca_file` (its key beside it, as `ensure_pki` writes it). With
    `expired`, its validity ended a day ago."""
    ca = Pki(ca_file.parent)
    ca_cert = x509.load_pem_x509_certificate(ca.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = (
        (now - datetime.timedelta(days=30), now - datetime.timedelta(days=1))
        if expired
        else (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=365))
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
