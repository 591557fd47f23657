"""spec.containers: the team's containers in the member pod, as native sidecars.

The model's checks (shoal.contracts.spec.check_containers), the CRD's rules that say the
same (e2e/test_crd.py proves the API server applies them), and the builder
(shoal.operator.builders.sidecars), without any cluster.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from shoal.contracts.names import CONSUMER_CONTAINER_NAME
from shoal.contracts.spec import (
    CONTAINER_NAME_PATTERN,
    CONTAINER_NAME_TAKEN,
    DUPLICATE_CONTAINERS,
    MAX_CONTAINERS,
    SpecError,
    parse_spec,
)
from shoal.operator.builders import CONTAINER_NAME, build_deployment, sidecars
from shoal.operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "consumergroup.yaml"
SETTINGS = OperatorSettings()

# A service as a team would write it: every field a Pod's container may have that
# matters here, so the copy is checked to keep them all.
SERVICE: dict[str, Any] = {
    "name": "orders-api",
    "image": "registry.example/orders-api:1.4",
    "imagePullPolicy": "IfNotPresent",
    "command": ["/orders-api"],
    "args": ["--listen", ":8080"],
    "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"}],
    "env": [
        {"name": "LOG_LEVEL", "value": "info"},
        {"name": "DB_URL", "valueFrom": {"secretKeyRef": {"name": "db", "key": "url"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "orders-api"}}],
    "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "256Mi"}},
    "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "failureThreshold": 30},
    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 2},
    "livenessProbe": {"tcpSocket": {"port": 8080}},
    "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True},
    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
}
METRICS = {"name": "metrics-agent", "image": "registry.example/agent:2"}


def spec(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"handler": "app.handlers:process", "containers": list(containers)}


def pod_spec(group_spec: dict[str, Any]) -> dict[str, Any]:
    deployment = build_deployment("orders", "prod", group_spec, SETTINGS)
    result: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return result


# -- the builder -----------------------------------------------------------------------------


def test_no_containers_no_init_containers() -> None:
    """Left out, not empty: the applied template must equal the stored one."""
    assert "initContainers" not in pod_spec(spec())
    assert "initContainers" not in pod_spec({"handler": "a:b"})
    assert sidecars(parse_spec(spec())) == {}


def test_containers_are_native_sidecars_in_order_before_the_member() -> None:
    pod = pod_spec(spec(SERVICE, METRICS))
    names = [c["name"] for c in pod["initContainers"]]
    assert names == ["orders-api", "metrics-agent"]
    assert all(c["restartPolicy"] == "Always" for c in pod["initContainers"])
    # Shoal's own container stays the only regular one: it starts after the sidecars.
    assert [c["name"] for c in pod["containers"]] == [CONTAINER_NAME]
    # The reversed order is kept too: order is the user's.
    pod = pod_spec(spec(METRICS, SERVICE))
    assert [c["name"] for c in pod["initContainers"]] == ["metrics-agent", "orders-api"]


def test_every_field_is_copied_as_written() -> None:
    (rendered,) = pod_spec(spec(SERVICE))["initContainers"]
    assert rendered == {**SERVICE, "restartPolicy": "Always"}
    # An explicit Always is the same thing.
    (rendered,) = pod_spec(spec({**METRICS, "restartPolicy": "Always"}))["initContainers"]
    assert rendered == {**METRICS, "restartPolicy": "Always"}


def test_the_spec_is_not_changed_and_renders_are_independent() -> None:
    group = spec(copy.deepcopy(SERVICE))
    before = copy.deepcopy(group)
    first = pod_spec(group)
    assert group == before
    first["initContainers"][0]["env"].append({"name": "X", "value": "1"})
    first["initContainers"][0]["ports"][0]["containerPort"] = 1
    assert pod_spec(group)["initContainers"][0] == {**SERVICE, "restartPolicy": "Always"}


def test_the_member_container_and_the_rest_of_the_pod_are_unchanged() -> None:
    plain = pod_spec({"handler": "app.handlers:process"})
    with_sidecars = pod_spec(spec(SERVICE))
    del with_sidecars["initContainers"]
    assert with_sidecars == plain


def test_the_model_keeps_containers_as_given() -> None:
    model = parse_spec(spec(SERVICE, METRICS))
    assert model.containers == [SERVICE, METRICS]
    assert parse_spec({"handler": "a:b"}).containers == []
    # null is unset, as for every field.
    assert parse_spec({"handler": "a:b", "containers": None}).containers == []


# -- what the model refuses -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        ([{"image": "x:1"}], "spec.containers: containers[0] needs a name"),
        ([{"name": "", "image": "x:1"}], "containers[0] needs a name"),
        ([{"name": 7, "image": "x:1"}], "containers[0] needs a name"),
        ([METRICS, {"name": "api"}], "containers[1] (api) needs an image"),
        ([{"name": "api", "image": ""}], "containers[0] (api) needs an image"),
        ([{"name": "Api", "image": "x"}], "containers[0].name 'Api' must be a DNS-1123 label"),
        ([{"name": "a_b", "image": "x"}], "must be a DNS-1123 label"),
        ([{"name": "-a", "image": "x"}], "must be a DNS-1123 label"),
        ([{"name": "a" * 64, "image": "x"}], "must be a DNS-1123 label"),
        ([{"name": CONSUMER_CONTAINER_NAME, "image": "x"}], CONTAINER_NAME_TAKEN),
        ([METRICS, SERVICE, {**METRICS, "image": "y"}], DUPLICATE_CONTAINERS),
        ([METRICS, {**METRICS}], "'metrics-agent' appears twice"),
        ([{**METRICS, "restartPolicy": "Never"}], "restartPolicy can only be Always"),
        ([{**METRICS, "restartPolicy": "OnFailure"}], "restartPolicy can only be Always"),
        ([METRICS] * (MAX_CONTAINERS + 1), "spec.containers"),
        ("api", "spec.containers"),
        (["api"], "spec.containers.0"),
    ],
)
def test_bad_containers_are_one_readable_error(containers: Any, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec({"handler": "a:b", "containers": containers})


def test_the_longest_name_and_the_most_containers_are_accepted() -> None:
    many = [{"name": f"c{i}", "image": "x"} for i in range(MAX_CONTAINERS)]
    assert len(parse_spec(spec(*many)).containers) == MAX_CONTAINERS
    assert parse_spec(spec({"name": "a" * 63, "image": "x"})).containers[0]["name"] == "a" * 63


def test_the_consumer_name_is_the_builders() -> None:
    assert CONSUMER_CONTAINER_NAME == CONTAINER_NAME == "consumer"


# -- the CRD says the same ---------------------------------------------------------------------


def crd_containers() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    containers: dict[str, Any] = schema["properties"]["containers"]
    return containers


def test_the_crd_rules_match_the_models() -> None:
    schema = crd_containers()
    assert schema["maxItems"] == MAX_CONTAINERS
    assert [r["message"] for r in schema["x-kubernetes-validations"]] == [DUPLICATE_CONTAINERS]
    items = schema["items"]
    assert items["required"] == ["name", "image"]
    # Everything else a container may have is kept (the API server validates it in the
    # pod template): the whole Pod container schema would be thousands of lines.
    assert items["x-kubernetes-preserve-unknown-fields"] is True
    assert items["properties"]["name"]["pattern"] == CONTAINER_NAME_PATTERN
    assert items["properties"]["name"]["maxLength"] == 63
    assert items["properties"]["restartPolicy"]["enum"] == ["Always"]
    (rule,) = items["x-kubernetes-validations"]
    assert rule["rule"] == f"self.name != '{CONSUMER_CONTAINER_NAME}'"
    assert " ".join(rule["message"].split()) == CONTAINER_NAME_TAKEN
