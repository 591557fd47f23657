"""The ConsumerGroup spec: its shape and every default, in one place.

The API server applies the CRD's defaults (crds/consumergroup.yaml; a test proves that its
defaults, enums and bounds equal this model's), so specs usually arrive complete; specs
built by hand or by tests may leave anything optional out and get the same defaults here.
Fields use the CRD's camelCase names on the wire (``ackWaitSeconds``) and snake_case in
Python.

Everything that depends on the spec derives from this model: the operator's builders and
the consumer pods' environment (through :class:`shoal.group.config.GroupConfig`), and
the autoscaler's policy (:meth:`shoal.consumer.scaler.Policy.from_spec`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from shoal.contracts.names import CONSUMER_CONTAINER_NAME, DEFAULT_PARTITIONS

__all__ = [
    "AssignmentSpec",
    "AutoscalingSpec",
    "ConsumerGroupSpec",
    "ConsumerSpec",
    "EtcdSpec",
    "NatsSpec",
    "SpecError",
    "StreamSpec",
    "parse_spec",
]

# What the patterns below call whitespace: exactly what `\s` is to Go's RE2, with which the
# API server checks the CRD's copies of them (tab, newline, form feed, carriage return,
# space). Python's `\s` also matches the Unicode spaces (U+00A0, U+2003, ...) and \v: a
# value the API server had stored would then fail this model, and the operator's status
# timer and finalizer with it. Written out, both sides accept the same strings.
WHITESPACE = r"\t\n\f\r "

# A handler is a Python function in the image, `package.module:function`, or a service
# that speaks HTTP, `http(s)://host[:port][/path]` (shoal.consumer.httphandler): a host
# name or an IPv4 address or a bracketed IPv6 one, no user info, no fragment. The CRD has
# the same pattern, and a CEL rule saying it in words (crds/consumergroup.yaml).
PYTHON_HANDLER_PATTERN = r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*"
URL_HANDLER_PATTERN = (
    r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?"
    rf"(/[^{WHITESPACE}#]*)?"
)
HANDLER_PATTERN = f"^({PYTHON_HANDLER_PATTERN}|{URL_HANDLER_PATTERN})$"
HANDLER_MAX_LENGTH = 2048
HANDLER_WORDS = (
    "must look like 'package.module:function' or be an http:// or https:// URL of a "
    "host, an optional port and a path, e.g. 'http://127.0.0.1:8080/messages'"
)
# spec.handlerReadyPath: a path on the HTTP handler's host, or empty (none).
READY_PATH_PATTERN = rf"^(/[^{WHITESPACE}#]*)?$"
# spec.handlerSocket: a Unix socket's absolute path under /run, /var/run or /tmp (the
# operator mounts an emptyDir at its directory, shared with spec.containers: elsewhere
# it could hide the image's own files, /opt or /etc), or empty (none). No '.' or '..'
# segments (the API server refuses those in a mountPath); at most 107 bytes, what a
# socket address holds (sun_path).
HANDLER_SOCKET_PATTERN = r"^(/(run|var/run|tmp)(/[A-Za-z0-9_][A-Za-z0-9._-]*)+)?$"
HANDLER_SOCKET_MAX_LENGTH = 107
HANDLER_SOCKET_NEEDS_HTTP = (
    "handlerSocket needs an http:// URL handler: the member sends the URL's requests "
    "to the socket instead of the URL's host and port (a socket in the pod needs no TLS)"
)
# spec.nats.stream.name and spec.nats.subjectPrefix; empty: the default.
STREAM_NAME_PATTERN = rf"^([^.*>{WHITESPACE}/\\]+)?$"
SUBJECT_PREFIX_PATTERN = rf"^([^.*>{WHITESPACE}]+(\.[^.*>{WHITESPACE}]+)*)?$"
# spec.containers: at most this many (the CRD's maxItems; it also bounds its CEL rules).
MAX_CONTAINERS = 16
# maxMessagesPerSecond's bound (the CRD's maximum too): far above any group's pace, and
# a member's share of it stays finite (1e308 x owned overflowed to inf).
MAX_RATE_LIMIT = 1e9
# A container name, as Kubernetes requires it (a DNS-1123 label).
CONTAINER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _integral(value: object) -> object:
    # JSON has one number type: 3.0 is the integer 3 (YAML and some clients write it so).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _comma_list(value: object) -> object:
    # A list of endpoints, as people also write it, is the comma list etcd clients take.
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    return value


# Strict, so "yes" is not a boolean and "90" not a number, but 3.0 is still an integer.
Int = Annotated[int, BeforeValidator(_integral)]


class _Section(BaseModel):
    # extra="ignore": the API server prunes unknown fields, and a newer CRD's fields must
    # not break an older operator or pod reading the same object.
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="ignore",
        strict=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: object) -> object:
        # A null field means "not set" (the API server prunes nulls; hand-written specs
        # and templates leave them in): it takes the default.
        if isinstance(data, Mapping):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamSpec(_Section):
    """The group's JetStream stream."""

    name: str = Field("", pattern=STREAM_NAME_PATTERN)  # empty: shoal_<namespace>_<group>
    retention: Literal["workqueue", "limits", "interest"] = "workqueue"
    storage: Literal["file", "memory"] = "file"
    replicas: Int = Field(1, ge=1, le=5)
    # Also create <name>_ledger on <subjectPrefix>.ledger.*, where the built-in handler
    # shoal.consumer.handlers:ledger records every processed message for audits.
    ledger: bool = False


class ConsumerSpec(_Section):
    """The per-partition durable pull consumers (explicit ack)."""

    ack_wait_seconds: float = Field(5.0, ge=0.1)
    max_ack_pending: Int = Field(1000, ge=1)
    max_deliver: Int = Field(5, ge=1)
    backoff_seconds: list[Annotated[float, Field(ge=0)]] = Field(default_factory=list)
    # Messages a member runs at once, over different projects (one project's messages
    # always run one after another, in stream order).
    max_concurrency: Int = Field(100, ge=1, le=10000)
    # InOrder: a failing message is retried in place, before any later message of its
    # project (other projects go on). NakAndContinue: it is redelivered by JetStream
    # after the backoff, and later messages of its project may overtake it.
    retry_policy: Literal["InOrder", "NakAndContinue"] = "InOrder"
    # A handler still running after this long is cancelled, and the run counts as a
    # failed attempt (retried with the backoff, dead-lettered after maxDeliver); 0: never.
    handler_timeout_seconds: float = Field(300.0, ge=0)
    # The group as a whole starts at most this many handler runs a second; each member
    # takes the share of the partitions it owns (shoal.consumer.ratelimit). None: no limit.
    max_messages_per_second: (
        Annotated[float, Field(gt=0, le=MAX_RATE_LIMIT, allow_inf_nan=False)] | None
    ) = None
    # After a failure (a crash, a fence, a lost lease) the next owner of a partition waits
    # for the messages its last owner did not settle, at most ackWait and a second, and
    # runs them before anything newer of their projects (Strict); or pulls at once, and
    # those come back after ackWait, behind newer ones (Fast). Planned moves are orderly
    # either way. shoal.consumer.takeover.
    order_after_failure: Literal["Strict", "Fast"] = "Strict"


class NatsSpec(_Section):
    url: str = ""  # empty: the operator's default
    # A Secret with key `creds` (a credentials file), or `user` and `password`, or `nkey`
    # (a seed): how the members, and the operator for this group, authenticate.
    credentials_secret: str = ""
    # A Secret with `ca.crt` (the servers' CA) and optionally `tls.crt` and `tls.key` (a
    # client certificate): TLS for the members and, for this group, the operator.
    tls_secret: str = ""
    subject_prefix: str = Field("", pattern=SUBJECT_PREFIX_PATTERN)  # empty: shoal.<ns>.<group>
    stream: StreamSpec = StreamSpec()
    consumer: ConsumerSpec = ConsumerSpec()


class EtcdSpec(_Section):
    endpoints: Annotated[str, BeforeValidator(_comma_list)] = ""  # empty: operator's default
    tls_secret: str = ""


class AutoscalingSpec(_Section):
    """How the leader scales the group between minReplicas and maxReplicas."""

    enabled: bool = False
    interval_seconds: Int = Field(30, ge=1)
    cooldown_seconds: Int = Field(600, ge=0)
    cpu_threshold: Int = Field(90, ge=1, le=100)
    max_projects_per_member: Int = Field(50, ge=1)
    min_projects_per_member: Int = Field(2, ge=0)
    target_lag_per_member: Annotated[Int, Field(ge=1)] | None = None
    dry_run: bool = False


class AssignmentSpec(_Section):
    strategy: Literal["sticky", "modulo"] = "sticky"
    load_aware: bool = False

    @model_validator(mode="after")
    def _load_needs_sticky(self) -> AssignmentSpec:
        if self.load_aware and self.strategy != "sticky":
            raise ValueError("loadAware needs strategy sticky (modulo ignores loads)")
        return self


# The autoscaler runs in the members: with none, nothing would bring the group back to
# minReplicas. The CRD's rule says the same (tests/test_spec.py).
REPLICAS_WITH_AUTOSCALING = (
    "replicas must be at least 1 while autoscaling is enabled: the autoscaler runs in the "
    "group's members, so a group scaled to 0 has no leader and nothing would ever scale it "
    "up again (to stop the group, disable autoscaling and set replicas to 0)"
)


class ConsumerGroupSpec(_Section):
    """``spec`` of a ConsumerGroup (group shoal.dev, version v1alpha1)."""

    # 0 stops the group by hand (no pods; its messages wait in the stream), as for a
    # Deployment; but not while autoscaling is enabled (see _bounds).
    replicas: Int = Field(3, ge=0)
    # At least 1: a group scaled to 0 has no member, so no leader, and nothing would
    # ever scale it up again (the CRD refuses 0 with the same message).
    min_replicas: Int = Field(1, ge=1)
    max_replicas: Int = Field(10, ge=1)
    partitions: Int = Field(DEFAULT_PARTITIONS, ge=1, le=4096)
    image: str = ""  # empty: the operator's default image
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    # Required, with no default: the noop handler would ack, and so delete, every message
    # of a work-queue stream.
    handler: str = Field(pattern=HANDLER_PATTERN, max_length=HANDLER_MAX_LENGTH)
    # With an HTTP handler: a path on its host (`/healthz`) that must answer 2xx before
    # a member joins the group (shoal.consumer.httphandler); empty: none.
    handler_ready_path: str = Field("", pattern=READY_PATH_PATTERN)
    # With an http:// handler: the Unix socket the service listens on, instead of the
    # URL's host and port (a loopback TCP send costs the member several times more);
    # empty: none. The operator shares its directory with spec.containers (builders).
    handler_socket: str = Field(
        "", pattern=HANDLER_SOCKET_PATTERN, max_length=HANDLER_SOCKET_MAX_LENGTH
    )
    env: list[dict[str, Any]] = Field(default_factory=list)
    resources: dict[str, Any] = Field(default_factory=dict)
    # Where and how the consumer pods run: copied into the pod template as written (the
    # API server validates them there); see shoal.operator.builders.build_deployment.
    pod_labels: dict[str, str] = Field(default_factory=dict)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    # How long a member pod stays bound to a node that is unreachable or not ready before
    # Kubernetes evicts it and the Deployment replaces it elsewhere: NoExecute tolerations
    # for node.kubernetes.io/unreachable and not-ready with this tolerationSeconds
    # (Kubernetes' own default is 300 s). A lost member's partitions have moved within its
    # lease TTL already; this only decides when the group gets its capacity back. A
    # toleration for either taint in `tolerations` wins over it for that taint.
    node_loss_toleration_seconds: Int = Field(30, ge=0)
    affinity: dict[str, Any] = Field(default_factory=dict)
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list)
    priority_class_name: str = ""  # empty: the cluster's default priority
    # The team's own containers (e.g. the service a URL handler calls), run in each
    # member pod as native sidecars, in this order, before the member: see
    # shoal.operator.builders.sidecars. Written as in a Pod spec; the API server
    # validates all but what _sidecars checks (the CRD checks the same).
    containers: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_CONTAINERS)
    nats: NatsSpec = NatsSpec()
    etcd: EtcdSpec = EtcdSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    assignment: AssignmentSpec = AssignmentSpec()
    deletion_policy: Literal["Retain", "Delete"] = "Retain"
    # A partition with work (messages pending or held) and no progress (no pull answered,
    # no message settled) for this long is stalled: reported, and moved by the leader.
    stall_after_seconds: Int = Field(60, ge=5)
    # Every member finishes what it is running, acks it, gives back what it holds and
    # pulls nothing, keeping its partitions; false resumes. Reaches the members through
    # etcd (the operator writes Keys.paused), never through the pods: no restart.
    paused: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> ConsumerGroupSpec:
        # The CRD's CEL rules, for specs that did not come through the API server.
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must not exceed maxReplicas")
        if self.max_replicas > self.partitions:
            raise ValueError("maxReplicas must not exceed partitions")
        if self.replicas > self.partitions:
            raise ValueError("replicas must not exceed partitions")
        if self.replicas < 1 and self.autoscaling.enabled:
            raise ValueError(REPLICAS_WITH_AUTOSCALING)
        if self.handler_socket and not self.handler.startswith("http://"):
            raise ValueError(HANDLER_SOCKET_NEEDS_HTTP)
        return self

    @field_validator("containers")
    @classmethod
    def _sidecars(cls, containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return check_containers(containers)

    def cpu_limit(self) -> object:
        """The consumer container's ``resources.limits.cpu`` as written (or None)."""
        limits = self.resources.get("limits")
        return limits.get("cpu") if isinstance(limits, Mapping) else None


def check_containers(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """spec.containers' own rules (the CRD's, worded alike): each has a name and an
    image, no name is Shoal's own container's, and no name repeats. ValueError."""
    seen: set[str] = set()
    for index, container in enumerate(containers):
        name = container.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"containers[{index}] needs a name")
        if len(name) > 63 or not re.match(CONTAINER_NAME_PATTERN, name):
            raise ValueError(
                f"containers[{index}].name {name!r} must be a DNS-1123 label (lowercase "
                "letters, digits and '-', at most 63 characters)"
            )
        image = container.get("image")
        if not isinstance(image, str) or not image:
            raise ValueError(f"containers[{index}] ({name}) needs an image")
        if container.get("restartPolicy", "Always") != "Always":
            raise ValueError(
                f"containers[{index}] ({name}): restartPolicy can only be Always (each runs "
                "as a native sidecar, restarted whenever it exits)"
            )
        mounts = container.get("volumeMounts")
        if mounts is not None and not (
            isinstance(mounts, list) and all(isinstance(m, Mapping) for m in mounts)
        ):
            # (The operator adds spec.handlerSocket's directory to this list.)
            raise ValueError(f"containers[{index}] ({name}).volumeMounts must be a list of mounts")
        if name == CONSUMER_CONTAINER_NAME:
            raise ValueError(CONTAINER_NAME_TAKEN)
        if name in seen:
            raise ValueError(f"{DUPLICATE_CONTAINERS}: {name!r} appears twice")
        seen.add(name)
    return containers


CONTAINER_NAME_TAKEN = (
    f"containers must not be named '{CONSUMER_CONTAINER_NAME}': that is the name of "
    "Shoal's own container in the member pod"
)
DUPLICATE_CONTAINERS = "containers must have unique names"


class SpecError(ValueError):
    """A spec that does not fit the model, with one readable line per problem."""


# Where pydantic's wording does not say what to write instead.
_FRIENDLIER = {
    ("spec.handler", "missing"): "is required ('package.module:function' or an http(s) URL)",
    ("spec.handler", "string_pattern_mismatch"): HANDLER_WORDS,
    ("spec.handlerReadyPath", "string_pattern_mismatch"): (
        "must be a path on the handler's host, starting with '/' (e.g. '/healthz')"
    ),
    ("spec.handlerSocket", "string_pattern_mismatch"): (
        "must be the absolute path of a Unix socket under /run/, /var/run/ or /tmp/, e.g. "
        "'/run/handler/http.sock' (letters, digits, '.', '_' and '-'; no '.' or '..')"
    ),
    ("spec.handlerSocket", "string_too_long"): (
        "must be at most 107 bytes: a longer path does not fit a socket address"
    ),
    ("spec.minReplicas", "greater_than_equal"): (
        "must be at least 1: a group scaled to 0 has no member, so no leader, and nothing "
        "would ever scale it up again"
    ),
    ("spec.nats.consumer.maxMessagesPerSecond", "greater_than"): (
        "must be a positive number of messages a second (leave it out, or null, for no limit)"
    ),
    ("spec.nats.consumer.maxMessagesPerSecond", "less_than_equal"): (
        "must be at most 1e9 messages a second (leave it out, or null, for no limit)"
    ),
    ("spec.nats.consumer.maxMessagesPerSecond", "finite_number"): (
        "must be a finite number of messages a second (leave it out, or null, for no limit)"
    ),
    ("spec.nats.subjectPrefix", "string_pattern_mismatch"): (
        "must be a subject prefix: dot-separated tokens without wildcards or whitespace"
    ),
}


def _where(loc: tuple[int | str, ...]) -> str:
    return "spec." + ".".join(str(part) for part in loc) if loc else "spec"


def parse_spec(spec: Mapping[str, Any] | ConsumerGroupSpec) -> ConsumerGroupSpec:
    """The model of a spec as the API server returns it (camelCase); SpecError if invalid."""
    if isinstance(spec, ConsumerGroupSpec):
        return spec
    if not isinstance(spec, Mapping):
        raise SpecError(f"spec must be a mapping, got {type(spec).__name__}")
    try:
        return ConsumerGroupSpec.model_validate(dict(spec))
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = _where(tuple(error["loc"]))
            friendly = _FRIENDLIER.get((where, error["type"]))
            if friendly:
                problems.append(f"{where} {friendly}")
            else:
                problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
        raise SpecError("; ".join(problems)) from None
