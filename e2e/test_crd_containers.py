"""spec.containers on a real API server: the CRD refuses what cannot run, with readable
messages, and the Deployment the operator builds from a good one is a valid pod template
with native sidecars (server-side dry run, so the API server's own Pod validation runs)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kubetest import get_json
from harness.localkube.plane import LocalKube
from shoal.operator.builders import build_deployment
from shoal.operator.settings import OperatorSettings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
CRD_PATH = REPO / "crds" / "consumergroup.yaml"
CRD_NAME = "consumergroups.shoal.dev"
SERVICE = {
    "name": "orders-api",
    "image": "registry.example/orders-api:1.4",
    "args": ["--listen", ":8080"],
    "ports": [{"name": "http", "containerPort": 8080}],
    "env": [{"name": "LOG_LEVEL", "value": "info"}],
    "resources": {"limits": {"memory": "128Mi"}},
    "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1},
    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}},
    "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False},
}


def apply(
    plane: LocalKube, manifest: dict[str, Any], *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return plane.kubectl("apply", *args, "-f", "-", check=check, input_text=json.dumps(manifest))


def group(name: str, namespace: str, containers: Any) -> dict[str, Any]:
    return {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"handler": "shoal.consumer.handlers:ledger", "containers": containers},
    }


def refused(plane: LocalKube, manifest: dict[str, Any]) -> str:
    result = apply(plane, manifest, check=False)
    assert result.returncode != 0, f"accepted: {manifest}\n{result.stdout}"
    assert "is invalid" in result.stderr, result.stderr
    return " ".join(result.stderr.split())


@pytest.fixture(scope="module")
def crd(localkube: LocalKube) -> LocalKube:
    localkube.kubectl("apply", "-f", str(CRD_PATH))
    localkube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=30s")
    return localkube


@pytest.fixture
def namespace(crd: LocalKube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own (a deleted one takes a while to go)."""
    name = "cc-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    crd.kubectl("create", "namespace", name)
    yield name
    crd.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_bad_containers_are_refused_with_readable_messages(crd: LocalKube, namespace: str) -> None:
    message = refused(crd, group("no-name", namespace, [{"image": "x:1"}]))
    assert "spec.containers[0].name: Required value" in message
    message = refused(crd, group("no-image", namespace, [{"name": "api"}]))
    assert "spec.containers[0].image: Required value" in message
    message = refused(crd, group("empty-image", namespace, [{"name": "api", "image": ""}]))
    assert "spec.containers[0].image" in message
    message = refused(crd, group("ours", namespace, [{"name": "consumer", "image": "x:1"}]))
    assert "containers must not be named 'consumer': that is the name of Shoal's own" in message
    twice = [{"name": "api", "image": "x:1"}, {"name": "cache", "image": "y"}]
    twice.append({"name": "api", "image": "x:2"})
    message = refused(crd, group("twice", namespace, twice))
    assert "spec.containers: Invalid value" in message
    assert "containers must have unique names" in message
    message = refused(crd, group("upper", namespace, [{"name": "API", "image": "x:1"}]))
    assert "spec.containers[0].name" in message and "should match" in message
    message = refused(
        crd, group("never", namespace, [{"name": "api", "image": "x", "restartPolicy": "Never"}])
    )
    assert "spec.containers[0].restartPolicy: Unsupported value" in message
    message = refused(
        crd, group("many", namespace, [{"name": f"c{i}", "image": "x"} for i in range(17)])
    )
    assert "spec.containers: Too many" in message
    assert get_json(crd, "cg", "-n", namespace)["items"] == []


def test_a_good_group_keeps_every_container_field(crd: LocalKube, namespace: str) -> None:
    apply(crd, group("served", namespace, [SERVICE, {"name": "agent", "image": "a:2"}]))
    stored = get_json(crd, "cg", "served", "-n", namespace)["spec"]["containers"]
    # Unknown fields are kept (the item preserves them), nothing is defaulted.
    assert stored == [SERVICE, {"name": "agent", "image": "a:2"}]


def test_the_built_deployment_is_a_valid_pod_template_with_native_sidecars(
    crd: LocalKube, namespace: str
) -> None:
    spec = {
        "handler": "shoal.consumer.handlers:ledger",
        "containers": [SERVICE, {"name": "agent", "image": "a:2"}],
    }
    deployment = build_deployment("served", namespace, spec, OperatorSettings())
    result = apply(crd, deployment, "--dry-run=server", "-o", "json")
    template = json.loads(result.stdout)["spec"]["template"]["spec"]
    init = template["initContainers"]
    assert [c["name"] for c in init] == ["orders-api", "agent"]
    assert [c["restartPolicy"] for c in init] == ["Always", "Always"]
    # Probes on sidecars are allowed (startupProbe only on restartable init containers).
    assert init[0]["startupProbe"]["httpGet"]["path"] == "/healthz"
    # And Kubernetes itself refuses a startupProbe on an init container that is not a
    # sidecar: the restartPolicy the builder sets is what makes these valid.
    del deployment["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"]
    result = apply(crd, deployment, "--dry-run=server", check=False)
    assert result.returncode != 0 and "startupProbe" in result.stderr, result.stderr
