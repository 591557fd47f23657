"""A secured nats-server (harness.natssecurity) as the operator's tests use it: its
certificates as a spec.nats.tlsSecret's keys, its users' passwords by name.

    nats = secure_nats_server(tmp_path, [NatsUser("orders", "pw")])
    nats.server.start()       # tls { verify: true }, users with passwords
    nats.tls_files()          # {"ca.crt": ..., "tls.crt": ..., "tls.key": ...}
    nats.client("orders")     # NatsSecurity for the test's own connections as a user
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.natssecurity import NatsServerSecurity, NatsUser
from harness.servers import NatsServer
from shoal.clients.natsauth import NatsSecurity

__all__ = ["NatsUser", "SecureNats", "secure_nats_server"]


@dataclass(frozen=True)
class SecureNats:
    server: NatsServer
    security: NatsServerSecurity

    @property
    def url(self) -> str:
        return self.server.url  # tls://127.0.0.1:<port>

    def tls_files(self) -> dict[str, Path]:
        """The keys of a spec.nats.tlsSecret (or the chart's nats.tlsSecret) -> files."""
        return {
            "ca.crt": self.security.ca_file,
            "tls.crt": self.security.client_cert,
            "tls.key": self.security.client_key,
        }

    def password(self, user: str) -> str:
        return self.security.user(user).password

    def client(self, user: str) -> NatsSecurity:
        """A test's own client settings as `user` (these certificates, its password)."""
        return self.security.client(user)


def secure_nats_server(workdir: Path, users: Sequence[NatsUser]) -> SecureNats:
    """A (not yet started) nats-server that requires a client certificate from its own CA
    and one of `users` (with their subject permissions, if any)."""
    security = NatsServerSecurity.generate(workdir / "pki", users)
    return SecureNats(NatsServer(workdir / "nats", security=security), security)
