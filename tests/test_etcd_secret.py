"""The operator's handling of a group's spec.etcd.tlsSecret, without a cluster.

EtcdClients reads Secrets through anything with `read_secret` (here a dict), checks
them, writes their files privately and caches them by resourceVersion. Connecting to a
real TLS etcd with those files is in test_etcd_tls.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException

from harness.fakesecrets import FakeSecrets, b64, file_mode
from shoal.operator.etcdsecret import (
    SECRET_FORBIDDEN,
    SECRET_INVALID,
    SECRET_MISSING,
    EtcdClients,
    EtcdSecretProblem,
    SecretData,
    SecretFiles,
    data_version,
    decode_secret,
)

CA = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"
# Long enough never to turn up by chance in a repr's random directory name (a "pw" once
# did: ".etcd.ta1opw9l").
PASSWORD = "secret-password-17"


def tls_data(**extra: str) -> dict[str, str]:
    return {"ca.crt": b64(CA), "tls.crt": b64(CERT), "tls.key": b64(KEY), **extra}


@pytest.fixture
def clients(secrets: FakeSecrets, tmp_path: Path) -> EtcdClients:
    return EtcdClients(secrets, tmp_path / "etcd-secrets")


# -- checking ----------------------------------------------------------------------------------


def test_a_complete_secret_decodes() -> None:
    decoded = decode_secret("ns", "s", tls_data(username=b64("shoal"), password=b64("pw")))
    assert decoded == {
        "ca.crt": CA,
        "tls.crt": CERT,
        "tls.key": KEY,
        "username": b"shoal",
        "password": b"pw",
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "has no ca.crt, tls.crt, tls.key: it needs ca.crt, tls.crt and tls.key"),
        ({"ca.crt": b64(CA), "tls.crt": b64(CERT)}, "has no tls.key"),
        ({**tls_data(), "tls.key": ""}, "has no tls.key"),
        ({**tls_data(), "ca.crt": "not base64!"}, "ca.crt is not base64"),
        ({**tls_data(), "tls.crt": b64(KEY)}, "tls.crt is not a PEM certificate"),
        ({**tls_data(), "tls.key": b64(CERT)}, "tls.key is not a PEM private key"),
        (tls_data(username=b64("shoal")), "username and password go together"),
        (tls_data(password=b64("pw")), "username and password go together"),
        (tls_data(username=b64(b"\xff"), password=b64("pw")), "username is not UTF-8"),
    ],
)
def test_an_unusable_secret_says_what_is_wrong(data: dict[str, str], message: str) -> None:
    with pytest.raises(EtcdSecretProblem) as info:
        decode_secret("prod", "etcd-client", data)
    assert info.value.reason == SECRET_INVALID
    assert info.value.message.startswith("Secret prod/etcd-client (spec.etcd.tlsSecret)")
    assert message in info.value.message
    assert "\n" not in info.value.message


# -- files -------------------------------------------------------------------------------------


async def test_files_are_private_and_hold_the_secret(
    clients: EtcdClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "etcd"] = SecretData(
        "7", tls_data(username=b64("shoal"), password=b64(PASSWORD))
    )
    files = await clients.files("prod", "etcd")
    check_private_files(clients.root, files)


def check_private_files(root: Path, files: SecretFiles) -> None:
    assert file_mode(root) == 0o700
    assert file_mode(files.directory) == 0o700
    assert files.directory.parent == root
    options = files.options()
    for path, content in (
        (options["ca_file"], CA),
        (options["cert_file"], CERT),
        (options["key_file"], KEY),
    ):
        assert path is not None
        assert Path(path).parent == files.directory
        assert Path(path).read_bytes() == content
        assert file_mode(Path(path)) == 0o600
    assert (options["username"], options["password"]) == ("shoal", PASSWORD)
    # Credentials stay in memory: only the three PEM files are written.
    assert sorted(p.name for p in files.directory.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert PASSWORD not in repr(files)


async def test_files_are_cached_by_resource_version(
    clients: EtcdClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "etcd"] = SecretData("7", tls_data())
    first = await clients.files("prod", "etcd")
    assert await clients.files("prod", "etcd") is first
    assert secrets.reads == 2  # read every time, written once

    new_key = KEY.replace(b"MIIE", b"MIIF")
    secrets.secrets["prod", "etcd"] = SecretData("8", {**tls_data(), "tls.key": b64(new_key)})
    second = await clients.files("prod", "etcd")
    assert second.version == "8"
    assert (second.directory / "tls.key").read_bytes() == new_key
    assert not first.directory.exists()  # the replaced version's files are gone


async def test_two_namespaces_same_secret_name_are_two_secrets(
    clients: EtcdClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["a", "etcd"] = SecretData("1", tls_data())
    secrets.secrets["b", "etcd"] = SecretData("1", {**tls_data(), "ca.crt": b64(CERT)})
    a, b = await clients.files("a", "etcd"), await clients.files("b", "etcd")
    assert a.directory != b.directory
    assert (b.directory / "ca.crt").read_bytes() == CERT


async def test_a_missing_secret(clients: EtcdClients, secrets: FakeSecrets) -> None:
    with pytest.raises(EtcdSecretProblem) as info:
        await clients.files("prod", "etcd")
    assert info.value.reason == SECRET_MISSING
    assert info.value.message == "Secret prod/etcd (spec.etcd.tlsSecret) not found"


async def test_a_secret_gone_may_serve_a_deletion_from_the_cache(
    clients: EtcdClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "etcd"] = SecretData("7", tls_data())
    files = await clients.files("prod", "etcd")
    del secrets.secrets["prod", "etcd"]
    with pytest.raises(EtcdSecretProblem):
        await clients.files("prod", "etcd")
    assert await clients.files("prod", "etcd", stale_ok=True) is files


async def test_an_invalid_new_version_keeps_nothing_half_written(
    clients: EtcdClients, secrets: FakeSecrets
) -> None:
    secrets.secrets["prod", "etcd"] = SecretData("9", {"ca.crt": b64(CA)})
    with pytest.raises(EtcdSecretProblem) as info:
        await clients.files("prod", "etcd")
    assert info.value.reason == SECRET_INVALID
    assert list(clients.root.iterdir()) == []


async def test_no_permission_to_read_secrets(clients: EtcdClients, secrets: FakeSecrets) -> None:
    secrets.error = ApiException(status=403, reason="Forbidden")
    with pytest.raises(EtcdSecretProblem) as info:
        await clients.files("prod", "etcd")
    assert info.value.reason == SECRET_FORBIDDEN
    assert "get on secrets" in info.value.message


async def test_other_api_errors_are_not_secret_problems(
    clients: EtcdClients, secrets: FakeSecrets
) -> None:
    secrets.error = ApiException(status=500, reason="Internal Server Error")
    with pytest.raises(ApiException):
        await clients.files("prod", "etcd")


async def test_close_removes_every_file(clients: EtcdClients, secrets: FakeSecrets) -> None:
    secrets.secrets["prod", "etcd"] = SecretData("7", tls_data())
    await clients.files("prod", "etcd")
    clients.close()
    assert not clients.root.exists()


def test_the_default_directory_is_private_and_temporary(secrets: FakeSecrets) -> None:
    clients = EtcdClients(secrets)
    try:
        assert file_mode(clients.root) == 0o700
        assert clients.root.name.startswith("shoal-operator-etcd-")
    finally:
        clients.close()
    assert not clients.root.exists()


def test_a_secrets_version_follows_its_data_only() -> None:
    """Labels and annotations change a Secret's resourceVersion, not its data: the version
    that rolls pods is a digest of the data, so only new data rolls them."""
    data = {"ca.crt": "Q0E=", "tls.crt": "Q1JU", "tls.key": "S0VZ"}
    assert data_version(data) == data_version(dict(reversed(list(data.items()))))
    assert data_version(data) != data_version({**data, "tls.key": "S0VZMg=="})
    assert data_version(data) != data_version({**data, "username": "dTE="})
    # Where a key ends and its value begins is part of it.
    assert data_version({"a": "bc"}) != data_version({"ab": "c"})
    assert data_version({}) != data_version({"": ""})
