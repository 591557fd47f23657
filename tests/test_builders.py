"""The operator's builders and settings, without any cluster.

The env tests go all the way to the consumer: they resolve the pod's environment as the
kubelet would (downward API, $(VAR) expansion) and feed it to config_from_env, so the
operator and the consumer cannot drift apart on a variable's name or format.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from shoal.consumer.permissions import member_permissions
from shoal.contracts.names import GROUP_LABEL, default_stream_name, default_subject_prefix
from shoal.group.config import ENV_FIELDS, GroupConfig, config_from_env
from shoal.operator.builders import (
    ETCD_SECRET_VERSION,
    NATS_CREDENTIALS_SECRET_VERSION,
    NATS_TLS_SECRET_VERSION,
    READY_FILE,
    NatsPodSecrets,
    build_deployment,
    build_pdb,
    build_role,
    build_role_binding,
    build_service_account,
    children,
    consumer_env,
    labels,
    pod_config,
    resource_names,
    selector,
    selector_string,
)
from shoal.operator.settings import OperatorSettings, settings_from_env

NAME = "orders"
NAMESPACE = "prod"
POD = "orders-consumer-7c9d8f-x2x5q"
HANDLER = "app.handlers:process"
SETTINGS = OperatorSettings()

# Variables the pod gets that config_from_env does not map to a field itself.
EXTRA_VARS = {
    "POD_NAME",
    "SHOAL_BACKOFF",
    "SHOAL_READY_FILE",
    "SHOAL_ENSURE_JETSTREAM",
    "NATS_CREDS_FILE",
    "SHOAL_CPU_LIMIT_MILLICORES",  # read by shoal.consumer.cpu
}


def full_spec() -> dict[str, Any]:
    return {
        "replicas": 4,
        "minReplicas": 2,
        "maxReplicas": 10,
        "partitions": 64,
        "image": "registry.example/shoal:1.2.3",
        "imagePullPolicy": "Always",
        "handler": HANDLER,
        "handlerReadyPath": "/healthz",
        "env": [{"name": "USER_VAR", "value": "x"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
        "nats": {
            "url": "nats://nats.messaging:4222",
            "credentialsSecret": "orders-nats",
            "tlsSecret": "orders-nats-tls",
            "subjectPrefix": "acme.orders",
            "stream": {"name": "ORDERS", "retention": "limits", "storage": "memory", "replicas": 3},
            "consumer": {
                "ackWaitSeconds": 30,
                "maxAckPending": 500,
                "maxDeliver": 7,
                "backoffSeconds": [1, 2.5, 10],
                "maxMessagesPerSecond": 2000,
            },
        },
        "etcd": {"endpoints": "etcd-0.etcd:2379,etcd-1.etcd:2379", "tlsSecret": "orders-etcd"},
        "autoscaling": {"enabled": True},
        "assignment": {"strategy": "sticky", "loadAware": False},
        "deletionPolicy": "Delete",
    }


def minimal_spec() -> dict[str, Any]:
    return {"handler": HANDLER}


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolve(
    env: list[dict[str, Any]],
    pod: str = POD,
    namespace: str = NAMESPACE,
    secrets: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, str]:
    """The container's environment as the kubelet makes it: fieldRefs from the pod,
    secretKeyRefs from `secrets` (name -> key -> value; an optional ref to a missing
    key is left out), $(VAR) expanded from variables defined earlier in the list, $$ for a
    literal $."""
    fields = {"metadata.name": pod, "metadata.namespace": namespace}
    out: dict[str, str] = {}

    def expand(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return out.get(match.group(1), match.group(0))

    for var in env:
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = (secrets or {}).get(ref["name"], {}).get(ref["key"])
            if value is None and not ref.get("optional"):
                raise KeyError(f"secret {ref['name']} has no key {ref['key']}")
            if value is not None:
                out[var["name"]] = value
        elif "valueFrom" in var:
            out[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[var["name"]] = _REF.sub(expand, var.get("value", ""))
    return out


def config_of(spec: Mapping[str, Any], name: str = NAME, namespace: str = NAMESPACE) -> GroupConfig:
    return config_from_env(
        resolve(consumer_env(name, namespace, spec, SETTINGS), namespace=namespace)
    )


def env_names(env: list[dict[str, Any]]) -> list[str]:
    return [var["name"] for var in env]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return result


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod_spec(deployment)["containers"]
    result: dict[str, Any] = only
    return result


# -- names and labels ------------------------------------------------------------------------


def test_every_child_is_named_after_the_group() -> None:
    assert resource_names(NAME) == {
        "deployment": "orders-consumer",
        "service_account": "orders-consumer",
        "role": "orders-consumer",
        "role_binding": "orders-consumer",
        "pdb": "orders-consumer",
    }


def test_labels_are_the_standard_ones_plus_the_group() -> None:
    assert labels(NAME) == {
        "app.kubernetes.io/name": "shoal-consumer",
        "app.kubernetes.io/instance": NAME,
        "app.kubernetes.io/component": "consumer",
        "app.kubernetes.io/managed-by": "shoal-operator",
        "shoal.dev/group": NAME,
    }


def test_selector_is_part_of_the_labels_and_its_string_parses_back() -> None:
    assert selector(NAME).items() <= labels(NAME).items()
    text = selector_string(NAME)
    assert text == "app.kubernetes.io/name=shoal-consumer,shoal.dev/group=orders"
    assert dict(pair.split("=", 1) for pair in text.split(",")) == selector(NAME)


def test_selectors_of_two_groups_do_not_overlap() -> None:
    assert selector("a").items() - selector("b").items()


def test_derived_names_come_from_the_consumer_package() -> None:
    plain = pod_config(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    assert plain.subject_prefix == default_subject_prefix(NAMESPACE, NAME)
    assert plain.stream == default_stream_name(NAMESPACE, NAME)
    full = pod_config(NAME, NAMESPACE, full_spec(), SETTINGS)
    assert (full.subject_prefix, full.stream) == ("acme.orders", "ORDERS")


# -- the consumer's environment --------------------------------------------------------------


def test_full_spec_env_is_accepted_by_the_consumer() -> None:
    config = config_of(full_spec())
    assert config.group == NAME
    assert config.namespace == NAMESPACE
    assert config.member_id == POD
    assert config.partitions == 64
    assert config.nats_url == "nats://nats.messaging:4222"
    assert config.etcd_endpoints == "etcd-0.etcd:2379,etcd-1.etcd:2379"
    assert config.subject_prefix == "acme.orders"
    assert config.stream == "ORDERS"
    assert config.stream_replicas == 3
    assert config.retention == "limits"
    assert config.storage == "memory"
    assert config.handler == HANDLER
    assert config.ack_wait == 30
    assert config.max_ack_pending == 500
    assert config.max_deliver == 7
    assert config.backoff == (1.0, 2.5, 10.0)
    assert config.max_messages_per_second == 2000
    assert config.drain_timeout == SETTINGS.drain_timeout_seconds


def test_missing_sections_give_the_documented_defaults() -> None:
    config = config_of(minimal_spec())
    assert config.partitions == 128
    assert config.subject_prefix == "shoal.prod.orders"
    assert config.stream == "shoal_prod_orders"
    assert config.stream_replicas == 1
    assert config.retention == "workqueue"
    assert config.storage == "file"
    assert config.ack_wait == 5
    assert config.max_ack_pending == 1000
    assert config.max_deliver == 5
    assert config.backoff == ()
    assert config.max_messages_per_second is None


def test_empty_and_null_sections_count_as_missing() -> None:
    spec: dict[str, Any] = {
        "handler": HANDLER,
        "image": "",
        "env": None,
        "resources": None,
        "nats": {"url": "", "subjectPrefix": "", "stream": None, "consumer": {}},
        "etcd": None,
    }
    env = resolve(consumer_env(NAME, NAMESPACE, spec, SETTINGS))
    assert env["NATS_URL"] == SETTINGS.nats_url
    assert env["SHOAL_SUBJECT_PREFIX"] == "shoal.prod.orders"
    assert config_of(spec).stream == "shoal_prod_orders"
    deployment = build_deployment(NAME, NAMESPACE, spec, SETTINGS)
    assert container(deployment)["image"] == SETTINGS.default_image
    assert container(deployment)["resources"] == {}


def test_nats_and_etcd_fall_back_to_the_operator_settings() -> None:
    custom = OperatorSettings(nats_url="nats://elsewhere:4222", etcd_endpoints="e1:2379")
    env = resolve(consumer_env(NAME, NAMESPACE, minimal_spec(), custom))
    assert env["NATS_URL"] == "nats://elsewhere:4222"
    assert env["ETCD_ENDPOINTS"] == "e1:2379"
    full = resolve(consumer_env(NAME, NAMESPACE, full_spec(), custom))
    assert full["NATS_URL"] == "nats://nats.messaging:4222"


def test_etcd_endpoints_as_a_list_become_a_comma_list() -> None:
    spec = {**minimal_spec(), "etcd": {"endpoints": ["a:2379", "b:2379"]}}
    assert config_of(spec).etcd_endpoints == "a:2379,b:2379"


def test_member_id_and_pod_name_come_from_the_downward_api() -> None:
    env = consumer_env(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    by_name = {var["name"]: var for var in env}
    for var in ("POD_NAME", "SHOAL_MEMBER_ID"):
        assert by_name[var]["valueFrom"] == {
            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}
        }


def test_ready_file_is_per_pod_and_pod_name_is_defined_before_it() -> None:
    env = consumer_env(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    names = env_names(env)
    assert names.index("POD_NAME") < names.index("SHOAL_READY_FILE")
    assert resolve(env)["SHOAL_READY_FILE"] == f"/tmp/shoal/{POD}/ready"
    assert READY_FILE.startswith("/tmp/")  # on the writable emptyDir


def test_the_operator_owns_jetstream() -> None:
    env = resolve(consumer_env(NAME, NAMESPACE, minimal_spec(), SETTINGS))
    assert env["SHOAL_ENSURE_JETSTREAM"] == "false"


def test_every_variable_is_one_the_consumer_knows() -> None:
    names = env_names(consumer_env(NAME, NAMESPACE, {**full_spec(), "env": []}, SETTINGS))
    assert set(names) <= set(ENV_FIELDS) | EXTRA_VARS
    tuning = {
        "SHOAL_LEASE_TTL",
        "SHOAL_KEEPALIVE_INTERVAL",
        "SHOAL_METRICS_PORT",
        "SHOAL_HEALTH_PORT",  # only where the operator has a health port (exec probes else)
        "SHOAL_MAX_BUFFERED",
        "SHOAL_NATS_RECONNECT_BUFFER",  # nats-py's default unless spec.env sets it
        "SHOAL_DOZE_SWEEP",
        "SHOAL_MALLOC_TRIM_INTERVAL",  # once a minute unless spec.env sets it
        # Only for members in another account than the streams' (spec.env sets it;
        # `shoal-consumer permissions --accounts`): the default needs no variable.
        "NATS_JS_API_PREFIX",
    }
    # The other two forms of NATS credentials (a user and password, an nkey seed): the
    # full spec's Secret holds a credentials file (the tests below show the other forms).
    other_forms = {"NATS_USER", "NATS_PASSWORD", "NATS_NKEY_SEED_FILE"}
    # A socket needs an http:// handler, which the full spec does not have (below).
    other_forms.add("SHOAL_HANDLER_SOCKET")
    needed = set(ENV_FIELDS) - tuning - {"SHOAL_STATS_INTERVAL", "SHOAL_LOAD_CHECK_INTERVAL"}
    assert needed - other_forms <= set(names)


SOCKET_SPEC: dict[str, Any] = {
    "handler": "http://localhost/messages",
    "handlerSocket": "/run/handler/http.sock",
    "containers": [
        {"name": "service", "image": "team/service:1"},
        # Mounts something of its own there: the team's to share, left as it is.
        {
            "name": "other",
            "image": "team/other:1",
            "volumeMounts": [{"name": "mine", "mountPath": "/run/handler"}],
        },
    ],
}


def test_the_handler_socket_directory_is_shared_with_the_sidecars() -> None:
    dep = build_deployment(NAME, NAMESPACE, SOCKET_SPEC, SETTINGS)
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "handler-socket", "emptyDir": {}} in pod["volumes"]
    shared = {"name": "handler-socket", "mountPath": "/run/handler"}
    (consumer,) = pod["containers"]
    assert shared in consumer["volumeMounts"]
    service, other = pod["initContainers"]
    assert service["volumeMounts"] == [shared]
    assert other["volumeMounts"] == [{"name": "mine", "mountPath": "/run/handler"}]
    env = {var["name"]: var.get("value") for var in consumer["env"]}
    assert env["SHOAL_HANDLER_SOCKET"] == "/run/handler/http.sock"
    assert env["SHOAL_HANDLER"] == "http://localhost/messages"
    # The spec as stored is not changed by rendering it.
    assert "volumeMounts" not in SOCKET_SPEC["containers"][0]


def test_a_handler_socket_in_tmp_shares_the_tmp_volume() -> None:
    spec = {**SOCKET_SPEC, "handlerSocket": "/tmp/http.sock"}
    pod = build_deployment(NAME, NAMESPACE, spec, SETTINGS)["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]].count("tmp") == 1
    assert "handler-socket" not in [v["name"] for v in pod["volumes"]]
    (consumer,) = pod["containers"]
    assert [m["mountPath"] for m in consumer["volumeMounts"]].count("/tmp") == 1
    assert pod["initContainers"][0]["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_a_sidecar_with_null_or_other_spelled_mounts() -> None:
    """volumeMounts: null (as YAML may write it) gets the socket's mount; a mount of
    the same directory written with a trailing slash is the team's, left alone."""
    spec = copy.deepcopy(SOCKET_SPEC)
    spec["containers"][0]["volumeMounts"] = None
    spec["containers"][1]["volumeMounts"] = [{"name": "mine", "mountPath": "/run/handler/"}]
    pod = build_deployment(NAME, NAMESPACE, spec, SETTINGS)["spec"]["template"]["spec"]
    service, other = pod["initContainers"]
    assert service["volumeMounts"] == [{"name": "handler-socket", "mountPath": "/run/handler"}]
    assert other["volumeMounts"] == [{"name": "mine", "mountPath": "/run/handler/"}]


def test_no_handler_socket_no_volume() -> None:
    pod = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS)["spec"]["template"]["spec"]
    assert "handler-socket" not in [v["name"] for v in pod["volumes"]]
    env = {var["name"] for var in pod["containers"][0]["env"]}
    assert "SHOAL_HANDLER_SOCKET" not in env


def test_env_values_are_strings_and_names_unique() -> None:
    for spec in (minimal_spec(), full_spec()):
        env = consumer_env(NAME, NAMESPACE, spec, SETTINGS)
        assert len(set(env_names(env))) == len(env)
        assert all(isinstance(var["value"], str) for var in env if "value" in var)


def test_integral_floats_lose_their_fraction_so_int_fields_parse() -> None:
    spec = {
        "handler": HANDLER,
        "partitions": 16.0,
        "nats": {"consumer": {"ackWaitSeconds": 0.5, "maxDeliver": 3.0, "maxAckPending": 10.0}},
    }
    env = resolve(consumer_env(NAME, NAMESPACE, spec, SETTINGS))
    assert (env["SHOAL_PARTITIONS"], env["SHOAL_MAX_DELIVER"]) == ("16", "3")
    assert env["SHOAL_ACK_WAIT"] == "0.5"
    assert config_of(spec).max_ack_pending == 10


@pytest.mark.parametrize(
    ("backoff", "expected"), [(None, None), ([], None), ([1, 2.5, 10], "1,2.5,10")]
)
def test_backoff_only_when_set(backoff: list[float] | None, expected: str | None) -> None:
    spec = {"handler": HANDLER, "nats": {"consumer": {"backoffSeconds": backoff}}}
    assert resolve(consumer_env(NAME, NAMESPACE, spec, SETTINGS)).get("SHOAL_BACKOFF") == expected


@pytest.mark.parametrize(("rate", "expected"), [(None, None), (200, "200"), (0.5, "0.5")])
def test_max_messages_per_second_only_when_set(rate: float | None, expected: str | None) -> None:
    # Unset is no limit: the pods get no variable, and their config none either.
    spec = {"handler": HANDLER, "nats": {"consumer": {"maxMessagesPerSecond": rate}}}
    env = resolve(consumer_env(NAME, NAMESPACE, spec, SETTINGS))
    assert env.get("SHOAL_MAX_MESSAGES_PER_SECOND") == expected
    assert config_from_env(env).max_messages_per_second == rate


def test_user_env_comes_last_and_overrides() -> None:
    user = [
        {"name": "SHOAL_HANDLER", "value": "other.module:fn"},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "GREETING", "value": "group $(SHOAL_GROUP)"},
    ]
    env = consumer_env(NAME, NAMESPACE, {**minimal_spec(), "env": user}, SETTINGS)
    assert env[-3:] == user
    assert env_names(env).count("SHOAL_HANDLER") == 1
    # resolve() knows no secrets; the secret ref itself is checked by env[-3:] above.
    plain = [var for var in env if var["name"] != "FROM_SECRET"]
    assert resolve(plain)["GREETING"] == "group orders"  # ours are defined before theirs
    assert config_from_env(resolve(plain)).handler == "other.module:fn"


def test_builders_do_not_alias_or_mutate_the_spec() -> None:
    spec = full_spec()
    before = copy.deepcopy(spec)
    deployment = build_deployment(NAME, NAMESPACE, spec, SETTINGS)
    container(deployment)["env"][-1]["value"] = "changed"
    container(deployment)["resources"]["requests"]["cpu"] = "9"
    assert spec == before


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        ("a.b", minimal_spec(), "ConsumerGroup name"),
        (NAME, {"handler": ""}, "spec.handler must look like 'package.module:function'"),
        (NAME, {}, "spec.handler is required"),
        (NAME, {"handler": HANDLER, "nats": {"subjectPrefix": "a..b"}}, "subject prefix"),
        (NAME, {"handler": HANDLER, "nats": {"subjectPrefix": "a.*"}}, "subject prefix"),
    ],
)
def test_specs_the_consumer_cannot_run_are_rejected_up_front(
    name: str, spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_deployment(name, NAMESPACE, spec, SETTINGS)


# -- credentials -----------------------------------------------------------------------------


def test_credentials_secret_is_mounted_read_only_and_named_in_env() -> None:
    deployment = build_deployment(NAME, NAMESPACE, full_spec(), SETTINGS)
    volumes = {volume["name"]: volume for volume in pod_spec(deployment)["volumes"]}
    assert volumes["nats-credentials"]["secret"] == {
        "secretName": "orders-nats",
        "items": [{"key": "creds", "path": "creds"}],
    }
    mounts = {mount["name"]: mount for mount in container(deployment)["volumeMounts"]}
    assert mounts["nats-credentials"] == {
        "name": "nats-credentials",
        "mountPath": "/etc/shoal/nats",
        "readOnly": True,
    }
    env = resolve(container(deployment)["env"])
    assert env["NATS_CREDS_FILE"] == "/etc/shoal/nats/creds"


def test_no_credentials_secret_no_volume_no_env() -> None:
    deployment = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    assert [volume["name"] for volume in pod_spec(deployment)["volumes"]] == ["tmp"]
    names = env_names(container(deployment)["env"])
    assert "NATS_CREDS_FILE" not in names
    assert not [name for name in names if name.startswith("ETCD_") and name != "ETCD_ENDPOINTS"]


def etcd_tls_spec(**etcd: Any) -> dict[str, Any]:
    return {**minimal_spec(), "etcd": {"tlsSecret": "orders-etcd", **etcd}}


def test_etcd_tls_secret_is_mounted_read_only_with_exactly_the_files() -> None:
    deployment = build_deployment(NAME, NAMESPACE, etcd_tls_spec(), SETTINGS)
    volumes = {volume["name"]: volume for volume in pod_spec(deployment)["volumes"]}
    # Listed items: a Secret without one of them fails the mount with a clear event; the
    # username and password are not files.
    assert volumes["etcd-tls"]["secret"] == {
        "secretName": "orders-etcd",
        "items": [
            {"key": "ca.crt", "path": "ca.crt"},
            {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"},
        ],
    }
    mounts = {mount["name"]: mount for mount in container(deployment)["volumeMounts"]}
    assert mounts["etcd-tls"] == {
        "name": "etcd-tls",
        "mountPath": "/etc/shoal/etcd",
        "readOnly": True,
    }


def test_etcd_tls_env_points_at_the_mounted_files_and_the_secrets_credentials() -> None:
    env = consumer_env(NAME, NAMESPACE, etcd_tls_spec(), SETTINGS)
    by_name = {var["name"]: var for var in env}
    for var in ("ETCD_USERNAME", "ETCD_PASSWORD"):
        key = var.removeprefix("ETCD_").lower()
        assert by_name[var]["valueFrom"] == {
            "secretKeyRef": {"name": "orders-etcd", "key": key, "optional": True}
        }
    with_auth = resolve(env, secrets={"orders-etcd": {"username": "shoal", "password": "pw"}})
    config = config_from_env(with_auth)
    assert (config.etcd_ca_file, config.etcd_cert_file, config.etcd_key_file) == (
        "/etc/shoal/etcd/ca.crt",
        "/etc/shoal/etcd/tls.crt",
        "/etc/shoal/etcd/tls.key",
    )
    assert config.etcd_options()["username"] == "shoal"
    assert config.etcd_options()["password"] == "pw"
    # A Secret without the optional keys: TLS only, no authentication.
    without = config_from_env(resolve(env, secrets={"orders-etcd": {}}))
    assert without.etcd_ca_file == "/etc/shoal/etcd/ca.crt"
    assert without.etcd_username is None and without.etcd_password is None


def test_etcd_tls_and_nats_credentials_together() -> None:
    spec = {**etcd_tls_spec(), "nats": {"credentialsSecret": "orders-nats"}}
    deployment = build_deployment(NAME, NAMESPACE, spec, SETTINGS)
    volumes = [volume["name"] for volume in pod_spec(deployment)["volumes"]]
    assert volumes == ["tmp", "nats-credentials", "etcd-tls"]
    mounts = [mount["mountPath"] for mount in container(deployment)["volumeMounts"]]
    assert len(set(mounts)) == len(mounts)


def test_a_user_env_var_overrides_an_etcd_tls_variable() -> None:
    user = [{"name": "ETCD_CA_FILE", "value": "/custom/ca.pem"}]
    env = consumer_env(NAME, NAMESPACE, {**etcd_tls_spec(), "env": user}, SETTINGS)
    assert env_names(env).count("ETCD_CA_FILE") == 1
    assert resolve(env)["ETCD_CA_FILE"] == "/custom/ca.pem"


# -- deployment -------------------------------------------------------------------------------


def test_deployment_shape() -> None:
    deployment = build_deployment(NAME, NAMESPACE, full_spec(), SETTINGS)
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    assert deployment["metadata"]["name"] == "orders-consumer"
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert "ownerReferences" not in deployment["metadata"]
    spec = deployment["spec"]
    assert spec["replicas"] == 4
    assert spec["selector"] == {"matchLabels": selector(NAME)}
    assert spec["template"]["metadata"]["labels"] == labels(NAME)
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    c = container(deployment)
    assert c["name"] == "consumer"
    assert c["command"] == ["shoal-consumer", "run"]
    assert c["image"] == "registry.example/shoal:1.2.3"
    assert c["imagePullPolicy"] == "Always"
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}
    assert c["env"] == consumer_env(NAME, NAMESPACE, full_spec(), SETTINGS)


def test_image_and_pull_policy_default_to_the_operator_settings() -> None:
    custom = OperatorSettings(default_image="shoal:9", image_pull_policy="Never")
    c = container(build_deployment(NAME, NAMESPACE, minimal_spec(), custom))
    assert (c["image"], c["imagePullPolicy"]) == ("shoal:9", "Never")


@pytest.mark.parametrize(("replicas", "expected"), [(None, 3), (0, 0), (1, 1), (12, 12)])
def test_replicas_follow_the_spec(replicas: int | None, expected: int) -> None:
    spec = {**minimal_spec(), "replicas": replicas}
    assert build_deployment(NAME, NAMESPACE, spec, SETTINGS)["spec"]["replicas"] == expected


def test_grace_period_leaves_room_to_drain() -> None:
    for drain in (1, 30, 120):
        custom = OperatorSettings(drain_timeout_seconds=drain)
        deployment = build_deployment(NAME, NAMESPACE, minimal_spec(), custom)
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] == drain + 15
        assert resolve(container(deployment)["env"])["SHOAL_DRAIN_TIMEOUT"] == str(drain)


def test_readiness_is_membership() -> None:
    probe = container(build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS))["readinessProbe"]
    assert probe["exec"] == {"command": ["shoal-ready"]}
    assert probe["periodSeconds"] == 2
    assert probe["failureThreshold"] == 1
    assert probe["timeoutSeconds"] <= probe["periodSeconds"]


def test_liveness_is_a_running_event_loop_and_generous() -> None:
    c = container(build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS))
    probe = c["livenessProbe"]
    assert probe["exec"] == {"command": ["shoal-ready", "--live"]}
    assert probe["timeoutSeconds"] <= probe["periodSeconds"]
    # Never sooner than the state's own 60 s limit, and start-up has time to write it.
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30
    assert probe["initialDelaySeconds"] >= 10
    # Both probes read the file the consumer writes (SHOAL_READY_FILE in its env).
    assert "SHOAL_READY_FILE" in resolve(c["env"])


def test_security_context_is_locked_down_with_a_writable_tmp() -> None:
    deployment = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    c = container(deployment)
    assert c["securityContext"] == {
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod_spec(deployment)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    # A member that fails says why: the end of its log is its termination message.
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {"name": "tmp", "emptyDir": {}} in pod_spec(deployment)["volumes"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


ZONE_SPREAD = {
    "maxSkew": 1,
    "topologyKey": "topology.kubernetes.io/zone",
    "whenUnsatisfiable": "ScheduleAnyway",
}


def placed_spec() -> dict[str, Any]:
    return {
        **minimal_spec(),
        "podLabels": {"team": "payments", GROUP_LABEL: "someone-else"},
        "podAnnotations": {"mesh.example/inject": "false", ETCD_SECRET_VERSION: "forged"},
        "nodeSelector": {"pool": "consumers"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "shoal"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "arch", "operator": "In", "values": ["x"]}]}
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            ZONE_SPREAD,
            {**ZONE_SPREAD, "topologyKey": "kubernetes.io/hostname", "labelSelector": {}},
        ],
        "priorityClassName": "shoal-consumers",
    }


def test_placement_fields_reach_the_pod_spec() -> None:
    spec = placed_spec()
    pod = pod_spec(build_deployment(NAME, NAMESPACE, spec, SETTINGS))
    assert pod["nodeSelector"] == {"pool": "consumers"}
    # The user's first, then the node-loss ones (the user's names neither taint).
    assert pod["tolerations"] == spec["tolerations"] + NODE_LOSS_DEFAULTS
    assert pod["affinity"] == spec["affinity"]
    assert pod["priorityClassName"] == "shoal-consumers"
    by_zone, by_host = pod["topologySpreadConstraints"]
    # Without a selector a constraint would count no pods: it gets the group's own ...
    assert by_zone == {**ZONE_SPREAD, "labelSelector": {"matchLabels": selector(NAME)}}
    # ... and one the user wrote (even an empty one) is left as written.
    assert by_host["labelSelector"] == {}
    # The spec itself is not changed by the defaulting.
    assert "labelSelector" not in spec["topologySpreadConstraints"][0]


NODE_LOSS_DEFAULTS = [
    {
        "key": f"node.kubernetes.io/{taint}",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 30,
    }
    for taint in ("unreachable", "not-ready")
]


def test_member_pods_leave_a_lost_node_after_node_loss_toleration_seconds() -> None:
    """Issue 25: without tolerations of its own a pod gets Kubernetes' 300 s for the
    unreachable and not-ready taints (DefaultTolerationSeconds), five minutes of a lost
    node's members counted as the group's while Shoal moved their partitions within the
    lease TTL. The operator gives them spec.nodeLossTolerationSeconds (default 30)."""
    pod = pod_spec(build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS))
    assert pod["tolerations"] == NODE_LOSS_DEFAULTS
    spec = {**minimal_spec(), "nodeLossTolerationSeconds": 0}
    pod = pod_spec(build_deployment(NAME, NAMESPACE, spec, SETTINGS))
    assert [t["tolerationSeconds"] for t in pod["tolerations"]] == [0, 0]


@pytest.mark.parametrize(
    ("theirs", "ours_for"),
    [
        # Their own time for one taint: ours only for the other.
        (
            {
                "key": "node.kubernetes.io/unreachable",
                "effect": "NoExecute",
                "tolerationSeconds": 600,
            },
            ["not-ready"],
        ),
        # No effect named: every effect, NoExecute included.
        ({"key": "node.kubernetes.io/not-ready", "operator": "Exists"}, ["unreachable"]),
        # Only NoSchedule: the eviction is still ours to time.
        (
            {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
            ["unreachable", "not-ready"],
        ),
        # Exists without a key tolerates every taint: nothing to add.
        ({"operator": "Exists"}, []),
        ({"operator": "Exists", "effect": "NoExecute"}, []),
        # Some other key: both ours.
        ({"key": "dedicated", "operator": "Exists"}, ["unreachable", "not-ready"]),
    ],
)
def test_a_users_toleration_for_a_node_loss_taint_wins(
    theirs: dict[str, Any], ours_for: list[str]
) -> None:
    spec = {**minimal_spec(), "tolerations": [theirs], "nodeLossTolerationSeconds": 7}
    pod = pod_spec(build_deployment(NAME, NAMESPACE, spec, SETTINGS))
    assert pod["tolerations"][0] == theirs
    added = pod["tolerations"][1:]
    assert [t["key"].removeprefix("node.kubernetes.io/") for t in added] == ours_for
    assert all(t["tolerationSeconds"] == 7 and t["effect"] == "NoExecute" for t in added)


def test_unset_placement_fields_are_left_out_of_the_pod_spec() -> None:
    deployment = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    pod = pod_spec(deployment)
    # Tolerations never are: the node-loss ones are always there.
    assert pod["tolerations"] == NODE_LOSS_DEFAULTS
    for field in (
        "nodeSelector",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
    ):
        assert field not in pod, field
    assert "annotations" not in deployment["spec"]["template"]["metadata"]


def test_pod_labels_and_annotations_never_override_the_operators() -> None:
    deployment = build_deployment(NAME, NAMESPACE, placed_spec(), SETTINGS, "41")
    meta = deployment["spec"]["template"]["metadata"]
    assert meta["labels"] == {"team": "payments", **labels(NAME)}
    # The selector still matches the pods, so the Deployment keeps owning them.
    assert selector(NAME).items() <= meta["labels"].items()
    assert meta["annotations"] == {"mesh.example/inject": "false", ETCD_SECRET_VERSION: "41"}


def test_pods_run_as_the_groups_service_account() -> None:
    deployment = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    sa = build_service_account(NAME, NAMESPACE)
    assert pod_spec(deployment)["serviceAccountName"] == sa["metadata"]["name"]


# -- RBAC ------------------------------------------------------------------------------------


def rules_for(role: dict[str, Any], group: str, resource: str) -> list[dict[str, Any]]:
    return [r for r in role["rules"] if group in r["apiGroups"] and resource in r["resources"]]


def test_role_restricts_consumergroups_and_scale_to_the_group() -> None:
    role = build_role(NAME, NAMESPACE)
    (cg,) = rules_for(role, "shoal.dev", "consumergroups")
    assert (cg["resourceNames"], cg["verbs"]) == ([NAME], ["get"])
    (scale,) = rules_for(role, "shoal.dev", "consumergroups/scale")
    assert scale["resourceNames"] == [NAME]
    assert sorted(scale["verbs"]) == ["get", "patch", "update"]
    assert not rules_for(role, "shoal.dev", "consumergroups/status")


def test_role_has_events_and_pods_only_as_needed() -> None:
    role = build_role(NAME, NAMESPACE)
    for group in ("", "events.k8s.io"):
        (events,) = rules_for(role, group, "events")
        assert sorted(events["verbs"]) == ["create", "patch"]
    (pods,) = rules_for(role, "", "pods")
    assert sorted(pods["verbs"]) == ["get", "list", "patch"]


def test_role_has_no_wildcards_and_no_secrets() -> None:
    role = build_role(NAME, NAMESPACE)
    assert role["kind"] == "Role"  # namespaced, never a ClusterRole
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert "*" not in rule.get(key, [])
        assert not any("*" in resource for resource in rule["resources"])
        assert "secrets" not in rule["resources"]
        assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(
            rule["verbs"]
        )
    resources = {resource for rule in role["rules"] for resource in rule["resources"]}
    assert resources == {"consumergroups", "consumergroups/scale", "events", "pods"}


def test_role_binding_binds_the_role_to_the_service_account() -> None:
    binding = build_role_binding(NAME, NAMESPACE)
    role = build_role(NAME, NAMESPACE)
    sa = build_service_account(NAME, NAMESPACE)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]


# -- PDB and children ------------------------------------------------------------------------


def test_pdb_lets_one_member_drain_at_a_time() -> None:
    pdb = build_pdb(NAME, NAMESPACE, full_spec())
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "orders-consumer"
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"] == {"matchLabels": selector(NAME)}


def test_children_in_apply_order_all_in_the_groups_namespace() -> None:
    objects = children(NAME, NAMESPACE, full_spec(), SETTINGS)
    assert [o["kind"] for o in objects] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
    ]
    for o in objects:
        assert o["metadata"]["namespace"] == NAMESPACE
        assert o["metadata"]["labels"] == labels(NAME)
        assert "ownerReferences" not in o["metadata"]
    names = resource_names(NAME)
    assert [o["metadata"]["name"] for o in objects] == [
        names["service_account"],
        names["role"],
        names["role_binding"],
        names["deployment"],
        names["pdb"],
    ]
    # What kopf sends to the API server must survive JSON.
    assert json.loads(json.dumps(objects)) == objects


def test_builders_are_deterministic() -> None:
    assert children(NAME, NAMESPACE, full_spec(), SETTINGS) == children(
        NAME, NAMESPACE, full_spec(), SETTINGS
    )


# -- settings --------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    s = settings_from_env({})
    assert s == OperatorSettings()
    assert s.default_image == "shoal:dev"
    assert s.image_pull_policy == "IfNotPresent"
    assert s.nats_url == "nats://nats:4222"
    assert s.etcd_endpoints == "etcd:2379"
    assert s.drain_timeout_seconds == 30
    assert s.watch_namespaces == []
    assert s.consumer_metrics_port is None


@pytest.mark.parametrize(
    ("port", "declared"), [(None, None), (0, None), (9102, 9102)], ids=["off", "any", "fixed"]
)
def test_consumer_metrics_port(port: int | None, declared: int | None) -> None:
    settings = OperatorSettings(consumer_metrics_port=port)
    deployment = build_deployment(NAME, NAMESPACE, minimal_spec(), settings)
    env = resolve(container(deployment)["env"])
    assert env.get("SHOAL_METRICS_PORT") == (None if port is None else str(port))
    assert config_from_env(env).metrics_port == port
    ports = container(deployment).get("ports")
    if declared is None:
        assert ports is None
    else:
        assert ports == [{"name": "metrics", "containerPort": declared, "protocol": "TCP"}]


def test_probes_go_over_http_on_the_health_port() -> None:
    settings = OperatorSettings(consumer_health_port=8081, consumer_metrics_port=9102)
    c = container(build_deployment(NAME, NAMESPACE, minimal_spec(), settings))
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
    assert "exec" not in c["readinessProbe"] and "exec" not in c["livenessProbe"]
    # The same timings as the exec probes: readiness tolerates no failure, liveness is
    # as generous as before.
    assert (c["readinessProbe"]["periodSeconds"], c["readinessProbe"]["failureThreshold"]) == (2, 1)
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 30
    assert c["ports"] == [
        {"name": "metrics", "containerPort": 9102, "protocol": "TCP"},
        {"name": "health", "containerPort": 8081, "protocol": "TCP"},
    ]
    env = resolve(c["env"])
    assert env["SHOAL_HEALTH_PORT"] == "8081"
    config = config_from_env(env)
    # The member answers from the file the exec probes read.
    assert (config.health_port, config.ready_file) == (8081, env["SHOAL_READY_FILE"])


def test_no_health_port_no_http_probes() -> None:
    c = container(build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS))
    assert "httpGet" not in c["readinessProbe"]
    assert "SHOAL_HEALTH_PORT" not in resolve(c["env"])
    assert settings_from_env({"SHOAL_CONSUMER_HEALTH_PORT": "9000"}).consumer_health_port == 9000
    assert settings_from_env({"SHOAL_CONSUMER_HEALTH_PORT": ""}).consumer_health_port is None
    with pytest.raises(ValueError, match="consumer_health_port"):
        settings_from_env({"SHOAL_CONSUMER_HEALTH_PORT": "0"})


def test_settings_from_env() -> None:
    s = settings_from_env(
        {
            "SHOAL_OPERATOR_IMAGE": "registry.example/shoal:1.2.3",
            "SHOAL_OPERATOR_IMAGE_PULL_POLICY": "Always",
            "NATS_URL": "nats://n:4222",
            "ETCD_ENDPOINTS": "e1:2379,e2:2379",
            "SHOAL_DRAIN_TIMEOUT": "45",
            "SHOAL_WATCH_NAMESPACES": " team-a, team-b ,,",
            "UNRELATED": "ignored",
        }
    )
    assert s.default_image == "registry.example/shoal:1.2.3"
    assert s.image_pull_policy == "Always"
    assert s.nats_url == "nats://n:4222"
    assert s.etcd_endpoints == "e1:2379,e2:2379"
    assert s.drain_timeout_seconds == 45
    assert s.watch_namespaces == ["team-a", "team-b"]


def test_settings_empty_values_mean_default() -> None:
    env = {"SHOAL_OPERATOR_IMAGE": "", "NATS_URL": " ", "SHOAL_WATCH_NAMESPACES": ""}
    assert settings_from_env(env) == OperatorSettings()


@pytest.mark.parametrize(
    "env",
    [
        {"SHOAL_OPERATOR_IMAGE_PULL_POLICY": "Sometimes"},
        {"SHOAL_DRAIN_TIMEOUT": "0"},
        {"SHOAL_DRAIN_TIMEOUT": "soon"},
    ],
)
def test_settings_reject_nonsense(env: dict[str, str]) -> None:
    with pytest.raises(ValidationError):
        settings_from_env(env)


def test_settings_are_frozen() -> None:
    with pytest.raises(ValidationError):
        OperatorSettings().nats_url = "nats://x"  # type: ignore[misc]


# -- properties ------------------------------------------------------------------------------

dns_label = st.from_regex(r"[a-z]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
token = st.from_regex(r"[A-Za-z0-9_-]{1,8}", fullmatch=True)
seconds = st.one_of(st.integers(1, 600), st.floats(0.1, 600, allow_nan=False))
stream_section = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)),
        "retention": st.sampled_from(["workqueue", "limits", "interest"]),
        "storage": st.sampled_from(["file", "memory"]),
        "replicas": st.integers(1, 5),
    },
)
consumer_section = st.fixed_dictionaries(
    {},
    optional={
        "ackWaitSeconds": seconds,
        "maxAckPending": st.integers(1, 100_000),
        "maxDeliver": st.integers(1, 100),
        "backoffSeconds": st.lists(seconds, max_size=4),
        "maxMessagesPerSecond": st.one_of(
            st.integers(1, 100_000), st.floats(0.01, 100_000, allow_nan=False)
        ),
    },
)
nats_section = st.fixed_dictionaries(
    {},
    optional={
        "url": st.sampled_from(["", "nats://n:4222", "tls://a:4222,tls://b:4222"]),
        "credentialsSecret": st.one_of(st.just(""), dns_label),
        "subjectPrefix": st.one_of(
            st.just(""), st.lists(token, min_size=1, max_size=4).map(".".join)
        ),
        "stream": stream_section,
        "consumer": consumer_section,
    },
)
user_env = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.from_regex(r"USER_[A-Z0-9_]{1,8}", fullmatch=True),
            # No "$": $(VAR) expansion is tested on its own.
            "value": st.text(st.characters(codec="ascii", exclude_characters="$"), max_size=10),
        }
    ),
    max_size=3,
    unique_by=lambda var: var["name"],
)


def _replicas_fit(spec: dict[str, Any]) -> bool:
    """The CRD (and the model) refuse more replicas than partitions: such a spec is not valid."""
    return int(spec.get("replicas", 0)) <= int(spec.get("partitions", 128))


specs: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"handler": st.sampled_from([HANDLER, "shoal.consumer.handlers:noop"])},
    optional={
        "replicas": st.integers(0, 50),
        # At least the default maxReplicas (10): the CRD refuses maxReplicas > partitions.
        "partitions": st.integers(10, 4096),
        "image": st.sampled_from(["", "registry.example/shoal:2"]),
        "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"]),
        "env": user_env,
        "resources": st.just({"limits": {"cpu": "1"}}),
        "nats": nats_section,
        "etcd": st.fixed_dictionaries(
            {},
            optional={
                "endpoints": st.sampled_from(["", "x:2379", "x:2379,y:2379"]),
                "tlsSecret": st.one_of(st.just(""), dns_label),
            },
        ),
    },
).filter(_replicas_fit)


@settings(max_examples=200, deadline=None)
@given(name=dns_label, namespace=dns_label, spec=specs, drain=st.integers(1, 600))
def test_any_valid_spec_builds_a_consistent_deployment_the_consumer_accepts(
    name: str, namespace: str, spec: dict[str, Any], drain: int
) -> None:
    before = copy.deepcopy(spec)
    ops = OperatorSettings(drain_timeout_seconds=drain)
    deployment = build_deployment(name, namespace, spec, ops)
    assert spec == before

    template = deployment["spec"]["template"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= template["metadata"]["labels"].items()
    )
    assert template["spec"]["terminationGracePeriodSeconds"] > drain
    volumes = {volume["name"] for volume in template["spec"]["volumes"]}
    assert {mount["name"] for mount in container(deployment)["volumeMounts"]} == volumes

    env = container(deployment)["env"]
    assert len(set(env_names(env))) == len(env)
    pod = f"{resource_names(name)['deployment']}-5d8f7-abcde"
    resolved = resolve(env, pod=pod, namespace=namespace)
    config = config_from_env(resolved)

    nats = spec.get("nats", {})
    stream = nats.get("stream", {})
    consumer = nats.get("consumer", {})
    assert (config.group, config.namespace, config.member_id) == (name, namespace, pod)
    assert config.partitions == spec.get("partitions", 128)
    assert config.subject_prefix == (nats.get("subjectPrefix") or f"shoal.{namespace}.{name}")
    assert config.stream == (stream.get("name") or default_stream_name(namespace, name))
    assert config.retention == stream.get("retention", "workqueue")
    assert config.storage == stream.get("storage", "file")
    assert config.stream_replicas == stream.get("replicas", 1)
    assert config.handler == spec["handler"]
    assert config.ack_wait == pytest.approx(consumer.get("ackWaitSeconds", 5))
    assert config.max_ack_pending == consumer.get("maxAckPending", 1000)
    assert config.max_deliver == consumer.get("maxDeliver", 5)
    assert config.backoff == pytest.approx(tuple(consumer.get("backoffSeconds") or ()))
    assert config.max_messages_per_second == consumer.get("maxMessagesPerSecond")
    assert config.drain_timeout == drain
    assert ("NATS_CREDS_FILE" in resolved) == bool(nats.get("credentialsSecret"))
    tls_secret = spec.get("etcd", {}).get("tlsSecret")
    assert (config.etcd_ca_file is not None) == bool(tls_secret)
    assert ("etcd-tls" in volumes) == bool(tls_secret)
    for var in spec.get("env") or []:
        assert resolved[var["name"]] == var["value"]

    for child in children(name, namespace, spec, ops):
        assert child["metadata"]["namespace"] == namespace


def test_the_etcd_secret_version_rolls_the_pod_template() -> None:
    plain = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS)
    assert "annotations" not in plain["spec"]["template"]["metadata"]
    v1 = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS, "101")
    v2 = children(NAME, NAMESPACE, minimal_spec(), SETTINGS, "202")[3]
    assert v1["spec"]["template"]["metadata"]["annotations"] == {ETCD_SECRET_VERSION: "101"}
    assert v2["kind"] == "Deployment"
    assert v2["spec"]["template"]["metadata"]["annotations"] == {ETCD_SECRET_VERSION: "202"}
    # Only the annotation differs: a rotation changes nothing else about the pods.
    v1["spec"]["template"]["metadata"].pop("annotations")
    assert v1 == plain


# -- spec.nats.tlsSecret and the forms of spec.nats.credentialsSecret ---------------------------


def nats_spec(**nats: Any) -> dict[str, Any]:
    return {**minimal_spec(), "nats": nats}


def volume_and_mount(deployment: dict[str, Any], name: str) -> tuple[Any, Any]:
    volumes = {volume["name"]: volume for volume in pod_spec(deployment)["volumes"]}
    mounts = {mount["name"]: mount for mount in container(deployment)["volumeMounts"]}
    return volumes.get(name), mounts.get(name)


def test_nats_tls_secret_is_mounted_read_only_and_named_in_env() -> None:
    deployment = build_deployment(NAME, NAMESPACE, nats_spec(tlsSecret="orders-tls"), SETTINGS)
    volume, mount = volume_and_mount(deployment, "nats-tls")
    assert volume["secret"] == {
        "secretName": "orders-tls",
        "items": [
            {"key": "ca.crt", "path": "ca.crt"},
            {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"},
        ],
    }
    assert mount == {"name": "nats-tls", "mountPath": "/etc/shoal/nats-tls", "readOnly": True}
    config = config_from_env(resolve(container(deployment)["env"]))
    assert (config.nats_ca_file, config.nats_cert_file, config.nats_key_file) == (
        "/etc/shoal/nats-tls/ca.crt",
        "/etc/shoal/nats-tls/tls.crt",
        "/etc/shoal/nats-tls/tls.key",
    )
    assert config.nats_security().uses_tls


def test_a_ca_only_nats_tls_secret_mounts_and_names_only_the_ca() -> None:
    spec = nats_spec(tlsSecret="orders-tls")
    nats = NatsPodSecrets(client_certificate=False)
    deployment = build_deployment(NAME, NAMESPACE, spec, SETTINGS, nats=nats)
    volume, _ = volume_and_mount(deployment, "nats-tls")
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    config = config_from_env(resolve(container(deployment)["env"]))
    assert config.nats_ca_file == "/etc/shoal/nats-tls/ca.crt"
    assert config.nats_cert_file is None and config.nats_key_file is None


def test_user_and_password_come_from_the_secret_never_as_plain_values() -> None:
    spec = nats_spec(credentialsSecret="orders-nats")
    nats = NatsPodSecrets(credentials="user")
    deployment = build_deployment(NAME, NAMESPACE, spec, SETTINGS, nats=nats)
    assert volume_and_mount(deployment, "nats-credentials") == (None, None)
    env = container(deployment)["env"]
    by_name = {var["name"]: var for var in env}
    for var, key in (("NATS_USER", "user"), ("NATS_PASSWORD", "password")):
        assert by_name[var] == {
            "name": var,
            "valueFrom": {"secretKeyRef": {"name": "orders-nats", "key": key}},
        }
    assert "NATS_CREDS_FILE" not in by_name
    assert "hunter2" not in json.dumps(deployment)
    config = config_from_env(
        resolve(env, secrets={"orders-nats": {"user": "orders", "password": "hunter2"}})
    )
    security = config.nats_security()
    assert (security.user, security.password, security.creds_file) == ("orders", "hunter2", None)
    # Without the Secret's keys the container is not started (the operator checks first).
    with pytest.raises(KeyError):
        resolve(env, secrets={"orders-nats": {}})


def test_an_nkey_seed_is_mounted_as_a_file() -> None:
    spec = nats_spec(credentialsSecret="orders-nats")
    deployment = build_deployment(
        NAME, NAMESPACE, spec, SETTINGS, nats=NatsPodSecrets(credentials="nkey")
    )
    volume, mount = volume_and_mount(deployment, "nats-credentials")
    assert volume["secret"] == {
        "secretName": "orders-nats",
        "items": [{"key": "nkey", "path": "nkey"}],
    }
    assert mount["readOnly"] is True
    config = config_from_env(resolve(container(deployment)["env"]))
    assert config.nats_nkey_seed_file == "/etc/shoal/nats/nkey"
    assert config.nats_creds_file is None and config.nats_user is None


def test_nats_tls_and_credentials_and_etcd_tls_together() -> None:
    spec = {
        **etcd_tls_spec(),
        "nats": {"credentialsSecret": "orders-nats", "tlsSecret": "orders-tls"},
    }
    deployment = build_deployment(NAME, NAMESPACE, spec, SETTINGS)
    volumes = [volume["name"] for volume in pod_spec(deployment)["volumes"]]
    assert volumes == ["tmp", "nats-credentials", "nats-tls", "etcd-tls"]
    mounts = [mount["mountPath"] for mount in container(deployment)["volumeMounts"]]
    assert len(set(mounts)) == len(mounts)
    config = config_from_env(resolve(container(deployment)["env"]))
    assert config.nats_creds_file == "/etc/shoal/nats/creds"
    assert config.nats_ca_file == "/etc/shoal/nats-tls/ca.crt"
    assert config.etcd_ca_file == "/etc/shoal/etcd/ca.crt"


def test_the_nats_secrets_versions_roll_the_pod_template() -> None:
    spec = nats_spec(credentialsSecret="orders-nats", tlsSecret="orders-tls")
    plain = build_deployment(NAME, NAMESPACE, spec, SETTINGS)
    assert "annotations" not in plain["spec"]["template"]["metadata"]
    nats = NatsPodSecrets(tls_version="11", credentials_version="12")
    v1 = build_deployment(NAME, NAMESPACE, spec, SETTINGS, "10", nats)
    assert v1["spec"]["template"]["metadata"]["annotations"] == {
        ETCD_SECRET_VERSION: "10",
        NATS_TLS_SECRET_VERSION: "11",
        NATS_CREDENTIALS_SECRET_VERSION: "12",
    }
    rotated = NatsPodSecrets(tls_version="13", credentials_version="12")
    v2 = children(NAME, NAMESPACE, spec, SETTINGS, "10", rotated)[3]
    assert v2["spec"]["template"]["metadata"]["annotations"][NATS_TLS_SECRET_VERSION] == "13"
    # Only the annotations differ: a rotation changes nothing else about the pods.
    v1["spec"]["template"]["metadata"].pop("annotations")
    assert v1 == plain
    # Versions of Secrets the spec does not name are not annotated.
    alone = build_deployment(NAME, NAMESPACE, minimal_spec(), SETTINGS, nats=nats)
    assert "annotations" not in alone["spec"]["template"]["metadata"]


def test_members_reply_under_their_groups_own_inbox_prefix() -> None:
    config = config_of(minimal_spec())
    assert config.nats_inbox_prefix == f"_SHOAL_INBOX.{NAMESPACE}.{NAME}"
    assert config.nats_security().connect_options()["inbox_prefix"] == config.nats_inbox_prefix
    # Exactly what the least-privilege lists allow the group's members.
    (inbox,) = [s for s in member_permissions(config).subscribe if "INBOX" in s]
    assert inbox == f"{config.nats_inbox_prefix}.>"


def test_a_rollout_replaces_one_pod_at_a_time() -> None:
    deployment = build_deployment(NAME, NAMESPACE, nats_spec(tlsSecret="orders-tls"), SETTINGS)
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


def test_operator_nats_settings_from_env() -> None:
    ops = settings_from_env(
        {
            "NATS_CA_FILE": "/etc/shoal/operator-nats-tls/ca.crt",
            "NATS_USER": "shoal-operator",
            "NATS_PASSWORD": "s3cret-operator-pw",
        }
    )
    security = ops.nats_security()
    assert security.ca_file == "/etc/shoal/operator-nats-tls/ca.crt"
    assert (security.user, security.password) == ("shoal-operator", "s3cret-operator-pw")
    assert "s3cret-operator-pw" not in repr(ops) + repr(security)
    assert OperatorSettings().nats_security().connect_options() == {}


def test_the_operator_reads_its_nats_password_as_members_do() -> None:
    """A password is the Secret's bytes, edge whitespace included, for the operator as
    for members (group.config). Before, the operator stripped it: with a Secret made
    --from-file (a last newline) the operator logged in and members were refused, and
    a password with real edge blanks failed for the operator alone."""
    from shoal.group.config import nats_security_from_env

    for password in ("pw\n", " pw ", "pw"):
        env = {"NATS_USER": "u", "NATS_PASSWORD": password, "NATS_URL": " nats://n:4222 "}
        settings = settings_from_env(env)
        assert settings.nats_security().password == password
        assert nats_security_from_env(env).password == password
        assert settings.nats_url == "nats://n:4222"  # the rest is still trimmed
