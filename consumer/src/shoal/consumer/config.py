"""The configuration of one consumer process: which group, which servers, which limits.

The operator passes it to pods through environment variables (SHOAL_*); the CLI maps
flags onto the same fields. Validation happens here, once, with messages a person can act on.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from shoal.consumer.partitioning import (
    DEFAULT_PARTITIONS,
    Keys,
    check_subject_prefix,
    check_token,
    default_stream_name,
    default_subject_prefix,
)


def default_member_id() -> str:
    # In a pod the operator sets POD_NAME through the downward API.
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


class EtcdOptions(TypedDict):
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    username: str | None
    password: str | None


class GroupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = "default"
    group: str
    partitions: int = Field(DEFAULT_PARTITIONS, ge=1, le=4096)
    member_id: str = Field(default_factory=default_member_id)

    nats_url: str = "nats://127.0.0.1:4222"
    etcd_endpoints: str = "127.0.0.1:2379"
    subject_prefix: str = ""
    stream: str = ""
    stream_replicas: int = Field(1, ge=1, le=5)
    retention: Literal["workqueue", "limits", "interest"] = "workqueue"
    storage: Literal["file", "memory"] = "file"
    ensure_jetstream: bool = True

    handler: str = "shoal.consumer.handlers:noop"
    ack_wait: float = Field(5.0, gt=0)
    max_ack_pending: int = Field(1000, ge=1)
    max_deliver: int = Field(5, ge=1)
    backoff: tuple[float, ...] = ()
    fetch_batch: int = Field(64, ge=1, le=1024)
    # A pull request lives at most this long; a released partition waits for it, so it
    # bounds the hand-over pause (DESIGN: p99 < 1 s for planned moves).
    fetch_expires: float = Field(0.3, gt=0.05, le=5)

    lease_ttl: int = Field(10, ge=2)
    keepalive_interval: float = Field(3.0, gt=0)
    # Stop consuming this long before the lease could expire on the server.
    fence_margin: float = Field(2.0, ge=0)
    debounce: float = Field(0.5, ge=0)
    drain_timeout: float = Field(30.0, gt=0)
    stats_interval: float = Field(5.0, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # Written once this member has joined its group, removed when it leaves: the pod's
    # readiness probe (`shoal-ready`) checks it.
    ready_file: str | None = None
    # A NATS credentials file (the operator mounts the group's credentials secret).
    nats_creds_file: str | None = None
    # etcd over TLS (CA, client certificate and key files: the operator mounts the group's
    # spec.etcd.tlsSecret) and etcd authentication. Files are checked when the etcd client
    # is made (shoal.consumer.etcd.check_security), not here: the operator builds this
    # config too, where the pods' paths do not exist.
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_username: str | None = None
    etcd_password: SecretStr | None = None
    # How the leader assigns partitions (ConsumerGroup spec.assignment): "sticky" moves
    # the fewest; "modulo" is the seed's p % n, kept as a baseline for comparison. With
    # load_aware, sticky also evens out the members' measured message rates.
    strategy: Literal["sticky", "modulo"] = "sticky"
    load_aware: bool = False
    # Load-aware: how often the leader weighs the measured loads between membership changes.
    load_check_interval: float = Field(60.0, gt=0)
    # "kubernetes": the leader autoscales the group through its ConsumerGroup's scale
    # subresource, with the pod's ServiceAccount (the operator sets this); "off": never.
    autoscaler: Literal["off", "kubernetes"] = "off"

    @field_validator("namespace", "group", "member_id")
    @classmethod
    def _token(cls, value: str) -> str:
        return check_token(value, "name")

    @field_validator("handler")
    @classmethod
    def _handler_spec(cls, value: str) -> str:
        module, sep, func = value.partition(":")
        if not sep or not module or not func:
            raise ValueError(f"handler {value!r} must look like 'package.module:function'")
        return value

    @model_validator(mode="after")
    def _derived(self) -> GroupConfig:
        if self.load_aware and self.strategy == "modulo":
            raise ValueError("load_aware needs strategy 'sticky' (modulo ignores loads)")
        if self.fence_margin >= self.lease_ttl:
            raise ValueError("fence_margin must be smaller than lease_ttl")
        if self.keepalive_interval >= self.lease_ttl - self.fence_margin:
            raise ValueError("keepalive_interval must be shorter than lease_ttl - fence_margin")
        if self.subject_prefix:
            check_subject_prefix(self.subject_prefix)
        else:
            object.__setattr__(
                self, "subject_prefix", default_subject_prefix(self.namespace, self.group)
            )
        if not self.stream:
            object.__setattr__(self, "stream", default_stream_name(self.namespace, self.group))
        return self

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace, self.group)

    @property
    def ledger_stream(self) -> str:
        return f"{self.stream}_ledger"

    @property
    def dlq_stream(self) -> str:
        return f"{self.stream}_dlq"

    def etcd_options(self) -> EtcdOptions:
        """TLS and credentials, as keyword arguments of shoal.consumer.etcd.Etcd."""
        password = self.etcd_password.get_secret_value() if self.etcd_password else None
        return EtcdOptions(
            ca_file=self.etcd_ca_file,
            cert_file=self.etcd_cert_file,
            key_file=self.etcd_key_file,
            username=self.etcd_username,
            password=password,
        )

    @property
    def fence_after(self) -> float:
        return self.lease_ttl - self.fence_margin


# Environment variable -> field. The operator writes these into the pod spec.
ENV_FIELDS: dict[str, str] = {
    "SHOAL_NAMESPACE": "namespace",
    "SHOAL_GROUP": "group",
    "SHOAL_PARTITIONS": "partitions",
    "SHOAL_MEMBER_ID": "member_id",
    "NATS_URL": "nats_url",
    "ETCD_ENDPOINTS": "etcd_endpoints",
    "SHOAL_SUBJECT_PREFIX": "subject_prefix",
    "SHOAL_STREAM": "stream",
    "SHOAL_STREAM_REPLICAS": "stream_replicas",
    "SHOAL_RETENTION": "retention",
    "SHOAL_STORAGE": "storage",
    "SHOAL_HANDLER": "handler",
    "SHOAL_ACK_WAIT": "ack_wait",
    "SHOAL_MAX_ACK_PENDING": "max_ack_pending",
    "SHOAL_MAX_DELIVER": "max_deliver",
    "SHOAL_LEASE_TTL": "lease_ttl",
    "SHOAL_KEEPALIVE_INTERVAL": "keepalive_interval",
    "SHOAL_METRICS_PORT": "metrics_port",
    "SHOAL_DRAIN_TIMEOUT": "drain_timeout",
    "SHOAL_STATS_INTERVAL": "stats_interval",
    "SHOAL_READY_FILE": "ready_file",
    "SHOAL_ENSURE_JETSTREAM": "ensure_jetstream",
    "NATS_CREDS_FILE": "nats_creds_file",
    "ETCD_CA_FILE": "etcd_ca_file",
    "ETCD_CERT_FILE": "etcd_cert_file",
    "ETCD_KEY_FILE": "etcd_key_file",
    "ETCD_USERNAME": "etcd_username",
    "ETCD_PASSWORD": "etcd_password",
    "SHOAL_AUTOSCALER": "autoscaler",
    "SHOAL_STRATEGY": "strategy",
    "SHOAL_LOAD_AWARE": "load_aware",
    "SHOAL_LOAD_CHECK_INTERVAL": "load_check_interval",
}


def etcd_options_from_env(env: Mapping[str, str]) -> EtcdOptions:
    """Only etcd's TLS and credentials, for commands that need no whole group config."""
    return EtcdOptions(
        ca_file=env.get("ETCD_CA_FILE") or None,
        cert_file=env.get("ETCD_CERT_FILE") or None,
        key_file=env.get("ETCD_KEY_FILE") or None,
        username=env.get("ETCD_USERNAME") or None,
        password=env.get("ETCD_PASSWORD") or None,
    )


def config_from_env(env: Mapping[str, str], **overrides: object) -> GroupConfig:
    """Build a config from environment variables, then explicit overrides (flags) on top."""
    values: dict[str, object] = {}
    for var, field in ENV_FIELDS.items():
        if env.get(var):
            values[field] = env[var]
    if env.get("SHOAL_BACKOFF"):
        values["backoff"] = tuple(float(x) for x in env["SHOAL_BACKOFF"].split(",") if x)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GroupConfig.model_validate(values)
