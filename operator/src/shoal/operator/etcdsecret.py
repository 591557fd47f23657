"""Each group's etcd connection, with its spec.etcd.tlsSecret when it has one.

The consumer pods get the Secret from the kubelet (builders mount it). The operator, one
process for many groups, reads it through the API (RBAC: `get` on secrets) and writes the
files the etcd client needs into a private directory of its own: the directory and each
version's subdirectory 0700, every file 0600, created exclusively. The username and
password stay in memory.

Files and connections are cached by the Secret's version (a digest of its data): the
Secret is read on every use (one GET), and only a new version is written out again; the
connections and files of the version it replaces are closed and removed then, everything
else when the operator stops. A Secret that is gone may still serve a group's deletion
from the cache, so deleting a namespace (which removes the Secret before the group's
finalizer runs) can still clear the group's etcd keys.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import binascii
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kubernetes.client.rest import ApiException

from shoal.clients.etcd import Etcd
from shoal.group.config import EtcdOptions
from shoal.operator.builders import ETCD_AUTH_KEYS, ETCD_CA_KEY, ETCD_CERT_KEY, ETCD_KEY_KEY
from shoal.operator.sharing import Sharers

log = logging.getLogger(__name__)

REQUIRED_KEYS = (ETCD_CA_KEY, ETCD_CERT_KEY, ETCD_KEY_KEY)
USERNAME_KEY, PASSWORD_KEY = ETCD_AUTH_KEYS["etcd_username"], ETCD_AUTH_KEYS["etcd_password"]

# Degraded reasons.
SECRET_MISSING = "EtcdSecretMissing"
SECRET_INVALID = "EtcdSecretInvalid"
SECRET_FORBIDDEN = "EtcdSecretForbidden"


class EtcdSecretProblem(Exception):
    """The group's etcd Secret cannot be used: a reason (CamelCase) and a message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class SecretData:
    """A Secret as the API returns it: its base64-encoded data, and a version of it that
    changes when the data does (data_version), not when only its metadata does."""

    version: str
    data: Mapping[str, str]


def data_version(data: Mapping[str, str]) -> str:
    """A Secret's data as a short digest. Not its resourceVersion: that moves with every
    label or annotation a tool adds (a Secret copied between namespaces, a certificate
    manager's bookkeeping), and each move would roll the group's pods one at a time,
    hand-overs included, for files that did not change."""
    digest = hashlib.sha256()
    for key in sorted(data):
        digest.update(f"{len(key)}:{key}={len(data[key])}:{data[key]};".encode())
    return digest.hexdigest()[:16]


class SecretReader(Protocol):
    async def read_secret(self, namespace: str, name: str) -> SecretData | None: ...


def _pem(value: bytes, marker: bytes) -> bool:
    return b"-----BEGIN " in value and marker in value


def decode_secret(namespace: str, name: str, data: Mapping[str, str]) -> dict[str, bytes]:
    """The keys we use, decoded and checked; EtcdSecretProblem (EtcdSecretInvalid) if not."""
    where = f"Secret {namespace}/{name} (spec.etcd.tlsSecret)"
    missing = [key for key in REQUIRED_KEYS if not data.get(key)]
    if missing:
        raise EtcdSecretProblem(
            SECRET_INVALID,
            f"{where} has no {', '.join(missing)}: it needs ca.crt, tls.crt and tls.key "
            "(PEM); username and password are optional",
        )
    decoded: dict[str, bytes] = {}
    for key in (*REQUIRED_KEYS, USERNAME_KEY, PASSWORD_KEY):
        if data.get(key):
            try:
                decoded[key] = base64.b64decode(data[key], validate=True)
            except (binascii.Error, ValueError):
                raise EtcdSecretProblem(SECRET_INVALID, f"{where}: {key} is not base64") from None
    for key, marker, what in (
        (ETCD_CA_KEY, b"CERTIFICATE-----", "a PEM certificate"),
        (ETCD_CERT_KEY, b"CERTIFICATE-----", "a PEM certificate"),
        (ETCD_KEY_KEY, b"PRIVATE KEY-----", "a PEM private key"),
    ):
        if not _pem(decoded[key], marker):
            raise EtcdSecretProblem(SECRET_INVALID, f"{where}: {key} is not {what}")
    if (USERNAME_KEY in decoded) != (PASSWORD_KEY in decoded):
        raise EtcdSecretProblem(
            SECRET_INVALID, f"{where}: username and password go together: set both or neither"
        )
    for key in (USERNAME_KEY, PASSWORD_KEY):
        if key in decoded:
            try:
                decoded[key].decode()
            except UnicodeDecodeError:
                raise EtcdSecretProblem(SECRET_INVALID, f"{where}: {key} is not UTF-8") from None
    return decoded


def write_private(path: Path, content: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SecretFiles:
    """One version of a Secret, written out."""

    version: str
    directory: Path
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def options(self) -> EtcdOptions:
        return EtcdOptions(
            ca_file=str(self.directory / ETCD_CA_KEY),
            cert_file=str(self.directory / ETCD_CERT_KEY),
            key_file=str(self.directory / ETCD_KEY_KEY),
            username=self.username,
            password=self.password,
        )


SecretKey = tuple[str, str]  # namespace, name


class EtcdClients:
    """The operator's etcd connections: plain ones by endpoints, TLS ones by Secret too."""

    def __init__(self, secrets: SecretReader, root: Path | None = None) -> None:
        self.secrets = secrets
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="shoal-operator-etcd-"))  # 0700
            atexit.register(shutil.rmtree, root, ignore_errors=True)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)
        self.root = root
        self._files: dict[SecretKey, SecretFiles] = {}
        self._plain: dict[str, Etcd] = {}
        self._sharers: Sharers[object] = Sharers()
        self._tls: dict[tuple[str, str, str], tuple[str, Etcd]] = {}
        self._locks: dict[object, asyncio.Lock] = {}

    def _lock(self, key: object) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def get(
        self,
        endpoints: str,
        namespace: str | None = None,
        secret: str | None = None,
        *,
        stale_ok: bool = False,
        user: int | None = None,
    ) -> Etcd:
        """A connected client (cached); EtcdSecretProblem if the Secret cannot be used.

        stale_ok: if the Secret is gone, use the last version this process saw. `user`:
        the group's token (shoal.operator.sharing); a client it no longer uses, and
        nobody else does, is closed.
        """
        key: object = endpoints if not secret else (endpoints, namespace or "default", secret)
        try:
            return await self._get(endpoints, namespace, secret, stale_ok, user)
        finally:
            if user is not None:
                await self._close_unused(self._sharers.use(key, user))

    async def release(self, user: int) -> None:
        """The group is gone: close what only it used."""
        await self._close_unused(self._sharers.release(user))

    async def _close_unused(self, keys: list[object]) -> None:
        for key in keys:
            async with self._lock(key):
                if self._sharers.used(key):
                    continue  # another group took it up meanwhile
                etcd: Etcd | None = None
                if isinstance(key, str):
                    etcd, endpoints = self._plain.pop(key, None), key
                elif isinstance(key, tuple):
                    kept = self._tls.pop(key, None)
                    etcd, endpoints = (kept[1] if kept else None), key[0]
            if etcd is not None:
                log.info("Closing the etcd client of %s: no group uses it any more", endpoints)
                etcd.close()

    async def _get(
        self,
        endpoints: str,
        namespace: str | None,
        secret: str | None,
        stale_ok: bool,
        user: int | None,
    ) -> Etcd:
        if not secret:
            async with self._lock(endpoints):
                if user is not None:
                    self._sharers.add(endpoints, user)
                if endpoints not in self._plain:
                    self._plain[endpoints] = await self._connect(endpoints, None)
                return self._plain[endpoints]
        ns = namespace or "default"
        files = await self.files(ns, secret, stale_ok=stale_ok)
        key = (endpoints, ns, secret)
        async with self._lock(key):
            if user is not None:
                self._sharers.add(key, user)
            cached = self._tls.get(key)
            if cached is not None and cached[0] == files.version:
                return cached[1]
            etcd = await self._connect(endpoints, files)
            self._tls[key] = (files.version, etcd)
            if cached is not None:
                cached[1].close()
            return etcd

    async def _connect(self, endpoints: str, files: SecretFiles | None) -> Etcd:
        etcd = Etcd(endpoints, **files.options()) if files else Etcd(endpoints)
        try:
            await etcd.connect(attempts=2)
        except BaseException:
            etcd.close()  # not cached: the next call tries again, with a new client
            raise
        return etcd

    async def files(self, namespace: str, name: str, *, stale_ok: bool = False) -> SecretFiles:
        """The Secret's current version, written out (checked, cached by version)."""
        where = f"Secret {namespace}/{name} (spec.etcd.tlsSecret)"
        key = (namespace, name)
        try:
            secret = await self.secrets.read_secret(namespace, name)
        except ApiException as exc:
            if exc.status == 403:
                raise EtcdSecretProblem(
                    SECRET_FORBIDDEN,
                    f"the operator may not read {where}: it needs RBAC get on secrets "
                    "in this namespace",
                ) from None
            raise
        async with self._lock(key):
            cached = self._files.get(key)
            if secret is None:
                if stale_ok and cached is not None:
                    log.info("%s is gone; using the version read before", where)
                    return cached
                raise EtcdSecretProblem(SECRET_MISSING, f"{where} not found")
            if cached is not None and cached.version == secret.version:
                return cached
            decoded = decode_secret(namespace, name, secret.data)
            directory = Path(tempfile.mkdtemp(prefix=f"{namespace}.{name}.", dir=self.root))
            for file_key in REQUIRED_KEYS:
                write_private(directory / file_key, decoded[file_key])
            username = decoded.get(USERNAME_KEY)
            password = decoded.get(PASSWORD_KEY)
            files = SecretFiles(
                secret.version,
                directory,
                username.decode() if username else None,
                password.decode() if password else None,
            )
            self._files[key] = files
            if cached is not None:
                self._forget(key, cached)
            log.info("Using %s version %s", where, secret.version)
            return files

    def known_version(self, namespace: str, name: str) -> str | None:
        """The version of the Secret last read (by `files` or `get`), without reading it."""
        files = self._files.get((namespace, name))
        return None if files is None else files.version

    def _forget(self, key: SecretKey, old: SecretFiles) -> None:
        """Close what the replaced version served and remove its files."""
        for tls_key, (version, etcd) in list(self._tls.items()):
            if tls_key[1:] == key and version == old.version:
                etcd.close()
                del self._tls[tls_key]
        shutil.rmtree(old.directory, ignore_errors=True)

    def close(self) -> None:
        for etcd in [*self._plain.values(), *(etcd for _, etcd in self._tls.values())]:
            etcd.close()
        self._plain.clear()
        self._tls.clear()
        self._files.clear()
        shutil.rmtree(self.root, ignore_errors=True)
