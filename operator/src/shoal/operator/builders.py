"""Pure builders: a ConsumerGroup's spec -> the Kubernetes objects that run its members.

Every function takes plain values (the spec as the API server returns it, camelCase,
defaults applied) and returns plain dicts: no I/O, no client objects, no ownerReferences
(the handlers adopt children with kopf.adopt). Missing optional sections count as empty
and missing fields as the CRD's defaults, so a half-defaulted spec still builds.

A spec the consumer could never run with (a group name that is not a NATS subject token,
an invalid subject prefix, no handler) is a ValueError here, before any pod crash-loops on
it; the handlers turn it into kopf.PermanentError.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, TypedDict

from shoal.consumer.cpu import LIMIT_ENV as CPU_LIMIT_ENV
from shoal.consumer.partitioning import (
    DEFAULT_PARTITIONS,
    check_subject_prefix,
    check_token,
    default_stream_name,
    default_subject_prefix,
)
from shoal.operator.settings import OperatorSettings

Obj = dict[str, Any]
Spec = Mapping[str, Any]

API_GROUP = "shoal.dev"
PLURAL = "consumergroups"
CONTAINER_NAME = "consumer"
COMMAND = ["shoal-consumer", "run"]
# The readiness probe: a standard-library-only check (consumer/ready.py), cheap enough
# to run every 2 s.
READY_COMMAND = ["shoal-ready"]
# Pod-template annotation: the etcd tlsSecret version the pods were started with.
ETCD_SECRET_VERSION = "shoal.dev/etcd-secret-version"

# The CRD's defaults, for specs that reach us without them.
DEFAULT_REPLICAS = 3
DEFAULT_RETENTION = "workqueue"
DEFAULT_STORAGE = "file"
DEFAULT_STREAM_REPLICAS = 1
DEFAULT_ACK_WAIT_SECONDS = 5
DEFAULT_MAX_ACK_PENDING = 1000
DEFAULT_MAX_DELIVER = 5

# Beyond the consumer's own drain timeout: time to release the last partitions, let the
# next owners claim them and leave etcd before the kubelet sends SIGKILL.
DRAIN_SLACK_SECONDS = 15

# Per pod, not just per container: on the local plane's process kubelet every "pod" shares
# the host's /tmp. $(POD_NAME) only expands because POD_NAME comes earlier in env.
READY_FILE = "/tmp/shoal/$(POD_NAME)/ready"

NATS_CREDS_DIR = "/etc/shoal/nats"
NATS_CREDS_KEY = "creds"
NATS_CREDS_FILE = f"{NATS_CREDS_DIR}/{NATS_CREDS_KEY}"

# spec.etcd.tlsSecret: a kubernetes.io/tls-style Secret. The three files are required (the
# mount fails with a clear event without them); username and password are optional keys.
ETCD_TLS_DIR = "/etc/shoal/etcd"
ETCD_CA_KEY, ETCD_CERT_KEY, ETCD_KEY_KEY = "ca.crt", "tls.crt", "tls.key"
ETCD_TLS_FILES = {  # env var -> key in the Secret (and file name in ETCD_TLS_DIR)
    "ETCD_CA_FILE": ETCD_CA_KEY,
    "ETCD_CERT_FILE": ETCD_CERT_KEY,
    "ETCD_KEY_FILE": ETCD_KEY_KEY,
}
ETCD_AUTH_KEYS = {"ETCD_USERNAME": "username", "ETCD_PASSWORD": "password"}


class ResourceNames(TypedDict):
    deployment: str
    service_account: str
    role: str
    role_binding: str
    pdb: str


def resource_names(name: str) -> ResourceNames:
    """The one place that names a group's children; handlers look them up by these."""
    child = f"{name}-consumer"
    return ResourceNames(
        deployment=child, service_account=child, role=child, role_binding=child, pdb=child
    )


def selector(name: str) -> dict[str, str]:
    # A Deployment's selector is immutable: never add labels here, only to labels().
    return {"shoal.dev/group": name, "app.kubernetes.io/name": "shoal-consumer"}


def selector_string(name: str) -> str:
    """The selector in label-query form, for status.selector (the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector(name).items()))


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "shoal-consumer",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "consumer",
        "app.kubernetes.io/managed-by": "shoal-operator",
        "shoal.dev/group": name,
    }


# -- reading the spec ----------------------------------------------------------------------


def _section(parent: Spec, key: str) -> Spec:
    value = parent.get(key)
    return value if isinstance(value, Mapping) else {}


def _number(parent: Spec, key: str, default: int) -> Any:
    # Not `or`: 0 is a real value (replicas 0 parks a group).
    value = parent.get(key)
    return default if value is None else value


def _text(parent: Spec, key: str, default: str) -> str:
    # Here "" means unset: the CRD lets optional strings be empty.
    value = parent.get(key)
    return str(value) if value else default


def _env_value(value: object) -> str:
    """Environment values are strings; integral floats lose ".0" so int fields parse."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list | tuple):
        return ",".join(_env_value(item) for item in value)
    return str(value)


def subject_prefix(name: str, namespace: str, spec: Spec) -> str:
    """The group's subject prefix; the operator's stream must use the consumers' one."""
    prefix = _section(spec, "nats").get("subjectPrefix")
    return check_subject_prefix(prefix) if prefix else default_subject_prefix(namespace, name)


def stream_name(name: str, namespace: str, spec: Spec) -> str:
    stream = _section(_section(spec, "nats"), "stream")
    return _text(stream, "name", default_stream_name(namespace, name))


# -- the consumer's environment --------------------------------------------------------------


def _env(name: str, value: object) -> Obj:
    return {"name": name, "value": _env_value(value)}


def _field_env(name: str, field_path: str) -> Obj:
    # apiVersion spelled out: the API server would default it, and a desired object
    # equal to the stored one avoids spurious diffs.
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def cpu_millicores(quantity: object) -> int | None:
    """A CPU quantity ("500m", "2", "0.5", 1) in millicores; None when unset or unreadable
    (the API server validated it; an exotic form only loses the autoscaler's hint)."""
    if quantity is None or isinstance(quantity, bool):
        return None
    text = str(quantity).strip()
    try:
        if text.endswith("m"):
            value = float(text[:-1])
        else:
            value = float(text) * 1000
    except ValueError:
        return None
    return math.ceil(value) if value > 0 else None


def consumer_env(name: str, namespace: str, spec: Spec, settings: OperatorSettings) -> list[Obj]:
    """The consumer container's env: what shoal.consumer.config.config_from_env reads."""
    check_token(namespace, "namespace")
    check_token(name, "ConsumerGroup name")
    handler = spec.get("handler")
    if not handler:
        # No silent default: the consumer's noop handler would ack and so delete every
        # message of a work-queue stream.
        raise ValueError("spec.handler is required ('package.module:function')")
    nats = _section(spec, "nats")
    stream = _section(nats, "stream")
    consumer = _section(nats, "consumer")
    etcd = _section(spec, "etcd")
    assignment = _section(spec, "assignment")

    env = [
        _field_env("POD_NAME", "metadata.name"),
        # The member id is the pod name: `kubectl get pods` and etcd tell the same story.
        _field_env("SHOAL_MEMBER_ID", "metadata.name"),
        _env("SHOAL_NAMESPACE", namespace),
        _env("SHOAL_GROUP", name),
        _env("SHOAL_PARTITIONS", _number(spec, "partitions", DEFAULT_PARTITIONS)),
        _env("NATS_URL", nats.get("url") or settings.nats_url),
        _env("ETCD_ENDPOINTS", etcd.get("endpoints") or settings.etcd_endpoints),
        _env("SHOAL_SUBJECT_PREFIX", subject_prefix(name, namespace, spec)),
        _env("SHOAL_STREAM", stream_name(name, namespace, spec)),
        _env("SHOAL_STREAM_REPLICAS", _number(stream, "replicas", DEFAULT_STREAM_REPLICAS)),
        _env("SHOAL_RETENTION", _text(stream, "retention", DEFAULT_RETENTION)),
        _env("SHOAL_STORAGE", _text(stream, "storage", DEFAULT_STORAGE)),
        _env("SHOAL_HANDLER", handler),
        _env("SHOAL_ACK_WAIT", _number(consumer, "ackWaitSeconds", DEFAULT_ACK_WAIT_SECONDS)),
        _env("SHOAL_MAX_ACK_PENDING", _number(consumer, "maxAckPending", DEFAULT_MAX_ACK_PENDING)),
        _env("SHOAL_MAX_DELIVER", _number(consumer, "maxDeliver", DEFAULT_MAX_DELIVER)),
    ]
    if consumer.get("backoffSeconds"):
        env.append(_env("SHOAL_BACKOFF", consumer["backoffSeconds"]))
    env += [
        _env("SHOAL_DRAIN_TIMEOUT", settings.drain_timeout_seconds),
        _env("SHOAL_READY_FILE", READY_FILE),
        # The operator creates the stream and the durables: pods need no stream-admin
        # permissions and cannot race each other creating them.
        _env("SHOAL_ENSURE_JETSTREAM", False),
        # The leader reads spec.autoscaling itself on every round (it may be switched on
        # or off at any time) and scales through the group's scale subresource.
        _env("SHOAL_AUTOSCALER", "kubernetes"),
        _env("SHOAL_STRATEGY", _text(assignment, "strategy", "sticky")),
        _env("SHOAL_LOAD_AWARE", bool(assignment.get("loadAware", False))),
    ]
    cpu_limit = cpu_millicores(((spec.get("resources") or {}).get("limits") or {}).get("cpu"))
    if cpu_limit is not None:
        # What 100% CPU means for the autoscaler's cpuThreshold (consumer/cpu.py).
        env.append(_env(CPU_LIMIT_ENV, cpu_limit))
    if nats.get("credentialsSecret"):
        env.append(_env("NATS_CREDS_FILE", NATS_CREDS_FILE))
    if etcd.get("tlsSecret"):
        env += [_env(var, f"{ETCD_TLS_DIR}/{key}") for var, key in ETCD_TLS_FILES.items()]
        env += [
            # optional: a Secret without these keys means no etcd authentication.
            {
                "name": var,
                "valueFrom": {
                    "secretKeyRef": {"name": etcd["tlsSecret"], "key": key, "optional": True}
                },
            }
            for var, key in ETCD_AUTH_KEYS.items()
        ]

    # The user's variables go last so that they win. Ours that they name are dropped rather
    # than listed twice: duplicate names draw API warnings and break server-side apply.
    user = [copy.deepcopy(dict(var)) for var in spec.get("env") or []]
    overridden = {var.get("name") for var in user}
    return [var for var in env if var["name"] not in overridden] + user


# -- children ----------------------------------------------------------------------------------


def _metadata(child: str, name: str, namespace: str) -> Obj:
    return {"name": child, "namespace": namespace, "labels": labels(name)}


def _volumes(spec: Spec) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, container mounts)."""
    # A read-only root filesystem still needs a writable /tmp (the ready file, Python).
    volumes: list[Obj] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[Obj] = [{"name": "tmp", "mountPath": "/tmp"}]
    secret = _section(spec, "nats").get("credentialsSecret")
    if secret:
        # Only the key we point NATS_CREDS_FILE at: a secret without it fails the mount
        # with a clear event instead of a consumer that cannot find its file.
        volumes.append(
            {
                "name": "nats-credentials",
                "secret": {
                    "secretName": secret,
                    "items": [{"key": NATS_CREDS_KEY, "path": NATS_CREDS_KEY}],
                },
            }
        )
        mounts.append({"name": "nats-credentials", "mountPath": NATS_CREDS_DIR, "readOnly": True})
    etcd_secret = _section(spec, "etcd").get("tlsSecret")
    if etcd_secret:
        # Only the files, listed: the username and password reach the pod as env vars.
        volumes.append(
            {
                "name": "etcd-tls",
                "secret": {
                    "secretName": etcd_secret,
                    "items": [{"key": key, "path": key} for key in ETCD_TLS_FILES.values()],
                },
            }
        )
        mounts.append({"name": "etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": True})
    return volumes, mounts


def _container(name: str, namespace: str, spec: Spec, settings: OperatorSettings) -> Obj:
    _, mounts = _volumes(spec)
    return {
        "name": CONTAINER_NAME,
        "image": spec.get("image") or settings.default_image,
        "imagePullPolicy": spec.get("imagePullPolicy") or settings.image_pull_policy,
        "command": list(COMMAND),
        "env": consumer_env(name, namespace, spec, settings),
        "resources": copy.deepcopy(dict(spec.get("resources") or {})),
        # Ready = registered as a member (the consumer writes SHOAL_READY_FILE once it has
        # joined), so a rollout waits for each new member before replacing the next one.
        # Timeout 2 s, not 1: the probe starts a Python process, and one slow start must
        # not fail a probe that tolerates no failures.
        "readinessProbe": {
            "exec": {"command": list(READY_COMMAND)},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 1,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }


def build_deployment(
    name: str,
    namespace: str,
    spec: Spec,
    settings: OperatorSettings,
    etcd_secret_version: str | None = None,
) -> Obj:
    """The consumers' Deployment. `etcd_secret_version` (the tlsSecret's resourceVersion)
    goes into the pod template: members read their certificates once, at start, so a
    rotated Secret must roll the pods (one at a time, each hand-over lossless)."""
    names = resource_names(name)
    volumes, _ = _volumes(spec)
    template_meta: Obj = {"labels": labels(name)}
    if etcd_secret_version:
        template_meta["annotations"] = {ETCD_SECRET_VERSION: etcd_secret_version}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(names["deployment"], name, namespace),
        "spec": {
            "replicas": _number(spec, "replicas", DEFAULT_REPLICAS),
            "selector": {"matchLabels": selector(name)},
            # Surge, never dip: a new member joins before an old one leaves, so a rollout
            # never runs below the group's capacity (the hand-over itself is lossless).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": template_meta,
                "spec": {
                    "serviceAccountName": names["service_account"],
                    "terminationGracePeriodSeconds": settings.drain_timeout_seconds
                    + DRAIN_SLACK_SECONDS,
                    # RuntimeDefault seccomp: with the container's context this meets the
                    # "restricted" Pod Security Standard.
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [_container(name, namespace, spec, settings)],
                    "volumes": volumes,
                },
            },
        },
    }


def build_service_account(name: str, namespace: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(resource_names(name)["service_account"], name, namespace),
    }


def build_role(name: str, namespace: str) -> Obj:
    """What a member needs and nothing more: its own group, its scale, events, pods."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(resource_names(name)["role"], name, namespace),
        "rules": [
            # Read its own ConsumerGroup (scaling bounds); status is the operator's.
            {
                "apiGroups": [API_GROUP],
                "resources": [PLURAL],
                "resourceNames": [name],
                "verbs": ["get"],
            },
            # The leader scales the group through the scale subresource; the operator
            # then moves the Deployment. No other group's scale, no Deployment access.
            {
                "apiGroups": [API_GROUP],
                "resources": [f"{PLURAL}/scale"],
                "resourceNames": [name],
                "verbs": ["get", "patch", "update"],
            },
            # Scaling decisions as Events. RBAC cannot restrict create by name, and Event
            # names are generated anyway.
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
            {
                "apiGroups": ["events.k8s.io"],
                "resources": ["events"],
                "verbs": ["create", "patch"],
            },
            # The leader reads its members' pods, and patches pod-deletion-cost on them so
            # that a scale-down removes the member it has already drained. Pod names are
            # generated by the ReplicaSet, so resourceNames cannot narrow this.
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]},
        ],
    }


def build_role_binding(name: str, namespace: str) -> Obj:
    names = resource_names(name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(names["role_binding"], name, namespace),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": names["role"],
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": names["service_account"], "namespace": namespace}
        ],
    }


def build_pdb(name: str, namespace: str, spec: Spec) -> Obj:
    # spec: unused today; taken so that the spec-driven builders share one signature.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(resource_names(name)["pdb"], name, namespace),
        "spec": {
            # One member drains at a time: each hand-over finishes before the next starts
            # (seed 000: one group at a time, smooth master switch).
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector(name)},
            # An unready pod is not a member and owns no partitions: evicting it loses
            # nothing, and it must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def children(
    name: str,
    namespace: str,
    spec: Spec,
    settings: OperatorSettings,
    etcd_secret_version: str | None = None,
) -> list[Obj]:
    """Every child, in apply order: identity and permissions before the pods that use them."""
    return [
        build_service_account(name, namespace),
        build_role(name, namespace),
        build_role_binding(name, namespace),
        build_deployment(name, namespace, spec, settings, etcd_secret_version),
        build_pdb(name, namespace, spec),
    ]
