"""Kubernetes Secrets without a cluster, for the operator's Secret handling in unit tests
(tests/test_etcd_secret.py, tests/test_nats_secret.py).

    secrets = FakeSecrets()
    secrets.secrets["prod", "tls"] = SecretData("7", {"ca.crt": b64(ca_pem)})
    secrets.error = ApiException(status=403)   # every read raises it from now on
"""

from __future__ import annotations

import base64
import stat
from pathlib import Path

from kubernetes.client.rest import ApiException

from shoal.operator.etcdsecret import SecretData

__all__ = ["FakeSecrets", "b64", "file_mode"]


def b64(value: bytes | str) -> str:
    """A Secret's data value: base64 of the bytes (of the UTF-8 text)."""
    raw = value.encode() if isinstance(value, str) else value
    return base64.b64encode(raw).decode()


def file_mode(path: Path) -> int:
    """The permission bits of `path` (0o600, 0o700...)."""
    return stat.S_IMODE(path.stat().st_mode)


class FakeSecrets:
    """read_secret over a dict (namespace, name) -> SecretData; an ApiException to raise."""

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], SecretData] = {}
        self.error: ApiException | None = None
        self.reads = 0

    async def read_secret(self, namespace: str, name: str) -> SecretData | None:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.secrets.get((namespace, name))
