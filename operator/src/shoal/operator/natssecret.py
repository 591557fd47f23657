"""The operator's NATS connections, with a group's spec.nats Secrets when it names them.

The consumer pods get the Secrets from the kubelet (builders mount them, and pass a user
and password as env from the Secret). The operator, one process for many groups, never
uses those paths: it reads the Secrets through the API (RBAC: `get` on secrets), as it
does for etcd (shoal.operator.etcdsecret), checks them, and writes the files nats-py
needs (the CA, the client certificate and key, a credentials file, an nkey seed) into a
private directory of its own: 0700 directories, 0600 files, created exclusively. A user
and password stay in memory.

What a group does not name, the operator's own settings give (its chart values: a Secret
mounted into the operator's pod, NATS_* env). Where both exist, the operator's identity
wins: its own credentials and client certificate, when it has them, are used instead of
the group's (with least privilege, the members' user may not manage streams; the
operator's may), and the group's Secret then only serves its pods (still read and
checked, so a broken one is reported before pods roll onto it). The group's CA is used
to trust the server either way.

Files are cached by the Secrets' versions (digests of their data, as for etcd) and
connections by (url, the versions used): the Secrets are read on every use (one GET
each), and only a new version is written out again; the connections and files of a
version that is replaced are closed and removed then, everything else when the operator
stops.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import binascii
import dataclasses
import logging
import shutil
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes.client.rest import ApiException

from shoal.clients.nats import NatsHealth
from shoal.clients.natsauth import NatsSecurity, redacted, refusal
from shoal.contracts.spec import NatsSpec
from shoal.operator.builders import (
    NATS_CA_KEY,
    NATS_CERT_KEY,
    NATS_CREDS_KEY,
    NATS_KEY_KEY,
    NATS_NKEY_KEY,
    NATS_PASSWORD_KEY,
    NATS_USER_KEY,
    CredentialsForm,
    NatsPodSecrets,
)
from shoal.operator.etcdsecret import SecretReader, write_private
from shoal.operator.sharing import Sharers

log = logging.getLogger(__name__)

# Degraded reasons. A Secret that is missing or cannot be used is one reason: the message
# says which Secret and which key.
SECRET_MISSING = "NatsSecretMissing"
SECRET_FORBIDDEN = "NatsSecretForbidden"

TLS_FIELD = "spec.nats.tlsSecret"
CREDENTIALS_FIELD = "spec.nats.credentialsSecret"


class NatsSecretProblem(Exception):
    """A group's NATS Secret cannot be used, or NATS refused what it holds: a reason
    (NatsSecretMissing, NatsSecretForbidden, NatsAuthFailed, NatsTLSFailed) and a message
    that names the Secret."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _missing(message: str) -> NatsSecretProblem:
    return NatsSecretProblem(SECRET_MISSING, message)


def _where(namespace: str, name: str, spec_field: str) -> str:
    return f"Secret {namespace}/{name} ({spec_field})"


def _decode(where: str, data: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, bytes]:
    decoded: dict[str, bytes] = {}
    for key in keys:
        if data.get(key):
            try:
                decoded[key] = base64.b64decode(data[key], validate=True)
            except (binascii.Error, ValueError):
                raise NatsSecretProblem(SECRET_MISSING, f"{where}: {key} is not base64") from None
    return decoded


def _pem(value: bytes, marker: bytes) -> bool:
    return b"-----BEGIN " in value and marker in value


def decode_tls(namespace: str, name: str, data: Mapping[str, str]) -> dict[str, bytes]:
    """ca.crt, and tls.crt with tls.key if present: decoded and checked (PEM)."""
    where = _where(namespace, name, TLS_FIELD)
    decoded = _decode(where, data, (NATS_CA_KEY, NATS_CERT_KEY, NATS_KEY_KEY))
    if NATS_CA_KEY not in decoded:
        raise _missing(
            f"{where} has no {NATS_CA_KEY}: it needs ca.crt (the NATS servers' CA, PEM), "
            "and tls.crt with tls.key for a client certificate"
        )
    if (NATS_CERT_KEY in decoded) != (NATS_KEY_KEY in decoded):
        lacking = NATS_KEY_KEY if NATS_CERT_KEY in decoded else NATS_CERT_KEY
        raise _missing(
            f"{where} has no {lacking}: tls.crt and tls.key go together (set both or neither)"
        )
    for key, marker, what in (
        (NATS_CA_KEY, b"CERTIFICATE-----", "a PEM certificate"),
        (NATS_CERT_KEY, b"CERTIFICATE-----", "a PEM certificate"),
        (NATS_KEY_KEY, b"PRIVATE KEY-----", "a PEM private key"),
    ):
        if key in decoded and not _pem(decoded[key], marker):
            raise _missing(f"{where}: {key} is not {what}")
    return decoded


def decode_credentials(
    namespace: str, name: str, data: Mapping[str, str]
) -> tuple[CredentialsForm, dict[str, bytes]]:
    """Which form the Secret holds (creds, user and password, or nkey), decoded and
    checked; exactly one form."""
    where = _where(namespace, name, CREDENTIALS_FIELD)
    keys = (NATS_CREDS_KEY, NATS_USER_KEY, NATS_PASSWORD_KEY, NATS_NKEY_KEY)
    decoded = _decode(where, data, keys)
    forms: list[CredentialsForm] = []
    if NATS_CREDS_KEY in decoded:
        forms.append("creds")
    if NATS_USER_KEY in decoded or NATS_PASSWORD_KEY in decoded:
        forms.append("user")
    if NATS_NKEY_KEY in decoded:
        forms.append("nkey")
    if len(forms) != 1:
        found = "none of them" if not forms else "more than one"
        raise _missing(
            f"{where} needs one of: key creds (a NATS credentials file), keys user and "
            f"password, or key nkey (an nkey seed); it has {found}"
        )
    form = forms[0]
    if form == "user":
        for key in (NATS_USER_KEY, NATS_PASSWORD_KEY):
            if key not in decoded:
                raise _missing(f"{where} has no {key}: user and password go together")
            try:
                decoded[key].decode()
            except UnicodeDecodeError:
                raise _missing(f"{where}: {key} is not UTF-8") from None
    elif form == "creds" and b"NATS USER JWT" not in decoded[NATS_CREDS_KEY]:
        raise _missing(f"{where}: creds is not a NATS credentials file (no user JWT)")
    elif form == "nkey" and not decoded[NATS_NKEY_KEY].strip().startswith(b"SU"):
        raise _missing(f"{where}: nkey is not an nkey user seed (SU...)")
    return form, decoded


@dataclass(frozen=True)
class TlsFiles:
    """One version of a group's tlsSecret, written out."""

    version: str
    directory: Path
    client_certificate: bool

    def apply(self, security: NatsSecurity) -> NatsSecurity:
        cert = str(self.directory / NATS_CERT_KEY) if self.client_certificate else None
        key = str(self.directory / NATS_KEY_KEY) if self.client_certificate else None
        return dataclasses.replace(
            security, ca_file=str(self.directory / NATS_CA_KEY), cert_file=cert, key_file=key
        )


@dataclass(frozen=True)
class CredentialFiles:
    """One version of a group's credentialsSecret: a file written out, or a user and
    password kept in memory."""

    version: str
    directory: Path
    form: CredentialsForm
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def apply(self, security: NatsSecurity) -> NatsSecurity:
        creds = str(self.directory / NATS_CREDS_KEY) if self.form == "creds" else None
        nkey = str(self.directory / NATS_NKEY_KEY) if self.form == "nkey" else None
        return dataclasses.replace(
            security,
            creds_file=creds,
            nkey_seed_file=nkey,
            user=self.user,
            password=self.password,
        )


@dataclass(frozen=True)
class GroupNats:
    """How the operator connects for one group, and what the group's pods get."""

    security: NatsSecurity
    pods: NatsPodSecrets
    # The Secrets' (namespace, name, version) it was made from: the connection cache's key.
    versions: tuple[tuple[str, str, str], ...] = ()
    tls_secret: str = ""
    credentials_secret: str = ""

    def describe(self, namespace: str, reason: str) -> str:
        """Whose settings NATS refused, for the Degraded message."""
        if reason == "NatsTLSFailed" and self.tls_secret:
            return _where(namespace, self.tls_secret, TLS_FIELD)
        if reason == "NatsAuthFailed" and self.credentials_secret:
            return _where(namespace, self.credentials_secret, CREDENTIALS_FIELD)
        what = "TLS settings" if reason == "NatsTLSFailed" else "credentials"
        return f"the operator's own NATS {what}"


Connector = Callable[..., Awaitable[Any]]
SecretKey = tuple[str, str]  # namespace, name
# A kept connection's key: its URL and the (namespace, name, version) of the Secrets used.
ConnectionKey = tuple[str, tuple[tuple[str, str, str], ...]]
_Files = TypeVar("_Files", TlsFiles, CredentialFiles)


def _still_good(secret: Any, cached: _Files | None, stale_ok: bool, where: str) -> _Files | None:
    """The cached files, if they serve for `secret` (None: the Secret is gone): they are its
    version, or it is gone and the caller makes do (`stale_ok`: e.g. for a deletion). None:
    write its version. One place for tls_files and credential_files, so they agree."""
    if secret is None:
        if stale_ok and cached is not None:
            return cached
        raise _missing(f"{where} not found")
    if cached is not None and cached.version == secret.version:
        return cached
    return None


class NatsClients:
    """The operator's NATS connections: by URL, and by the group's Secrets' versions."""

    def __init__(
        self, secrets: SecretReader, default: NatsSecurity, root: Path | None = None
    ) -> None:
        self.secrets = secrets
        self.default = default
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="shoal-operator-nats-"))  # 0700
            atexit.register(shutil.rmtree, root, ignore_errors=True)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)
        self.root = root
        self._tls: dict[SecretKey, TlsFiles] = {}
        self._credentials: dict[SecretKey, CredentialFiles] = {}
        self._connections: dict[ConnectionKey, Any] = {}
        # Each kept connection's NatsHealth, which replaces it should it die without a
        # word (nats-py alone keeps such a connection for 4 minutes and more, and every
        # group on it would be NatsUnavailable meanwhile).
        self._watches: dict[ConnectionKey, asyncio.Task[None]] = {}
        self._sharers: Sharers[ConnectionKey] = Sharers()
        self._locks: dict[object, asyncio.Lock] = {}

    def __len__(self) -> int:
        """How many connections are open (kept)."""
        return len(self._connections)

    def _lock(self, key: object) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _read(self, namespace: str, name: str, spec_field: str) -> Any:
        where = _where(namespace, name, spec_field)
        try:
            return await self.secrets.read_secret(namespace, name)
        except ApiException as exc:
            if exc.status == 403:
                raise NatsSecretProblem(
                    SECRET_FORBIDDEN,
                    f"the operator may not read {where}: it needs RBAC get on secrets "
                    "in this namespace",
                ) from None
            raise

    async def tls_files(self, namespace: str, name: str, *, stale_ok: bool = False) -> TlsFiles:
        """The tlsSecret's current version, written out (checked, cached by version)."""
        key = (namespace, name)
        secret = await self._read(namespace, name, TLS_FIELD)
        async with self._lock(("tls", key)):
            cached = self._tls.get(key)
            still = _still_good(secret, cached, stale_ok, _where(namespace, name, TLS_FIELD))
            if still is not None:
                return still
            decoded = decode_tls(namespace, name, secret.data)
            directory = self._directory(namespace, name)
            for file_key, content in decoded.items():
                write_private(directory / file_key, content)
            files = TlsFiles(secret.version, directory, NATS_CERT_KEY in decoded)
            try:
                # Loaded once here, so that a certificate that is not the key's, or not a
                # certificate at all, names the Secret instead of failing every connect.
                files.apply(NatsSecurity()).ssl_context()
            except (ssl.SSLError, ValueError) as exc:
                shutil.rmtree(directory, ignore_errors=True)
                where = _where(namespace, name, TLS_FIELD)
                raise _missing(f"{where}: its certificates cannot be used: {exc}") from None
            self._tls[key] = files
            if cached is not None:
                await self._forget(key, cached.version, cached.directory)
            log.info("Using %s version %s", _where(namespace, name, TLS_FIELD), files.version)
            return files

    async def credential_files(
        self, namespace: str, name: str, *, stale_ok: bool = False
    ) -> CredentialFiles:
        """The credentialsSecret's current version (checked, cached by version)."""
        key = (namespace, name)
        secret = await self._read(namespace, name, CREDENTIALS_FIELD)
        async with self._lock(("credentials", key)):
            cached = self._credentials.get(key)
            where = _where(namespace, name, CREDENTIALS_FIELD)
            still = _still_good(secret, cached, stale_ok, where)
            if still is not None:
                return still
            form, decoded = decode_credentials(namespace, name, secret.data)
            directory = self._directory(namespace, name)
            if form == "creds":
                write_private(directory / NATS_CREDS_KEY, decoded[NATS_CREDS_KEY])
            elif form == "nkey":
                write_private(directory / NATS_NKEY_KEY, decoded[NATS_NKEY_KEY])
            user, password = decoded.get(NATS_USER_KEY), decoded.get(NATS_PASSWORD_KEY)
            files = CredentialFiles(
                secret.version,
                directory,
                form,
                user.decode() if user else None,
                password.decode() if password else None,
            )
            self._credentials[key] = files
            if cached is not None:
                await self._forget(key, cached.version, cached.directory)
            log.info("Using %s version %s (%s)", where, files.version, form)
            return files

    def _directory(self, namespace: str, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{namespace}.{name}.", dir=self.root))

    async def group(self, namespace: str, spec: NatsSpec, *, stale_ok: bool = False) -> GroupNats:
        """The group's Secrets, read and checked (NatsSecretProblem if they cannot be
        used), over the operator's own settings."""
        security = self.default
        pods = NatsPodSecrets()
        versions: list[tuple[str, str, str]] = []
        own = self.default
        own_credentials = bool(own.creds_file or own.user or own.nkey_seed_file)
        used_credentials = ""
        if spec.tls_secret:
            tls = await self.tls_files(namespace, spec.tls_secret, stale_ok=stale_ok)
            security = tls.apply(security)
            if own.cert_file:
                # Our own client certificate is our identity; the group's CA still says
                # which server to trust.
                security = dataclasses.replace(
                    security, cert_file=own.cert_file, key_file=own.key_file
                )
            pods = dataclasses.replace(
                pods, client_certificate=tls.client_certificate, tls_version=tls.version
            )
            versions.append((namespace, spec.tls_secret, tls.version))
        if spec.credentials_secret:
            creds = await self.credential_files(
                namespace, spec.credentials_secret, stale_ok=stale_ok
            )
            if not own_credentials:
                security = creds.apply(security)
                used_credentials = spec.credentials_secret
            pods = dataclasses.replace(
                pods, credentials=creds.form, credentials_version=creds.version
            )
            versions.append((namespace, spec.credentials_secret, creds.version))
        return GroupNats(security, pods, tuple(versions), spec.tls_secret, used_credentials)

    def known(self, namespace: str, spec: NatsSpec) -> NatsPodSecrets | None:
        """What `group` last found for these Secrets, without reading them (None: not
        read yet)."""
        pods = NatsPodSecrets()
        if spec.tls_secret:
            tls = self._tls.get((namespace, spec.tls_secret))
            if tls is None:
                return None
            pods = dataclasses.replace(
                pods, client_certificate=tls.client_certificate, tls_version=tls.version
            )
        if spec.credentials_secret:
            creds = self._credentials.get((namespace, spec.credentials_secret))
            if creds is None:
                return None
            pods = dataclasses.replace(
                pods, credentials=creds.form, credentials_version=creds.version
            )
        return pods

    async def get(
        self,
        url: str,
        namespace: str,
        spec: NatsSpec,
        *,
        connect: Connector,
        attempts: int,
        stale_ok: bool = False,
        user: int | None = None,
    ) -> Any:
        """A connection for the group (cached). NatsSecretProblem if its Secrets cannot be
        used or NATS refuses them (NatsAuthFailed, NatsTLSFailed); what `connect` raises
        when NATS is out of reach. `user`: the group's token (shoal.operator.sharing); a
        connection it no longer uses, and nobody else does, is closed."""
        group = await self.group(namespace, spec, stale_ok=stale_ok)
        key = (url, group.versions)
        try:
            return await self._get(key, url, namespace, group, connect, attempts, user)
        finally:
            if user is not None:
                await self._close_unused(self._sharers.use(key, user))

    async def release(self, user: int) -> None:
        """The group is gone: close what only it used."""
        await self._close_unused(self._sharers.release(user))

    async def _close_unused(self, keys: list[ConnectionKey]) -> None:
        for key in keys:
            async with self._lock(key):
                if self._sharers.used(key):
                    continue  # another group took it up meanwhile
                nc = self._drop(key)
            if nc is not None:
                log.info("Closing the NATS connection to %s: no group uses it any more", key[0])
                await _close(nc)

    async def _get(
        self,
        key: ConnectionKey,
        url: str,
        namespace: str,
        group: Any,
        connect: Connector,
        attempts: int,
        user: int | None,
    ) -> Any:
        async with self._lock(key):
            if user is not None:
                self._sharers.add(key, user)  # before another group's leaving can close it
            nc = self._connections.get(key)
            if nc is not None and not nc.is_closed:
                return nc
            try:
                nc = await connect(
                    url, name="shoal-operator", attempts=attempts, security=group.security
                )
            except Exception as exc:
                # A connect that already diagnosed it carries the refusal (`why`).
                refused = getattr(exc, "why", None) or refusal(exc)
                if refused is None:
                    raise
                raise NatsSecretProblem(
                    refused.reason,
                    f"NATS at {redacted(url)} with {group.describe(namespace, refused.reason)}: "
                    f"{refused.message}",
                ) from exc
            self._keep(key, nc)
            return nc

    def _keep(self, key: ConnectionKey, nc: Any) -> None:
        self._drop(key)  # a closed connection's, if any
        self._connections[key] = nc
        health = NatsHealth(
            nc, interval=2.0, grace=6.0, unreachable_means=f"the operator's connection to {key[0]}"
        )
        self._watches[key] = asyncio.create_task(health.run(), name=f"nats-health {key[0]}")

    def _drop(self, key: ConnectionKey) -> Any:
        """Forget the connection of `key` (the caller closes it); None if there is none."""
        watch = self._watches.pop(key, None)
        if watch is not None:
            watch.cancel()
        return self._connections.pop(key, None)

    async def _forget(self, key: SecretKey, version: str, directory: Path) -> None:
        """Close the connections a replaced version served and remove its files."""
        gone = (*key, version)
        for conn_key, nc in list(self._connections.items()):
            if gone in conn_key[1]:
                self._drop(conn_key)
                await _close(nc)
        shutil.rmtree(directory, ignore_errors=True)

    async def close(self) -> None:
        watches = list(self._watches.values())
        for key, nc in list(self._connections.items()):
            self._drop(key)
            await _close(nc)
        await asyncio.gather(*watches, return_exceptions=True)  # (cancelled by _drop)
        self._tls.clear()
        self._credentials.clear()
        shutil.rmtree(self.root, ignore_errors=True)


async def _close(nc: Any) -> None:
    try:
        await nc.close()
    except Exception as exc:  # a best effort: it is dropped either way
        log.debug("Closing a NATS connection: %r", exc)
