"""How a member, the operator and the CLI present themselves to NATS: TLS and credentials.

One place turns the settings (a private CA, a client certificate and key, a credentials
file, a user and password, an nkey seed) into nats-py's connect options, checks them
before the first attempt so a missing file is one clear line, and turns a refused
connection into a reason a person can act on (``NatsAuthFailed``, ``NatsTLSFailed``)
instead of a traceback.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

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
        return options


def _check_readable(what: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise NatsConfigError(
            f"NATS {what} file {path} is not readable: {exc.strerror or exc}"
        ) from None


@dataclass(frozen=True)
class NatsRefusal:
    """Why a connection was refused, when retrying cannot help until someone acts."""

    reason: str  # NatsAuthFailed | NatsTLSFailed
    message: str


def refusal(exc: BaseException) -> NatsRefusal | None:
    """What a failed connect means for a person, or None for an unreachable server
    (retried quietly with backoff). Follows __cause__/__context__ down to the root."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, nats_errors.AuthorizationError) or "authorization violation" in (
            str(cause).lower()
        ):
            return NatsRefusal(
                "NatsAuthFailed", "NATS refused the credentials (authorization violation)"
            )
        if isinstance(cause, ssl.SSLCertVerificationError):
            detail = cause.verify_message or str(cause)
            return NatsRefusal(
                "NatsTLSFailed", f"the NATS server's certificate was not accepted: {detail}"
            )
        if isinstance(cause, ssl.SSLError):
            detail = getattr(cause, "reason", None) or str(cause)
            return NatsRefusal("NatsTLSFailed", f"TLS with the NATS server failed: {detail}")
        cause = cause.__cause__ or cause.__context__
    return None
