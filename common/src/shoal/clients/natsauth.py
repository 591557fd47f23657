"""How a member, the operator and the CLI present themselves to NATS: TLS and credentials.

One place turns the settings (a private CA, a client certificate and key, a credentials
file, a user and password, an nkey seed) into nats-py's connect options, checks them
before the first attempt so a missing file is one clear line, and turns a refused
connection into a reason a person can act on (``NatsAuthFailed``, ``NatsTLSFailed``)
instead of a traceback.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from nats import errors as nats_errors


class NatsConfigError(ValueError):
    """Settings that cannot make a NATS connection (one line, for logs and statuses)."""


@dataclass(frozen=True)
class NatsSecurity:
    """TLS and credentials for one NATS connection. All empty: plain and anonymous."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    creds_file: str | None = None
    user: str | None = None
    password: str | None = None
    nkey_seed_file: str | None = None
    # Replies come to <inbox_prefix>.>: a prefix of the group's own lets a server allow
    # each group only its own replies (shoal.consumer.permissions). nats-py's: _INBOX.
    inbox_prefix: str | None = None

    def __repr__(self) -> str:  # never a password in a log line
        shown = {k: v for k, v in self.__dict__.items() if v and k != "password"}
        if self.password:
            shown["password"] = "***"
        return f"NatsSecurity({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def uses_tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def check(self) -> None:
        """Raise NatsConfigError (one line) unless these settings can make a connection."""
        if bool(self.cert_file) != bool(self.key_file):
            raise NatsConfigError(
                "NATS client certificate and key go together: set both files or neither"
            )
        if bool(self.user) != bool(self.password):
            raise NatsConfigError("NATS user and password go together: set both or neither")
        ways = [w for w in (self.creds_file, self.user, self.nkey_seed_file) if w]
        if len(ways) > 1:
            raise NatsConfigError(
                "NATS credentials: set one of a credentials file, a user and password, "
                "or an nkey seed file"
            )
        for what, path in (
            ("CA", self.ca_file),
            ("client certificate", self.cert_file),
            ("key", self.key_file),
            ("credentials", self.creds_file),
            ("nkey seed", self.nkey_seed_file),
        ):
            if path:
                _check_readable(what, path)
        prefix = self.inbox_prefix
        if prefix is not None and (
            not prefix or any(c in prefix for c in " \t*>") or "" in prefix.split(".")
        ):
            raise NatsConfigError(
                f"NATS inbox prefix {prefix!r} is not a subject without wildcards"
            )
        try:
            self.ssl_context()
        except (ssl.SSLError, ValueError) as exc:  # e.g. a key that is not the cert's
            raise NatsConfigError(f"NATS TLS files cannot be used: {exc}") from None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A context that trusts `ca_file` (else the system's) and presents the client
        certificate; None without TLS files (a tls:// URL then uses nats-py's default)."""
        if not self.uses_tls:
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file and self.key_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` / ``Client.connect``."""
        options: dict[str, Any] = {}
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.user and self.password:
            options["user"] = self.user
            options["password"] = self.password
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.inbox_prefix:
            options["inbox_prefix"] = self.inbox_prefix
        return options


_USERINFO = re.compile(r"://[^/@,\s]*@")


def redacted(url: str) -> str:
    """`url` (or a comma list of them) fit for a log line, an error or a status: the
    user-info part nats-py accepts (nats://user:password@host, nats://token@host) as
    ***. The documented way is NATS_USER and NATS_PASSWORD; a URL that carries them
    anyway must not spread them."""
    return _USERINFO.sub("://***@", url)


def _check_readable(what: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise NatsConfigError(
            f"NATS {what} file {path} is not readable: {exc.strerror or exc}"
        ) from None


class TLSNotOffered(ConnectionError):
    """TLS is configured (a CA, a client certificate, a tls:// URL) and the server's
    INFO does not ask for it: nats-py would send CONNECT, credentials included, in the
    clear (it upgrades only when the server says tls_required). natsclient.TLSClient
    raises it before anything is written."""


@dataclass(frozen=True)
class NatsRefusal:
    """Why a connection was refused, when retrying cannot help until someone acts."""

    reason: str  # NatsAuthFailed | NatsTLSFailed
    message: str

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class NatsRefused(ConnectionError):
    """A one-shot connect (CLI, operator) the server refused; str() is one line."""

    def __init__(self, why: NatsRefusal) -> None:
        super().__init__(str(why))
        self.why = why


class NatsClosed(ConnectionError):
    """nats-py closed a connection for good: it does not reconnect when the server drops
    a connected client's login (a password rotated, a user removed), it closes."""


# What nats-server's TLS alerts mean for the client (OpenSSL's reason codes). The server
# checks the client certificate after the client considers a TLS 1.3 handshake done, so
# these arrive only from a read on the connection (see diagnose_tls).
_ALERTS = {
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the NATS server refused the client certificate: "
    "it has expired (NATS_CERT_FILE)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the NATS server requires a client certificate "
    "(NATS_CERT_FILE, NATS_KEY_FILE)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the NATS server refused the client certificate "
    "(not signed by a CA it trusts?)",
    "TLSV1_ALERT_UNKNOWN_CA": "the NATS server does not know the client certificate's CA",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "the NATS server refused the client certificate: "
    "it was revoked",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the NATS server refused the client certificate",
}


def refusal(exc: BaseException | None) -> NatsRefusal | None:
    """What a failed connect means for a person, or None for an unreachable server
    (retried quietly with backoff). Follows __cause__/__context__ down to the root.

    What nats-py 2.16 raises against nats-server 2.12 (tests/test_nats_security.py):
    a wrong user or password, a missing one: ``nats.errors.Error("nats: 'Authorization
    Violation'")`` (not its AuthorizationError); a server certificate from another CA:
    ``ssl.SSLCertVerificationError``; a missing or expired client certificate:
    ``ConnectionResetError('Connection lost')`` under TLS 1.3 (an ``ssl.SSLError`` with
    the server's alert under TLS 1.2), which only `diagnose_tls` can tell apart.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, nats_errors.AuthorizationError) or "authorization violation" in (
            str(cause).lower()
        ):
            return NatsRefusal(
                "NatsAuthFailed",
                "NATS refused the credentials (Authorization Violation): wrong user or "
                "password, credentials file or nkey",
            )
        if isinstance(cause, TLSNotOffered):
            return NatsRefusal("NatsTLSFailed", str(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            detail = cause.verify_message or str(cause)
            return NatsRefusal(
                "NatsTLSFailed",
                f"the NATS server's certificate was not accepted: {detail} (NATS_CA_FILE)",
            )
        if isinstance(cause, ssl.SSLError):
            code = getattr(cause, "reason", None) or ""
            detail = _ALERTS.get(code) or f"TLS with the NATS server failed: {code or cause}"
            return NatsRefusal("NatsTLSFailed", detail)
        cause = cause.__cause__ or cause.__context__
    return None


def maybe_tls_refusal(exc: BaseException, url: str, security: NatsSecurity) -> bool:
    """Whether `exc` may be a TLS refusal of the client certificate in disguise: the
    server hung up right after a TLS handshake (nothing else resets a fresh connection
    to a live server). nats-py says "Connection lost", or, when its CONNECT was still
    being written, BrokenPipeError."""
    return _tls_url(url, security) and isinstance(
        exc,
        ConnectionResetError
        | BrokenPipeError
        | ConnectionAbortedError
        | ssl.SSLEOFError
        | EOFError
        | nats_errors.UnexpectedEOF,
    )


def _tls_url(url: str, security: NatsSecurity) -> bool:
    return security.uses_tls or url.startswith("tls://")


async def diagnose_tls(
    url: str, security: NatsSecurity, timeout: float = 2.0
) -> NatsRefusal | None:
    """Repeat the start of a NATS TLS connection by hand to read the server's alert.

    nats-py reports a refused client certificate as "Connection lost"; a plain socket
    that reads after the handshake gets the alert itself (certificate required, expired,
    unknown CA). None if the server accepts the handshake (or cannot be reached).
    """
    first = url.split(",")[0]
    parsed = urlsplit(first if "://" in first else f"nats://{first}")
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    context = security.ssl_context() or ssl.create_default_context()

    def probe() -> BaseException | None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as raw:
                raw.recv(4096)  # the server's INFO, in the clear
                with context.wrap_socket(raw, server_hostname=host) as tls:
                    tls.sendall(b"CONNECT {}\r\nPING\r\n")
                    tls.recv(4096)
        except (ssl.SSLError, OSError) as exc:
            return exc
        return None

    found = await asyncio.to_thread(probe)
    return refusal(found) if isinstance(found, ssl.SSLError) else None
