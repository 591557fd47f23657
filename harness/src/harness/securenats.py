"""A nats-server that requires TLS with client certificates and passwords, for the
operator's tests (the group Secrets the operator reads, refusals it reports).

A small stand-in for the member side's harness.natssecurity (same idea: a CA and
certificates from harness.localkube.pki, a generated config file); whichever lands, the
other can go. The server is a harness.servers.NatsServer given ``-c <config>``: its
command-line flags (ports, JetStream store) and the file's ``tls`` (``verify: true``) and
``authorization`` blocks together. Clients reach it at ``tls://127.0.0.1:<port>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.localkube.pki import Pki, ensure_pki, ensure_serving_cert
from harness.servers import NatsServer

__all__ = ["SecureNats", "secure_nats_server"]

CLIENT = "nats-client"


@dataclass(frozen=True)
class SecureNats:
    """What a client needs: the CA, a client certificate, and the users' passwords."""

    server: NatsServer
    pki: Pki
    passwords: Mapping[str, str]

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.server.port}"

    def tls_files(self) -> dict[str, Path]:
        """The keys of a spec.nats.tlsSecret -> files."""
        cert, key = self.pki.client(CLIENT)
        return {"ca.crt": self.pki.ca_cert, "tls.crt": cert, "tls.key": key}


def _user(name: str, password: str, permissions: Mapping[str, object] | None) -> str:
    entry: dict[str, object] = {"user": name, "password": password}
    if permissions is not None:
        entry["permissions"] = dict(permissions)
    return json.dumps(entry)


def secure_nats_server(
    workdir: Path,
    passwords: Mapping[str, str],
    permissions: Mapping[str, Mapping[str, object]] | None = None,
) -> SecureNats:
    """A (not yet started) nats-server with TLS verify and these users (name ->
    password; `permissions`: name -> a NATS permissions block, e.g. {"publish":
    {"allow": [...]}, "subscribe": {"allow": [...]}}; absent: everything)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pki = ensure_pki(workdir / "pki", {CLIENT: "shoal-nats-client"})
    cert, key = ensure_serving_cert(pki, "nats-server")
    users = ",\n    ".join(
        _user(name, password, (permissions or {}).get(name)) for name, password in passwords.items()
    )
    config = workdir / "secure.conf"
    config.write_text(
        "tls {\n"
        f"  cert_file: {json.dumps(str(cert))}\n"
        f"  key_file: {json.dumps(str(key))}\n"
        f"  ca_file: {json.dumps(str(pki.ca_cert))}\n"
        "  verify: true\n"
        "  timeout: 2\n"
        "}\n"
        f"authorization {{\n  users = [\n    {users}\n  ]\n}}\n"
    )
    server = NatsServer(workdir / "nats", extra_args=["-c", str(config)])
    return SecureNats(server, pki, dict(passwords))
