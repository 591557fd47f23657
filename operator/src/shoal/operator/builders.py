"""Pure builders: a ConsumerGroup's spec -> the Kubernetes objects that run its members.

Every function takes plain values (the spec as the API server returns it, or its model,
shoal.contracts.spec.ConsumerGroupSpec) and returns plain dicts: no I/O, no client
objects, no ownerReferences (the handlers adopt children with kopf.adopt). Missing
optional fields take the model's defaults, which are the CRD's.

The pods' configuration is derived once (:func:`pod_config`, a GroupConfig) and rendered
into their environment (shoal.group.config.config_env), so the operator and its pods
read the same values. A spec the consumer could never run with (a group name that is not
a NATS subject token, an invalid subject prefix, no handler) is a ValueError here, before
any pod crash-loops on it; the handlers turn it into kopf.PermanentError.
"""

from __future__ import annotations

import copy
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from shoal.contracts.names import (
    API_GROUP,
    CONSUMER_APP_NAME,
    CONSUMER_CONTAINER_NAME,
    CPU_LIMIT_ENV,
    ETCD_SECRET_VERSION_ANNOTATION,
    GROUP_LABEL,
    LIVE_PATH,
    NATS_CREDENTIALS_SECRET_VERSION_ANNOTATION,
    NATS_TLS_SECRET_VERSION_ANNOTATION,
    PLURAL,
    READY_PATH,
    check_token,
    member_inbox_prefix,
)
from shoal.contracts.spec import ConsumerGroupSpec, parse_spec
from shoal.group.config import ENV_VARS, GroupConfig, config_env, group_config
from shoal.operator.settings import OperatorSettings

Obj = dict[str, Any]
Spec = Mapping[str, Any] | ConsumerGroupSpec

CONTAINER_NAME = CONSUMER_CONTAINER_NAME
COMMAND = ["shoal-consumer", "run"]
# The probes: standard-library-only checks (shoal.consumer.ready) of the state file the
# member rewrites every second, cheap enough to run every 2 s.
READY_COMMAND = ["shoal-ready"]
LIVE_COMMAND = ["shoal-ready", "--live"]
# Pod-template annotation: the etcd tlsSecret version the pods were started with.
ETCD_SECRET_VERSION = ETCD_SECRET_VERSION_ANNOTATION

# Beyond the consumer's own drain timeout: time to release the last partitions, let the
# next owners claim them and leave etcd before the kubelet sends SIGKILL.
DRAIN_SLACK_SECONDS = 15

# Per pod, not just per container: on the local plane's process kubelet every "pod" shares
# the host's /tmp. $(POD_NAME) only expands because POD_NAME comes earlier in env.
READY_FILE = "/tmp/shoal/$(POD_NAME)/ready"

# spec.nats.credentialsSecret, in one of three forms (NatsPodSecrets.credentials): a
# credentials file (key creds) or an nkey seed (key nkey), mounted; or a user and
# password (keys user, password), passed as env from the Secret, never as plain values.
NATS_CREDS_DIR = "/etc/shoal/nats"
NATS_CREDS_KEY = "creds"
NATS_CREDS_FILE = f"{NATS_CREDS_DIR}/{NATS_CREDS_KEY}"
NATS_NKEY_KEY = "nkey"
NATS_NKEY_FILE = f"{NATS_CREDS_DIR}/{NATS_NKEY_KEY}"
NATS_USER_KEY, NATS_PASSWORD_KEY = "user", "password"
NATS_AUTH_KEYS = {"nats_user": NATS_USER_KEY, "nats_password": NATS_PASSWORD_KEY}

# spec.nats.tlsSecret: ca.crt always; tls.crt and tls.key when the servers verify clients.
NATS_TLS_DIR = "/etc/shoal/nats-tls"
NATS_CA_KEY, NATS_CERT_KEY, NATS_KEY_KEY = "ca.crt", "tls.crt", "tls.key"
NATS_TLS_FILES = {  # GroupConfig field -> key in the Secret (and file name in NATS_TLS_DIR)
    "nats_ca_file": NATS_CA_KEY,
    "nats_cert_file": NATS_CERT_KEY,
    "nats_key_file": NATS_KEY_KEY,
}
# Pod-template annotations: the NATS Secrets' versions the pods were started with.
NATS_TLS_SECRET_VERSION = NATS_TLS_SECRET_VERSION_ANNOTATION
NATS_CREDENTIALS_SECRET_VERSION = NATS_CREDENTIALS_SECRET_VERSION_ANNOTATION

CredentialsForm = Literal["creds", "user", "nkey"]


@dataclass(frozen=True)
class NatsPodSecrets:
    """What the operator found in a group's NATS Secrets (shoal.operator.natssecret): the
    pods' mounts and env follow it, and its versions go into the pod template, so that a
    new version rolls the pods. The defaults are what a spec alone says (a credentials
    file; a client certificate with the CA), for builders called without reading them."""

    credentials: CredentialsForm = "creds"
    client_certificate: bool = True
    tls_version: str | None = None
    credentials_version: str | None = None


# spec.etcd.tlsSecret: a kubernetes.io/tls-style Secret. The three files are required (the
# mount fails with a clear event without them); username and password are optional keys.
ETCD_TLS_DIR = "/etc/shoal/etcd"
ETCD_CA_KEY, ETCD_CERT_KEY, ETCD_KEY_KEY = "ca.crt", "tls.crt", "tls.key"
ETCD_TLS_FILES = {  # GroupConfig field -> key in the Secret (and file name in ETCD_TLS_DIR)
    "etcd_ca_file": ETCD_CA_KEY,
    "etcd_cert_file": ETCD_CERT_KEY,
    "etcd_key_file": ETCD_KEY_KEY,
}
ETCD_AUTH_KEYS = {"etcd_username": "username", "etcd_password": "password"}

# What the pods' environment carries, in this order (the rest are the consumer's defaults).
POD_FIELDS = (
    "namespace",
    "group",
    "partitions",
    "nats_url",
    "etcd_endpoints",
    "subject_prefix",
    "stream",
    "stream_replicas",
    "retention",
    "storage",
    "ledger",
    "handler",
    "handler_ready_path",
    "handler_socket",
    "ack_wait",
    "max_ack_pending",
    "max_deliver",
    "backoff",
    "max_concurrency",
    "retry_policy",
    "handler_timeout",
    "max_messages_per_second",
    "order_after_failure",
    "stall_after",
    "drain_timeout",
    "ready_file",
    "ensure_jetstream",
    "autoscaler",
    "strategy",
    "load_aware",
    "nats_creds_file",
    "nats_nkey_seed_file",
    *NATS_TLS_FILES,
    "nats_inbox_prefix",
    "metrics_port",
    "health_port",
    *ETCD_TLS_FILES,
)

# The container port the consumers serve /metrics on (the chart's PodMonitor scrapes it).
METRICS_PORT_NAME = "metrics"
# The container port the consumers answer their HTTP probes on (consumer/healthport.py).
HEALTH_PORT_NAME = "health"


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
    return {GROUP_LABEL: name, "app.kubernetes.io/name": CONSUMER_APP_NAME}


def selector_string(name: str) -> str:
    """The selector in label-query form, for status.selector (the scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector(name).items()))


# Who made a group's children (their `app.kubernetes.io/managed-by`; deployments.py watches by it).
MANAGED_BY = "shoal-operator"


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": CONSUMER_APP_NAME,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "consumer",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        GROUP_LABEL: name,
    }


# -- the consumer's configuration and environment ---------------------------------------------


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


def pod_config(
    name: str,
    namespace: str,
    spec: Spec,
    settings: OperatorSettings,
    member_id: str = "shoal-operator",
    nats: NatsPodSecrets | None = None,
) -> GroupConfig:
    """The consumers' configuration, derived from the spec and the operator's settings.

    The operator uses it too (stream, durables, etcd keys), but not for its own NATS
    connection: the file paths here exist only in the pods (shoal.operator.natssecret
    reads the group's Secrets instead). In the pods the member id is the pod's name
    instead of `member_id`. The NATS user and password are not here: they reach the pods
    from the Secret (consumer_env).
    """
    check_token(namespace, "namespace")
    check_token(name, "ConsumerGroup name")
    model = parse_spec(spec)
    nats = nats or NatsPodSecrets()
    files: dict[str, Any] = {}
    if model.nats.credentials_secret:
        if nats.credentials == "creds":
            files["nats_creds_file"] = NATS_CREDS_FILE
        elif nats.credentials == "nkey":
            files["nats_nkey_seed_file"] = NATS_NKEY_FILE
    if model.nats.tls_secret:
        files["nats_ca_file"] = f"{NATS_TLS_DIR}/{NATS_CA_KEY}"
        if nats.client_certificate:
            files["nats_cert_file"] = f"{NATS_TLS_DIR}/{NATS_CERT_KEY}"
            files["nats_key_file"] = f"{NATS_TLS_DIR}/{NATS_KEY_KEY}"
    if model.etcd.tls_secret:
        files.update({field: f"{ETCD_TLS_DIR}/{key}" for field, key in ETCD_TLS_FILES.items()})
    config = group_config(
        namespace,
        name,
        model,
        nats_url=settings.nats_url,
        etcd_endpoints=settings.etcd_endpoints,
        member_id=member_id,
        drain_timeout=settings.drain_timeout_seconds,
        ready_file=READY_FILE,
        # The operator creates the stream and the durables: pods need no stream-admin
        # permissions and cannot race each other creating them.
        ensure_jetstream=False,
        # The leader reads spec.autoscaling itself on every round (it may be switched on
        # or off at any time) and scales through the group's scale subresource.
        autoscaler="kubernetes",
        metrics_port=settings.consumer_metrics_port,
        health_port=settings.consumer_health_port,
        **files,
    )
    # Replies under the group's own prefix, not nats-py's _INBOX shared by every client,
    # so that a NATS server can allow each group's members their own replies only
    # (shoal.consumer.permissions; `shoal-consumer permissions` prints the same prefix).
    inbox = member_inbox_prefix(config.namespace, config.group)
    return config.model_copy(update={"nats_inbox_prefix": inbox})


def _env(name: str, value: str) -> Obj:
    return {"name": name, "value": value}


def _field_env(name: str, field_path: str) -> Obj:
    # apiVersion spelled out: the API server would default it, and a desired object
    # equal to the stored one avoids spurious diffs.
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def _secret_env(field: str, secret: str, key: str, optional: bool = False) -> Obj:
    ref: Obj = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": ENV_VARS[field], "valueFrom": {"secretKeyRef": ref}}


def consumer_env(
    name: str,
    namespace: str,
    spec: Spec,
    settings: OperatorSettings,
    nats: NatsPodSecrets | None = None,
) -> list[Obj]:
    """The consumer container's env: what shoal.group.config.config_from_env reads."""
    model = parse_spec(spec)
    nats = nats or NatsPodSecrets()
    config = pod_config(name, namespace, model, settings, nats=nats)
    env = [
        _field_env("POD_NAME", "metadata.name"),
        # The member id is the pod name: `kubectl get pods` and etcd tell the same story.
        _field_env(ENV_VARS["member_id"], "metadata.name"),
    ]
    env += [_env(var, value) for var, value in config_env(config, POD_FIELDS).items()]
    cpu_limit = cpu_millicores(model.cpu_limit())
    if cpu_limit is not None:
        # What 100% CPU means for the autoscaler's cpuThreshold (shoal.consumer.cpu).
        env.append(_env(CPU_LIMIT_ENV, str(cpu_limit)))
    if model.etcd.tls_secret:
        env += [
            # optional: a Secret without these keys means no etcd authentication.
            _secret_env(field, model.etcd.tls_secret, key, optional=True)
            for field, key in ETCD_AUTH_KEYS.items()
        ]
    if model.nats.credentials_secret and nats.credentials == "user":
        # Not optional: the operator checked that both keys are there.
        env += [
            _secret_env(field, model.nats.credentials_secret, key)
            for field, key in NATS_AUTH_KEYS.items()
        ]

    # The user's variables go last so that they win. Ours that they name are dropped rather
    # than listed twice: duplicate names draw API warnings and break server-side apply.
    user = [copy.deepcopy(dict(var)) for var in model.env]
    overridden = {var.get("name") for var in user}
    return [var for var in env if var["name"] not in overridden] + user


# -- children ----------------------------------------------------------------------------------


def _metadata(child: str, name: str, namespace: str) -> Obj:
    return {"name": child, "namespace": namespace, "labels": labels(name)}


def _volumes(spec: ConsumerGroupSpec, nats: NatsPodSecrets) -> tuple[list[Obj], list[Obj]]:
    """(pod volumes, container mounts)."""
    # A read-only root filesystem still needs a writable /tmp (the ready file, Python).
    volumes: list[Obj] = [{"name": "tmp", "emptyDir": {}}]
    mounts: list[Obj] = [{"name": "tmp", "mountPath": "/tmp"}]
    secret = spec.nats.credentials_secret
    if secret and nats.credentials != "user":
        # Only the key we point NATS_CREDS_FILE (or NATS_NKEY_SEED_FILE) at: a secret
        # without it fails the mount with a clear event instead of a consumer that cannot
        # find its file. A user and password come as env instead (consumer_env).
        key = NATS_CREDS_KEY if nats.credentials == "creds" else NATS_NKEY_KEY
        volumes.append(
            {
                "name": "nats-credentials",
                "secret": {"secretName": secret, "items": [{"key": key, "path": key}]},
            }
        )
        mounts.append({"name": "nats-credentials", "mountPath": NATS_CREDS_DIR, "readOnly": True})
    nats_tls = spec.nats.tls_secret
    if nats_tls:
        keys = [NATS_CA_KEY, NATS_CERT_KEY, NATS_KEY_KEY]
        volumes.append(
            {
                "name": "nats-tls",
                "secret": {
                    "secretName": nats_tls,
                    "items": [
                        {"key": key, "path": key}
                        for key in (keys if nats.client_certificate else keys[:1])
                    ],
                },
            }
        )
        mounts.append({"name": "nats-tls", "mountPath": NATS_TLS_DIR, "readOnly": True})
    etcd_secret = spec.etcd.tls_secret
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
    socket_mount = handler_socket_mount(spec)
    if socket_mount is not None and socket_mount["name"] != "tmp":
        volumes.append({"name": socket_mount["name"], "emptyDir": {}})
        mounts.append(socket_mount)
    return volumes, mounts


def _same_path(mount_path: object, directory: str) -> bool:
    """Whether a mountPath as written ('/run/h/', '/run//h') is `directory`."""
    return isinstance(mount_path, str) and posixpath.normpath(mount_path) == directory


def handler_socket_mount(spec: ConsumerGroupSpec) -> Obj | None:
    """The mount of spec.handlerSocket's directory, which the member and every sidecar
    share (an emptyDir; /tmp's own when the socket is in /tmp): the sidecar creates the
    socket there and the member connects to it. None without a socket."""
    if not spec.handler_socket:
        return None
    directory = posixpath.dirname(spec.handler_socket)
    name = "tmp" if directory == "/tmp" else "handler-socket"
    return {"name": name, "mountPath": directory}


def _ports(settings: OperatorSettings) -> Obj:
    named = (
        # (Metrics None: off; 0: any free port, nothing to declare.)
        (METRICS_PORT_NAME, settings.consumer_metrics_port),
        (HEALTH_PORT_NAME, settings.consumer_health_port),
    )
    ports = [
        {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in named if port
    ]
    return {"ports": ports} if ports else {}


def _probe_action(settings: OperatorSettings, live: bool) -> Obj:
    """What a probe runs: GET /readyz or /livez on the health port where the operator has
    one (consumer/healthport.py: shoal-ready's answers, without a process per probe),
    else `shoal-ready` itself."""
    if settings.consumer_health_port:
        path = LIVE_PATH if live else READY_PATH
        return {"httpGet": {"path": path, "port": HEALTH_PORT_NAME}}
    return {"exec": {"command": list(LIVE_COMMAND if live else READY_COMMAND)}}


def _container(
    name: str,
    namespace: str,
    spec: ConsumerGroupSpec,
    settings: OperatorSettings,
    nats: NatsPodSecrets,
) -> Obj:
    _, mounts = _volumes(spec, nats)
    return {
        "name": CONTAINER_NAME,
        "image": spec.image or settings.default_image,
        "imagePullPolicy": spec.image_pull_policy or settings.image_pull_policy,
        "command": list(COMMAND),
        "env": consumer_env(name, namespace, spec, settings, nats),
        "resources": copy.deepcopy(spec.resources),
        **_ports(settings),
        # Ready = joined, not fenced, reaching NATS, and the state refreshed within 5 s
        # (the member rewrites SHOAL_READY_FILE every second), so a rollout waits for each
        # new member before replacing the next one, and a member fenced for good, cut
        # from NATS or frozen shows as unready. Timeout 2 s, not 1: an exec probe starts a
        # Python process, and one slow start must not fail a probe that tolerates no
        # failures.
        "readinessProbe": {
            **_probe_action(settings, live=False),
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 1,
        },
        # Alive = the event loop refreshed the state within 60 s (shoal-ready --live).
        # Never tied to etcd or NATS: during their outage every member stalls and
        # recovers by itself, and restarting every pod would only add re-joins and
        # hand-overs to the outage. A stuck loop is restarted 80-90 s after it stopped;
        # start-up (before the first write) gets 30 s more.
        "livenessProbe": {
            **_probe_action(settings, live=True),
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        # A member that fails says why in its last log line (a traceback's last line, a
        # refused setting): the kubelet keeps the end of the log as the termination
        # message, which `kubectl describe pod` shows and MembersCrashLooping quotes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
    }


def sidecars(spec: ConsumerGroupSpec) -> Obj:
    """spec.containers as the pod's native sidecars: init containers with restartPolicy
    Always, in the order listed. Kubernetes starts them one after another before the
    member's container (each once it has started: its startupProbe succeeded, or it is
    running if it has none), restarts them whenever they exit, and stops them after the
    member, in reverse order, within the pod's grace period; the pod is Ready only when
    their readiness probes pass too. Copied as written otherwise (the API server
    validates them in the pod template). Empty when there are none, so that the applied
    pod template equals the stored one."""
    if not spec.containers:
        return {}
    socket_mount = handler_socket_mount(spec)
    containers = []
    for container in spec.containers:
        rendered = copy.deepcopy(container)
        rendered["restartPolicy"] = "Always"
        if socket_mount is not None:
            # spec.handlerSocket's directory, unless the container mounts something there
            # itself (then it is the team's to share).
            mounts = list(rendered.get("volumeMounts") or [])
            where = socket_mount["mountPath"]
            if not any(_same_path(m.get("mountPath"), where) for m in mounts):
                mounts.append(dict(socket_mount))
            rendered["volumeMounts"] = mounts
        containers.append(rendered)
    return {"initContainers": containers}


# The taints the node lifecycle controller puts on a silent or failing node, whose
# NoExecute effect evicts the pods that do not tolerate them (long enough).
NODE_LOSS_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def _tolerates_eviction(toleration: Obj, key: str) -> bool:
    """Whether the user's toleration decides how long a pod stays on a node with `key`'s
    NoExecute taint: it names that key (or, operator Exists without a key, every key) and
    the NoExecute effect (or every effect)."""
    keyed = toleration.get("key") == key or (
        not toleration.get("key") and toleration.get("operator") == "Exists"
    )
    return keyed and toleration.get("effect") in (None, "", "NoExecute")


def member_tolerations(spec: ConsumerGroupSpec) -> list[Obj]:
    """The user's tolerations, then, for each node-loss taint none of them covers, one
    for spec.nodeLossTolerationSeconds. Without ours, the DefaultTolerationSeconds
    admission plugin would give every pod 300 s: five minutes of a lost node's members
    counted as the group's while Shoal has long moved their work."""
    tolerations = copy.deepcopy(spec.tolerations)
    for key in NODE_LOSS_TAINTS:
        if not any(_tolerates_eviction(t, key) for t in spec.tolerations):
            tolerations.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": spec.node_loss_toleration_seconds,
                }
            )
    return tolerations


def _placement(name: str, spec: ConsumerGroupSpec) -> Obj:
    """The pod spec's scheduling fields the group sets (unset ones are left out, so the
    applied object equals the stored one and server-side apply sees no change)."""
    placement: Obj = {}
    if spec.node_selector:
        placement["nodeSelector"] = dict(spec.node_selector)
    # Never empty: the node-loss tolerations are always there (member_tolerations).
    placement["tolerations"] = member_tolerations(spec)
    if spec.affinity:
        placement["affinity"] = copy.deepcopy(spec.affinity)
    if spec.topology_spread_constraints:
        constraints = copy.deepcopy(spec.topology_spread_constraints)
        for constraint in constraints:
            # Without a labelSelector a constraint counts no pods at all, so it could never
            # spread anything; the group's own members are what people mean.
            constraint.setdefault("labelSelector", {"matchLabels": selector(name)})
        placement["topologySpreadConstraints"] = constraints
    if spec.priority_class_name:
        placement["priorityClassName"] = spec.priority_class_name
    return placement


def build_deployment(
    name: str,
    namespace: str,
    spec: Spec,
    settings: OperatorSettings,
    etcd_secret_version: str | None = None,
    nats: NatsPodSecrets | None = None,
) -> Obj:
    """The consumers' Deployment. `etcd_secret_version` (a digest of the tlsSecret's data)
    and the NATS Secrets' versions (`nats`) go into the pod template: members read their
    certificates and credentials once, at start, so a rotated Secret must roll the pods
    (one at a time, each hand-over lossless)."""
    names = resource_names(name)
    model = parse_spec(spec)
    nats = nats or NatsPodSecrets()
    volumes, _ = _volumes(model, nats)
    # The user's labels and annotations first, ours over them: the selector's labels must
    # stay (the Deployment would not own its pods otherwise), and so must the Secret
    # version that rolls the pods.
    template_meta: Obj = {"labels": {**model.pod_labels, **labels(name)}}
    annotations = dict(model.pod_annotations)
    if etcd_secret_version:
        annotations[ETCD_SECRET_VERSION] = etcd_secret_version
    if nats.tls_version and model.nats.tls_secret:
        annotations[NATS_TLS_SECRET_VERSION] = nats.tls_version
    if nats.credentials_version and model.nats.credentials_secret:
        annotations[NATS_CREDENTIALS_SECRET_VERSION] = nats.credentials_version
    if annotations:
        template_meta["annotations"] = annotations
    pod_spec: Obj = {
        "serviceAccountName": names["service_account"],
        "terminationGracePeriodSeconds": settings.drain_timeout_seconds + DRAIN_SLACK_SECONDS,
        # RuntimeDefault seccomp: with the container's context this meets the
        # "restricted" Pod Security Standard.
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        **sidecars(model),
        "containers": [_container(name, namespace, model, settings, nats)],
        "volumes": volumes,
        **_placement(name, model),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(names["deployment"], name, namespace),
        "spec": {
            "replicas": model.replicas,
            "selector": {"matchLabels": selector(name)},
            # Surge, never dip: a new member joins before an old one leaves, so a rollout
            # never runs below the group's capacity (the hand-over itself is lossless).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {"metadata": template_meta, "spec": pod_spec},
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
            # generated by the ReplicaSet, so resourceNames cannot narrow this; the chart's
            # ValidatingAdmissionPolicy (charts/shoal/templates/consumer-pod-policy.yaml)
            # does: only that annotation, only on this group's pods.
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
            # An unready pod has not joined, is fenced, or cannot reach NATS: it consumes
            # nothing (its partitions move, or wait for its lease to expire), so evicting
            # it loses nothing, and it must not block a node drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def children(
    name: str,
    namespace: str,
    spec: Spec,
    settings: OperatorSettings,
    etcd_secret_version: str | None = None,
    nats: NatsPodSecrets | None = None,
) -> list[Obj]:
    """Every child, in apply order: identity and permissions before the pods that use them."""
    return [
        build_service_account(name, namespace),
        build_role(name, namespace),
        build_role_binding(name, namespace),
        build_deployment(name, namespace, spec, settings, etcd_secret_version, nats),
        build_pdb(name, namespace, spec),
    ]
