"""The configuration of one consumer process: which group, which servers, which limits.

A pod's configuration comes from its ConsumerGroup's spec (shoal.contracts.spec): the
operator derives a GroupConfig from the spec (:func:`group_config`) and renders it into
the pod's environment (:func:`config_env`); the pod reads it back (:func:`config_from_env`),
and the CLI maps flags onto the same fields. Environment variable names live in
:data:`ENV_FIELDS` only. Defaults that the spec also has come from the spec's model, so
each is written once. Validation happens here, once, with messages a person can act on.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from shoal.clients.natsauth import NatsSecurity
from shoal.contracts.names import (
    Keys,
    check_subject_prefix,
    check_token,
    default_stream_name,
    default_subject_prefix,
    dlq_stream_name,
    ledger_stream_name,
    log_stream_name,
)
from shoal.contracts.spec import (
    HANDLER_SOCKET_MAX_LENGTH,
    HANDLER_SOCKET_PATTERN,
    MAX_RATE_LIMIT,
    READY_PATH_PATTERN,
    AssignmentSpec,
    ConsumerGroupSpec,
    ConsumerSpec,
    StreamSpec,
    parse_spec,
)
from shoal.group.handlerref import check_url_handler, is_url_handler

_STREAM = StreamSpec()
_CONSUMER = ConsumerSpec()
_ASSIGNMENT = AssignmentSpec()
_PARTITIONS: int = ConsumerGroupSpec.model_fields["partitions"].default
_STALL_AFTER: int = ConsumerGroupSpec.model_fields["stall_after_seconds"].default


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
    partitions: int = Field(_PARTITIONS, ge=1, le=4096)
    member_id: str = Field(default_factory=default_member_id)

    nats_url: str = "nats://127.0.0.1:4222"
    etcd_endpoints: str = "127.0.0.1:2379"
    subject_prefix: str = ""
    stream: str = ""
    stream_replicas: int = Field(_STREAM.replicas, ge=1, le=5)
    retention: Literal["workqueue", "limits", "interest"] = _STREAM.retention
    storage: Literal["file", "memory"] = _STREAM.storage
    ensure_jetstream: bool = True
    # Create the ledger stream too (spec.nats.stream.ledger): the built-in `ledger`
    # handler records every processed message there, for audits.
    ledger: bool = _STREAM.ledger

    handler: str = "shoal.consumer.handlers:noop"
    # With an HTTP handler: a path on its host that must answer 2xx before the member
    # joins the group (spec.handlerReadyPath; shoal.consumer.httphandler).
    handler_ready_path: str | None = Field(None, pattern=READY_PATH_PATTERN)
    # With an http:// handler: connect to this Unix socket instead of the URL's host and
    # port (spec.handlerSocket; shoal.consumer.httpclient).
    handler_socket: str | None = Field(
        None, pattern=HANDLER_SOCKET_PATTERN, max_length=HANDLER_SOCKET_MAX_LENGTH
    )
    ack_wait: float = Field(_CONSUMER.ack_wait_seconds, gt=0)
    max_ack_pending: int = Field(_CONSUMER.max_ack_pending, ge=1)
    max_deliver: int = Field(_CONSUMER.max_deliver, ge=1)
    backoff: tuple[float, ...] = tuple(_CONSUMER.backoff_seconds)
    max_concurrency: int = Field(_CONSUMER.max_concurrency, ge=1, le=10000)
    retry_policy: Literal["InOrder", "NakAndContinue"] = _CONSUMER.retry_policy
    # Cancel a handler after this long, as a failed attempt (0: never).
    handler_timeout: float = Field(_CONSUMER.handler_timeout_seconds, ge=0)
    # The group's rate limit, handler runs a second over all members; each member takes
    # limit x owned / partitions of it (shoal.consumer.ratelimit). None: no limit.
    max_messages_per_second: float | None = Field(
        _CONSUMER.max_messages_per_second, gt=0, le=MAX_RATE_LIMIT, allow_inf_nan=False
    )
    # Strict: a partition taken over after a failure runs its earlier deliveries first
    # (takeover.py); Fast: it pulls at once.
    order_after_failure: Literal["Strict", "Fast"] = _CONSUMER.order_after_failure
    # A partition with work and no progress this long is stalled (progress.py).
    stall_after: float = Field(_STALL_AFTER, ge=1)
    # Fetched messages held at most per partition (each pull asks for what fits); below
    # it a partition holds half a second of its own settle rate, at least 64 (holding.py).
    # What is held counts against ack_wait, so the worker keeps it alive.
    fetch_batch: int = Field(256, ge=1, le=1024)
    # The most a member holds (plus what its open pulls may bring): the memory bound.
    # Below it the budget follows the member's throughput (holding.py: about a second of
    # it), so a slow handler's member holds little; 32,768 = 128 partitions x fetch_batch.
    max_buffered: int = Field(32768, ge=1)
    # A pull request lives at most this long; a released partition waits for it, so it
    # bounds the hand-over pause (DESIGN: p99 < 1 s for planned moves).
    fetch_expires: float = Field(0.3, gt=0.05, le=5)
    # A dozing partition (alarm.py) still pulls once this often: a safety net, should an
    # alarm be missed. Shorter only to test what many sweeps do (fault suite, soak).
    doze_sweep: float = Field(60.0, ge=0.05)
    # How often freed C-heap pages go back to the system (memory.py; 0: never).
    malloc_trim_interval: float = Field(60.0, ge=0)

    lease_ttl: int = Field(10, ge=2)
    keepalive_interval: float = Field(3.0, gt=0)
    # Stop consuming this long before the lease could expire on the server.
    fence_margin: float = Field(2.0, ge=0)
    debounce: float = Field(0.5, ge=0)
    drain_timeout: float = Field(30.0, gt=0)
    stats_interval: float = Field(5.0, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # The member's state (joined, fenced, NATS, a timestamp), rewritten every second and
    # removed at exit: the pod's probes (`shoal-ready`, `shoal-ready --live`) read it.
    ready_file: str | None = None
    # Answer the probes over HTTP on this port as well (/readyz, /livez, from ready_file;
    # 0: any free port): consumer/healthport.py. None: only the file (exec probes).
    health_port: int | None = Field(None, ge=0, le=65535)
    # NATS credentials: a credentials file (the operator mounts the group's credentials
    # secret), or a user and password, or an nkey seed file; and TLS with a private CA
    # and a client certificate (spec.nats.tlsSecret). Checked when connecting
    # (shoal.clients.natsauth), not here, for the same reason as etcd's below.
    nats_creds_file: str | None = None
    nats_user: str | None = None
    nats_password: SecretStr | None = None
    nats_nkey_seed_file: str | None = None
    nats_ca_file: str | None = None
    nats_cert_file: str | None = None
    nats_key_file: str | None = None
    # Replies to this member's requests and pulls come to <prefix>.>; a per-group prefix
    # lets the server keep other users from reading them (shoal.consumer.permissions).
    nats_inbox_prefix: str | None = None
    # Where this member's JetStream API requests go. "$JS.API" when the streams live in
    # the member's own account; with the streams in another account, the prefix under
    # which this account imports that one's API (e.g. "JS.SHOAL.API"; see
    # `shoal-consumer permissions --accounts`).
    nats_js_api_prefix: str = Field("$JS.API", min_length=1, pattern=r"^[^\s*>]+[^.\s*>]$")
    # What nats-py buffers while the connection is down (its pending_size; nats.go's
    # ReconnectBufSize): beyond it a publish raises instead of queueing. 2 MiB is
    # nats-py's default; a member survives a full buffer either way (partition.py).
    nats_reconnect_buffer: int = Field(2 * 1024 * 1024, ge=1024)
    # etcd over TLS (CA, client certificate and key files: the operator mounts the group's
    # spec.etcd.tlsSecret) and etcd authentication. Files are checked when the etcd client
    # is made (shoal.clients.etcd.check_security), not here: the operator builds this
    # config too, where the pods' paths do not exist.
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    etcd_username: str | None = None
    etcd_password: SecretStr | None = None
    # How the leader assigns partitions (ConsumerGroup spec.assignment): "sticky" moves
    # the fewest; "modulo" is the seed's p % n, kept as a baseline for comparison. With
    # load_aware, sticky also evens out the members' measured message rates.
    strategy: Literal["sticky", "modulo"] = _ASSIGNMENT.strategy
    load_aware: bool = _ASSIGNMENT.load_aware
    # Load-aware: how often the leader weighs the measured loads between membership changes.
    load_check_interval: float = Field(60.0, gt=0)
    # "kubernetes": the leader autoscales the group through its ConsumerGroup's scale
    # subresource, with the pod's ServiceAccount (the operator sets this); "off": never.
    autoscaler: Literal["off", "kubernetes"] = "off"

    @field_validator("namespace", "group", "member_id")
    @classmethod
    def _token(cls, value: str) -> str:
        return check_token(value, "name")

    @field_validator("backoff", mode="before")
    @classmethod
    def _backoff_list(cls, value: object) -> object:
        # From the environment: "1,2,5" (config_env writes it so).
        if isinstance(value, str):
            return tuple(float(x) for x in value.split(",") if x.strip())
        return value

    @field_validator("handler")
    @classmethod
    def _handler_spec(cls, value: str) -> str:
        if is_url_handler(value):
            check_url_handler(value)
            return value
        module, sep, func = value.partition(":")
        if not sep or not module or not func:
            raise ValueError(
                f"handler {value!r} must look like 'package.module:function' or be an http(s) URL"
            )
        return value

    @model_validator(mode="after")
    def _derived(self) -> GroupConfig:
        if self.load_aware and self.strategy == "modulo":
            raise ValueError("load_aware needs strategy 'sticky' (modulo ignores loads)")
        if self.health_port is not None and not self.ready_file:
            raise ValueError(
                "health_port (SHOAL_HEALTH_PORT) answers from the state file: set "
                "ready_file (SHOAL_READY_FILE) too"
            )
        if self.handler_socket and not self.handler.startswith("http://"):
            raise ValueError(
                "handler_socket (SHOAL_HANDLER_SOCKET) needs an http:// URL handler: the "
                "URL's requests go to the socket instead of its host and port"
            )
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
        return ledger_stream_name(self.stream)

    @property
    def dlq_stream(self) -> str:
        return dlq_stream_name(self.stream)

    @property
    def log_stream(self) -> str:
        return log_stream_name(self.stream)

    def etcd_options(self) -> EtcdOptions:
        """TLS and credentials, as keyword arguments of shoal.clients.etcd.Etcd."""
        password = self.etcd_password.get_secret_value() if self.etcd_password else None
        return EtcdOptions(
            ca_file=self.etcd_ca_file,
            cert_file=self.etcd_cert_file,
            key_file=self.etcd_key_file,
            username=self.etcd_username,
            password=password,
        )

    def nats_security(self) -> NatsSecurity:
        """TLS and credentials for shoal.clients.nats.connect."""
        password = self.nats_password.get_secret_value() if self.nats_password else None
        return NatsSecurity(
            ca_file=self.nats_ca_file,
            cert_file=self.nats_cert_file,
            key_file=self.nats_key_file,
            creds_file=self.nats_creds_file,
            user=self.nats_user,
            password=password,
            nkey_seed_file=self.nats_nkey_seed_file,
            inbox_prefix=self.nats_inbox_prefix,
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
    "SHOAL_HANDLER_READY_PATH": "handler_ready_path",
    "SHOAL_HANDLER_SOCKET": "handler_socket",
    "SHOAL_ACK_WAIT": "ack_wait",
    "SHOAL_MAX_ACK_PENDING": "max_ack_pending",
    "SHOAL_MAX_DELIVER": "max_deliver",
    "SHOAL_BACKOFF": "backoff",
    "SHOAL_MAX_CONCURRENCY": "max_concurrency",
    "SHOAL_RETRY_POLICY": "retry_policy",
    "SHOAL_HANDLER_TIMEOUT": "handler_timeout",
    "SHOAL_MAX_MESSAGES_PER_SECOND": "max_messages_per_second",
    "SHOAL_ORDER_AFTER_FAILURE": "order_after_failure",
    "SHOAL_STALL_AFTER": "stall_after",
    "SHOAL_MAX_BUFFERED": "max_buffered",
    "SHOAL_LEDGER": "ledger",
    "SHOAL_LEASE_TTL": "lease_ttl",
    "SHOAL_KEEPALIVE_INTERVAL": "keepalive_interval",
    "SHOAL_METRICS_PORT": "metrics_port",
    "SHOAL_DRAIN_TIMEOUT": "drain_timeout",
    "SHOAL_STATS_INTERVAL": "stats_interval",
    "SHOAL_READY_FILE": "ready_file",
    "SHOAL_HEALTH_PORT": "health_port",
    "SHOAL_ENSURE_JETSTREAM": "ensure_jetstream",
    "NATS_CREDS_FILE": "nats_creds_file",
    "NATS_USER": "nats_user",
    "NATS_PASSWORD": "nats_password",
    "NATS_NKEY_SEED_FILE": "nats_nkey_seed_file",
    "NATS_CA_FILE": "nats_ca_file",
    "NATS_CERT_FILE": "nats_cert_file",
    "NATS_KEY_FILE": "nats_key_file",
    "NATS_INBOX_PREFIX": "nats_inbox_prefix",
    "NATS_JS_API_PREFIX": "nats_js_api_prefix",
    "SHOAL_NATS_RECONNECT_BUFFER": "nats_reconnect_buffer",
    "SHOAL_DOZE_SWEEP": "doze_sweep",
    "SHOAL_MALLOC_TRIM_INTERVAL": "malloc_trim_interval",
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


def nats_security_from_env(env: Mapping[str, str]) -> NatsSecurity:
    """Only NATS's TLS and credentials (NATS_*), for commands that need no group config."""
    return NatsSecurity(
        ca_file=env.get("NATS_CA_FILE") or None,
        cert_file=env.get("NATS_CERT_FILE") or None,
        key_file=env.get("NATS_KEY_FILE") or None,
        creds_file=env.get("NATS_CREDS_FILE") or None,
        user=env.get("NATS_USER") or None,
        password=env.get("NATS_PASSWORD") or None,
        nkey_seed_file=env.get("NATS_NKEY_SEED_FILE") or None,
        inbox_prefix=env.get("NATS_INBOX_PREFIX") or None,
    )


def config_from_env(env: Mapping[str, str], **overrides: object) -> GroupConfig:
    """Build a config from environment variables, then explicit overrides (flags) on top."""
    values: dict[str, object] = {
        field: env[var] for var, field in ENV_FIELDS.items() if env.get(var)
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return GroupConfig.model_validate(values)


# Field -> environment variable: config_env's half of ENV_FIELDS.
ENV_VARS: dict[str, str] = {field: var for var, field in ENV_FIELDS.items()}


def _env_value(value: object) -> str:
    """Environment values are strings; integral floats lose ".0" so int fields parse."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list | tuple):
        return ",".join(_env_value(item) for item in value)
    return str(value)


def config_env(config: GroupConfig, fields: Iterable[str]) -> dict[str, str]:
    """The environment that gives `config_from_env` these fields of `config` (in order).
    Unset optional fields (None) and an empty backoff are left out."""
    env: dict[str, str] = {}
    for field in fields:
        value = getattr(config, field)
        if value is None or value == ():
            continue
        env[ENV_VARS[field]] = _env_value(value)
    return env


def group_config(
    namespace: str,
    name: str,
    spec: Mapping[str, Any] | ConsumerGroupSpec,
    *,
    nats_url: str,
    etcd_endpoints: str,
    **fields: Any,
) -> GroupConfig:
    """A group member's configuration, derived from its ConsumerGroup's spec.

    `nats_url` and `etcd_endpoints` are the defaults for a spec that names no servers (the
    operator's settings); `fields` set what the spec does not decide (member id, files,
    timeouts). Raises ValueError (SpecError) for a spec the members could not run with.
    """
    model = parse_spec(spec)
    nats, stream, consumer = model.nats, model.nats.stream, model.nats.consumer
    return GroupConfig(
        namespace=namespace,
        group=name,
        partitions=model.partitions,
        nats_url=nats.url or nats_url,
        etcd_endpoints=model.etcd.endpoints or etcd_endpoints,
        subject_prefix=nats.subject_prefix,
        stream=stream.name,
        stream_replicas=stream.replicas,
        retention=stream.retention,
        storage=stream.storage,
        ledger=stream.ledger,
        handler=model.handler,
        handler_ready_path=model.handler_ready_path or None,
        handler_socket=model.handler_socket or None,
        ack_wait=consumer.ack_wait_seconds,
        max_ack_pending=consumer.max_ack_pending,
        max_deliver=consumer.max_deliver,
        backoff=tuple(consumer.backoff_seconds),
        max_concurrency=consumer.max_concurrency,
        retry_policy=consumer.retry_policy,
        handler_timeout=consumer.handler_timeout_seconds,
        max_messages_per_second=consumer.max_messages_per_second,
        order_after_failure=consumer.order_after_failure,
        stall_after=model.stall_after_seconds,
        strategy=model.assignment.strategy,
        load_aware=model.assignment.load_aware,
        **fields,
    )
