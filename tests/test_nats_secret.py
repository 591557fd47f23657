"""The operator's handling of a group's spec.nats Secrets (tlsSecret, credentialsSecret).

NatsClients reads Secrets through anything with `read_secret` (here a dict), checks them,
writes their files privately and caches them by resourceVersion; then it connects with
them to a real nats-server that requires TLS with a client certificate and a password,
and says which Secret NATS refused. The same on the local plane, through the API server
and with consumer pods: e2e/test_nats_tls.py.
"""

from __future__ import annotations

import secrets as random_secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from harness.fakesecrets import FakeSecrets, b64, file_mode
from harness.localkube.pki import ensure_pki
from harness.securenats import NatsUser, SecureNats, secure_nats_server
from shoal.clients.nats import connect
from shoal.clients.natsauth import NatsSecurity
from shoal.contracts.spec import NatsSpec
from shoal.operator.builders import NatsPodSecrets
from shoal.operator.etcdsecret import SecretData
from shoal.operator.natssecret import (
    SECRET_FORBIDDEN,
    SECRET_MISSING,
    NatsClients,
    NatsSecretProblem,
    decode_credentials,
    decode_tls,
)


def _pems(*clients: str) -> dict[str, bytes]:
    """A CA and client certificates, real ones: the operator loads them before use."""
    with tempfile.TemporaryDirectory() as directory:
        pki = ensure_pki(Path(directory), dict.fromkeys(clients))
        pems = {"ca.crt": pki.ca_cert.read_bytes()}
        for client in clients:
            cert, key = pki.client(client)
            pems[f"{client}.crt"], pems[f"{client}.key"] = cert.read_bytes(), key.read_bytes()
        return pems


PEMS, OTHER = _pems("client"), _pems("client")
CA, CERT, KEY = PEMS["ca.crt"], PEMS["client.crt"], PEMS["client.key"]
CREDS = b"-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n"
SEED = b"SUAMLK2ZNL35WSMW37E7UD4VZ7ELPEE7LLQKLE5A6W3PMHQOR5GXBRQOZE\n"
PASSWORD = "nats-password-4711"
USER, OPERATOR = "orders", "shoal-operator"


def tls_data(**extra: str) -> dict[str, str]:
    return {"ca.crt": b64(CA), "tls.crt": b64(CERT), "tls.key": b64(KEY), **extra}


@pytest.fixture
async def clients(secrets: FakeSecrets, tmp_path: Path) -> Any:
    nats = NatsClients(secrets, NatsSecurity(), tmp_path / "nats-secrets")
    yield nats
    await nats.close()


def read(path: str) -> bytes:
    return Path(path).read_bytes()


# -- checking ----------------------------------------------------------------------------------


def test_a_complete_tls_secret_and_a_ca_only_one_decode() -> None:
    assert decode_tls("prod", "t", tls_data()) == {"ca.crt": CA, "tls.crt": CERT, "tls.key": KEY}
    assert decode_tls("prod", "t", {"ca.crt": b64(CA)}) == {"ca.crt": CA}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "has no ca.crt: it needs ca.crt"),
        ({"tls.crt": b64(CERT), "tls.key": b64(KEY)}, "has no ca.crt"),
        ({"ca.crt": b64(CA), "tls.crt": b64(CERT)}, "has no tls.key: tls.crt and tls.key go"),
        ({"ca.crt": b64(CA), "tls.key": b64(KEY)}, "has no tls.crt"),
        ({**tls_data(), "ca.crt": "not base64!"}, "ca.crt is not base64"),
        ({**tls_data(), "tls.crt": b64(KEY)}, "tls.crt is not a PEM certificate"),
        ({**tls_data(), "tls.key": b64(CERT)}, "tls.key is not a PEM private key"),
    ],
)
def test_an_unusable_tls_secret_says_what_is_wrong(data: dict[str, str], message: str) -> None:
    with pytest.raises(NatsSecretProblem) as info:
        decode_tls("prod", "nats-tls", data)
    assert info.value.reason == SECRET_MISSING
    assert info.value.message.startswith("Secret prod/nats-tls (spec.nats.tlsSecret)")
    assert message in info.value.message


@pytest.mark.parametrize(
    ("data", "form"),
    [
        ({"creds": b64(CREDS)}, "creds"),
        ({"user": b64(USER), "password": b64(PASSWORD)}, "user"),
        ({"nkey": b64(SEED)}, "nkey"),
    ],
)
def test_each_form_of_credentials_decodes(data: dict[str, str], form: str) -> None:
    found, decoded = decode_credentials("prod", "nats", data)
    assert found == form
    assert set(decoded) == set(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "needs one of: key creds"),
        ({"creds": b64(CREDS), "nkey": b64(SEED)}, "it has more than one"),
        ({"user": b64(USER)}, "has no password: user and password go together"),
        ({"password": b64(PASSWORD)}, "has no user"),
        ({"user": b64(b"\xff"), "password": b64(PASSWORD)}, "user is not UTF-8"),
        ({"creds": b64("hello")}, "creds is not a NATS credentials file"),
        ({"nkey": b64("SAABC")}, "nkey is not an nkey user seed"),
    ],
)
def test_unusable_credentials_say_what_is_wrong(data: dict[str, str], message: str) -> None:
    with pytest.raises(NatsSecretProblem) as info:
        decode_credentials("prod", "nats", data)
    assert info.value.reason == SECRET_MISSING
    assert info.value.message.startswith("Secret prod/nats (spec.nats.credentialsSecret)")
    assert message in info.value.message
    assert PASSWORD not in info.value.message


# -- files -------------------------------------------------------------------------------------


async def test_files_are_private_and_the_password_stays_in_memory(
    clients: NatsClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "tls"] = SecretData("7", tls_data())
    secrets.secrets["prod", "auth"] = SecretData(
        "8", {"user": b64(USER), "password": b64(PASSWORD)}
    )
    group = await clients.group("prod", NatsSpec(tls_secret="tls", credentials_secret="auth"))
    security = group.security
    assert file_mode(clients.root) == 0o700
    for path, content in (
        (security.ca_file, CA),
        (security.cert_file, CERT),
        (security.key_file, KEY),
    ):
        assert path is not None
        assert read(path) == content
        assert file_mode(Path(path)) == 0o600 and file_mode(Path(path).parent) == 0o700
        assert Path(path).parent.parent == clients.root
    assert (security.user, security.password) == (USER, PASSWORD)
    assert security.creds_file is None
    written = [p for p in clients.root.rglob("*") if p.is_file()]
    assert all(PASSWORD.encode() not in p.read_bytes() for p in written)
    assert PASSWORD not in repr(group)
    assert group.pods == NatsPodSecrets(
        credentials="user", client_certificate=True, tls_version="7", credentials_version="8"
    )


async def test_a_creds_file_and_a_ca_only_tls_secret(
    clients: NatsClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "tls"] = SecretData("1", {"ca.crt": b64(CA)})
    secrets.secrets["prod", "auth"] = SecretData("2", {"creds": b64(CREDS)})
    group = await clients.group("prod", NatsSpec(tls_secret="tls", credentials_secret="auth"))
    assert group.security.cert_file is None and group.security.key_file is None
    assert group.security.creds_file is not None
    assert read(group.security.creds_file) == CREDS
    assert group.pods.client_certificate is False and group.pods.credentials == "creds"


async def test_the_operators_own_identity_wins_and_fills_in_what_a_group_does_not_name(
    secrets: FakeSecrets, tmp_path: Path
) -> None:
    """The operator's own credentials, when set, are used even for a group that names a
    credentialsSecret (with least privilege the members' user may not manage streams);
    the group's Secret still serves the pods. Without credentials of its own, the
    operator uses the group's."""
    own = NatsSecurity(ca_file="/own/ca.crt", user="shoal-operator", password="own-pw")
    nats = NatsClients(secrets, own, tmp_path / "n")
    try:
        assert (await nats.group("prod", NatsSpec())).security == own
        secrets.secrets["prod", "tls"] = SecretData("1", {"ca.crt": b64(CA)})
        only_tls = (await nats.group("prod", NatsSpec(tls_secret="tls"))).security
        assert only_tls.ca_file != own.ca_file  # the group's CA
        assert (only_tls.user, only_tls.password) == ("shoal-operator", "own-pw")
        secrets.secrets["prod", "auth"] = SecretData("2", {"nkey": b64(SEED)})
        only_auth = await nats.group("prod", NatsSpec(credentials_secret="auth"))
        assert only_auth.security == own
        assert only_auth.pods.credentials == "nkey"  # the pods still get the group's
        assert only_auth.describe("prod", "NatsAuthFailed") == (
            "the operator's own NATS credentials"
        )
    finally:
        await nats.close()
    anonymous = NatsClients(secrets, NatsSecurity(ca_file="/own/ca.crt"), tmp_path / "a")
    try:
        group = await anonymous.group("prod", NatsSpec(credentials_secret="auth"))
        assert group.security.ca_file == "/own/ca.crt"
        assert group.security.nkey_seed_file is not None and group.security.user is None
        assert "spec.nats.credentialsSecret" in group.describe("prod", "NatsAuthFailed")
    finally:
        await anonymous.close()


async def test_files_are_cached_by_resource_version(
    clients: NatsClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "tls"] = SecretData("7", tls_data())
    first = await clients.tls_files("prod", "tls")
    assert await clients.tls_files("prod", "tls") is first
    secrets.secrets["prod", "tls"] = SecretData("8", {"ca.crt": b64(CERT)})
    second = await clients.tls_files("prod", "tls")
    assert second.version == "8" and not second.client_certificate
    assert not first.directory.exists()  # the replaced version's files are gone
    assert clients.known("prod", NatsSpec(tls_secret="tls")) == NatsPodSecrets(
        client_certificate=False, tls_version="8"
    )
    assert clients.known("prod", NatsSpec(tls_secret="other")) is None


async def test_a_missing_secret_and_a_secret_gone_while_deleting(
    clients: NatsClients, secrets: FakeSecrets
) -> None:
    with pytest.raises(NatsSecretProblem) as info:
        await clients.group("prod", NatsSpec(credentials_secret="auth"))
    assert info.value.reason == SECRET_MISSING
    assert info.value.message == "Secret prod/auth (spec.nats.credentialsSecret) not found"
    secrets.secrets["prod", "auth"] = SecretData("1", {"creds": b64(CREDS)})
    before = await clients.credential_files("prod", "auth")
    del secrets.secrets["prod", "auth"]
    assert await clients.credential_files("prod", "auth", stale_ok=True) is before


async def test_a_key_that_is_not_the_certificates_is_unusable(
    clients: NatsClients, secrets: FakeSecrets
) -> None:
    other_key = b64(OTHER["client.key"])
    secrets.secrets["prod", "tls"] = SecretData("3", tls_data(**{"tls.key": other_key}))
    with pytest.raises(NatsSecretProblem) as info:
        await clients.tls_files("prod", "tls")
    assert info.value.reason == SECRET_MISSING
    assert info.value.message.startswith(
        "Secret prod/tls (spec.nats.tlsSecret): its certificates cannot be used:"
    )
    assert list(clients.root.iterdir()) == []


async def test_an_invalid_new_version_keeps_nothing_half_written(
    clients: NatsClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "tls"] = SecretData("9", {"tls.crt": b64(CERT)})
    with pytest.raises(NatsSecretProblem):
        await clients.tls_files("prod", "tls")
    assert list(clients.root.iterdir()) == []


async def test_no_permission_to_read_secrets(clients: NatsClients, secrets: FakeSecrets) -> None:
    secrets.error = ApiException(status=403, reason="Forbidden")
    with pytest.raises(NatsSecretProblem) as info:
        await clients.group("prod", NatsSpec(tls_secret="tls"))
    assert info.value.reason == SECRET_FORBIDDEN
    assert "Secret prod/tls (spec.nats.tlsSecret)" in info.value.message
    secrets.error = ApiException(status=500, reason="Internal Server Error")
    with pytest.raises(ApiException):
        await clients.group("prod", NatsSpec(tls_secret="tls"))


def test_the_default_directory_is_private_and_temporary(secrets: FakeSecrets) -> None:
    import asyncio

    nats = NatsClients(secrets, NatsSecurity())
    assert file_mode(nats.root) == 0o700 and nats.root.name.startswith("shoal-operator-nats-")
    asyncio.run(nats.close())
    assert not nats.root.exists()


# -- a real nats-server requiring TLS with client certificates and a password ------------------


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    nats = secure_nats_server(
        tmp_path_factory.mktemp("secure-nats"),
        [NatsUser(USER, PASSWORD), NatsUser(OPERATOR, random_secrets.token_hex(8))],
    )
    with nats.server:
        yield nats


def tls_secret(secure: SecureNats) -> SecretData:
    data = {key: b64(path.read_bytes()) for key, path in secure.tls_files().items()}
    return SecretData("1", data)


def user_secret(password: str, version: str = "1") -> SecretData:
    return SecretData(version, {"user": b64(USER), "password": b64(password)})


SPEC = NatsSpec(tls_secret="nats-tls", credentials_secret="nats-auth")


async def test_connects_with_the_groups_secrets_and_keeps_the_connection(
    secure: SecureNats, clients: NatsClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "nats-tls"] = tls_secret(secure)
    secrets.secrets["prod", "nats-auth"] = user_secret(PASSWORD)
    nc = await clients.get(secure.url, "prod", SPEC, connect=connect, attempts=1)
    info = await nc.jetstream().account_info()  # JetStream through TLS, as user orders
    assert info.limits is not None
    assert await clients.get(secure.url, "prod", SPEC, connect=connect, attempts=1) is nc
    assert len(clients) == 1

    # A new version of a Secret: a new connection, and the old one is closed.
    secrets.secrets["prod", "nats-auth"] = user_secret(PASSWORD, version="2")
    again = await clients.get(secure.url, "prod", SPEC, connect=connect, attempts=1)
    assert again is not nc and nc.is_closed and not again.is_closed
    assert len(clients) == 1


async def test_a_wrong_password_is_nats_auth_failed_naming_the_secret(
    secure: SecureNats, clients: NatsClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "nats-tls"] = tls_secret(secure)
    secrets.secrets["prod", "nats-auth"] = user_secret("not-the-password")
    with pytest.raises(NatsSecretProblem) as info:
        await clients.get(secure.url, "prod", SPEC, connect=connect, attempts=1)
    assert info.value.reason == "NatsAuthFailed"
    assert f"NATS at {secure.url} with Secret prod/nats-auth" in info.value.message
    assert "not-the-password" not in info.value.message
    assert len(clients) == 0  # nothing kept: the next call tries again


async def test_an_unknown_ca_is_nats_tls_failed_naming_the_secret(
    secure: SecureNats,
    clients: NatsClients,
    secrets: FakeSecrets,
    tmp_path: Path,
) -> None:
    other = secure_nats_server(tmp_path / "other", [])  # only for its CA; never started
    secrets.secrets["prod", "nats-tls"] = SecretData(
        "1", {**tls_secret(secure).data, "ca.crt": b64(other.security.ca_file.read_bytes())}
    )
    secrets.secrets["prod", "nats-auth"] = user_secret(PASSWORD)
    with pytest.raises(NatsSecretProblem) as info:
        await clients.get(secure.url, "prod", SPEC, connect=connect, attempts=1)
    assert info.value.reason == "NatsTLSFailed"
    assert "with Secret prod/nats-tls (spec.nats.tlsSecret):" in info.value.message
