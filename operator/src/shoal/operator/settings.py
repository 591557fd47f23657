"""The operator's own configuration: what it fills in when a ConsumerGroup leaves it out.

The Helm chart sets these through the operator Deployment's environment; a
ConsumerGroup's spec always wins over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from shoal.clients.natsauth import NatsSecurity
from shoal.group.config import GroupConfig

_CONSUMER_DRAIN_TIMEOUT = int(GroupConfig.model_fields["drain_timeout"].default)

# Environment variable -> field. Empty values count as unset, as in the consumer's
# config_from_env, so a chart can render `value: ""` for "use the default".
ENV_FIELDS: dict[str, str] = {
    "SHOAL_OPERATOR_IMAGE": "default_image",
    "SHOAL_OPERATOR_IMAGE_PULL_POLICY": "image_pull_policy",
    "NATS_URL": "nats_url",
    "ETCD_ENDPOINTS": "etcd_endpoints",
    "SHOAL_DRAIN_TIMEOUT": "drain_timeout_seconds",
    "SHOAL_CONSUMER_METRICS_PORT": "consumer_metrics_port",
    "SHOAL_CONSUMER_HEALTH_PORT": "consumer_health_port",
    "SHOAL_DELETE_ETCD_TIMEOUT": "delete_etcd_timeout_seconds",
    "SHOAL_DELETE_NATS_TIMEOUT": "delete_nats_timeout_seconds",
    # The operator's own NATS TLS and credentials (the chart's nats.tlsSecret and
    # nats.credentialsSecret), for groups that name no Secrets of their own: the same
    # variables a member reads.
    "NATS_CA_FILE": "nats_ca_file",
    "NATS_CERT_FILE": "nats_cert_file",
    "NATS_KEY_FILE": "nats_key_file",
    "NATS_CREDS_FILE": "nats_creds_file",
    "NATS_USER": "nats_user",
    "NATS_PASSWORD": "nats_password",
    "NATS_NKEY_SEED_FILE": "nats_nkey_seed_file",
}


class OperatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # "shoal:dev" is what the local control plane runs (harness.localkube.kubelet).
    default_image: str = Field("shoal:dev", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    nats_url: str = Field("nats://nats:4222", min_length=1)
    etcd_endpoints: str = Field("etcd:2379", min_length=1)
    # Whole seconds: it also sizes terminationGracePeriodSeconds, an integer field. The
    # default is the consumer's own.
    drain_timeout_seconds: int = Field(_CONSUMER_DRAIN_TIMEOUT, ge=1)
    # The port consumer pods serve Prometheus /metrics on (a container port named
    # "metrics", which the chart's PodMonitor scrapes). None: no metrics server. 0: any
    # free port, for the local plane, where every pod shares the host's loopback (no
    # container port is declared then).
    consumer_metrics_port: int | None = Field(None, ge=0, le=65535)
    # The port consumer pods answer their probes on over HTTP (/readyz, /livez; a container
    # port named "health"): httpGet probes, which cost the member a few hundred
    # microseconds where `shoal-ready` execs a Python process (consumer/healthport.py).
    # None: exec probes, for the local plane, where pods share the host's loopback unless
    # it runs with --pod-network and two members could not both listen on one port.
    consumer_health_port: int | None = Field(None, ge=1, le=65535)
    # How long deleting a group retries an unreachable etcd (to clear the group's keys)
    # before its deletionPolicy decides: Retain leaves the keys and lets the group go,
    # Delete keeps waiting for etcd (and says so in status and Events).
    delete_etcd_timeout_seconds: float = Field(120.0, gt=0)
    # How long deleting a group with deletionPolicy Delete retries deleting its streams
    # (NATS unreachable or refusing) before it lets the group go and leaves them (a
    # StreamsKept Warning names them).
    delete_nats_timeout_seconds: float = Field(120.0, gt=0)
    # Empty: watch the whole cluster.
    watch_namespaces: list[str] = Field(default_factory=list)
    # The operator's own NATS TLS and credentials (files in its pod); unset: plain and
    # anonymous. A group's spec.nats.tlsSecret / credentialsSecret replace them for it.
    nats_ca_file: str | None = None
    nats_cert_file: str | None = None
    nats_key_file: str | None = None
    nats_creds_file: str | None = None
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_nkey_seed_file: str | None = None

    @model_validator(mode="after")
    def _ports_differ(self) -> OperatorSettings:
        # One number for both gives the consumer pods two container ports with one number;
        # each member binds its health server, then fails to bind its metrics server.
        port = self.consumer_metrics_port
        if port is not None and port == self.consumer_health_port:
            raise ValueError(
                f"consumer_metrics_port (SHOAL_CONSUMER_METRICS_PORT) and consumer_health_port"
                f" (SHOAL_CONSUMER_HEALTH_PORT) are both {port}: consumer pods serve /metrics and"
                " their probes on two different ports (the chart's consumerMetrics.port and"
                " consumerProbes.port)"
            )
        return self

    def nats_security(self) -> NatsSecurity:
        password = self.nats_password.get_secret_value() if self.nats_password else None
        return NatsSecurity(
            ca_file=self.nats_ca_file,
            cert_file=self.nats_cert_file,
            key_file=self.nats_key_file,
            creds_file=self.nats_creds_file,
            user=self.nats_user,
            password=password,
            nkey_seed_file=self.nats_nkey_seed_file,
        )


def parse_list(value: str) -> list[str]:
    """A comma list as people write it: blanks around items and empty items are ignored."""
    return [item.strip() for item in value.split(",") if item.strip()]


# Taken as they are, as a member takes them (group.config): a password is whatever
# the Secret holds, edge whitespace included. Stripped here only, the operator logged in
# where members with the same Secret were refused (a Secret made --from-file keeps the
# file's last newline).
VERBATIM = frozenset({"NATS_PASSWORD"})


def settings_from_env(env: Mapping[str, str]) -> OperatorSettings:
    values: dict[str, object] = {
        field: env[var] if var in VERBATIM else env[var].strip()
        for var, field in ENV_FIELDS.items()
        if env.get(var, "").strip()
    }
    if env.get("SHOAL_WATCH_NAMESPACES"):
        values["watch_namespaces"] = parse_list(env["SHOAL_WATCH_NAMESPACES"])
    return OperatorSettings.model_validate(values)
