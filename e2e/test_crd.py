"""The ConsumerGroup CRD on a real API server: defaults, printer columns, scale, CEL rules,
and spec.containers (refused with readable messages when they cannot run; the Deployment
the operator builds from good ones passes the API server's own Pod validation, as native
sidecars, in a server-side dry run)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.kubetest import get_json, wait_until
from harness.localkube.plane import LocalKube
from shoal.contracts.spec import SpecError, parse_spec
from shoal.operator.builders import build_deployment
from shoal.operator.settings import OperatorSettings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
CRD_PATH = REPO / "crds" / "consumergroup.yaml"
EXAMPLE_PATH = REPO / "examples" / "consumergroup.yaml"
CRD_NAME = "consumergroups.shoal.dev"
API_VERSION = "shoal.dev/v1alpha1"
HANDLER = "shoal.consumer.handlers:ledger"


def apply(
    plane: LocalKube, manifest: dict[str, Any], *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return plane.kubectl("apply", *args, "-f", "-", check=check, input_text=json.dumps(manifest))


def group(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ConsumerGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"handler": HANDLER, **spec},
    }


def refused(plane: LocalKube, manifest: dict[str, Any]) -> str:
    """Apply a manifest the API server must refuse; return its message."""
    result = apply(plane, manifest, check=False)
    assert result.returncode != 0, f"accepted: {manifest}\n{result.stdout}"
    assert "is invalid" in result.stderr, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def crd(localkube: LocalKube) -> LocalKube:
    """The plane with the CRD installed and Established."""
    localkube.kubectl("apply", "-f", str(CRD_PATH))
    localkube.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=30s")
    return localkube


@pytest.fixture
def namespace(crd: LocalKube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own, deleted (with its groups) afterwards."""
    name = "crd-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    crd.kubectl("create", "namespace", name)
    yield name
    crd.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_crd_is_established_and_explained(crd: LocalKube) -> None:
    spec = yaml.safe_load(CRD_PATH.read_text())["spec"]
    assert spec["names"]["shortNames"] == ["cg"]
    conditions = get_json(crd, "crd", CRD_NAME)["status"]["conditions"]
    assert {c["type"]: c["status"] for c in conditions}["Established"] == "True"
    # The published OpenAPI catches up with a new CRD a moment after it is Established.
    explained = wait_until(
        lambda: (
            (r := crd.kubectl("explain", "consumergroup.spec.handler", check=False)).returncode == 0
            and r.stdout
        ),
        30,
        "kubectl explain to know the CRD",
    )
    assert "module:function" in explained
    assert "cg" in crd.kubectl("api-resources", "--api-group=shoal.dev").stdout
    assert "consumergroups" in crd.kubectl("api-resources", "--categories=shoal").stdout


def test_example_gets_defaults_columns_and_scales(crd: LocalKube) -> None:
    example = yaml.safe_load(EXAMPLE_PATH.read_text())
    assert example["metadata"] == {"name": "orders", "namespace": "default"}
    crd.kubectl("apply", "-f", str(EXAMPLE_PATH))
    try:
        spec = get_json(crd, "cg", "orders", "-n", "default")["spec"]
        assert spec["handler"] == HANDLER
        assert spec["replicas"] == 3
        assert spec["partitions"] == 128
        assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 10)
        assert spec["deletionPolicy"] == "Retain"
        assert spec["nodeLossTolerationSeconds"] == 30
        # Nested defaults apply under parents that themselves default to {}.
        stream = spec["nats"]["stream"]
        assert stream == {
            "retention": "workqueue",
            "storage": "file",
            "replicas": 1,
            "ledger": True,  # the example asks for the ledger stream
        }
        assert spec["nats"]["consumer"]["ackWaitSeconds"] == 5
        assert spec["nats"]["consumer"]["maxDeliver"] == 5
        assert spec["autoscaling"]["cooldownSeconds"] == 600
        assert spec["autoscaling"]["enabled"] is False
        assert "targetLagPerMember" not in spec["autoscaling"]
        assert spec["assignment"] == {"strategy": "sticky", "loadAware": False}
        assert "etcd" not in spec

        header, row = crd.kubectl("get", "cg", "-n", "default").stdout.strip().splitlines()
        columns = ["NAME", "REPLICAS", "READY", "LEADER", "STATUS", "SKEW", "LAG", "AGE"]
        assert header.split() == columns
        assert row.split()[:2] == ["orders", "3"]
        wide = crd.kubectl("get", "cg", "orders", "-n", "default", "-o", "wide").stdout
        assert wide.split()[8:11] == ["PARTITIONS", "MIN", "MAX"]

        # Through the scale subresource: works before the operator has set status.selector.
        scale = get_json(crd, "cg", "orders", "-n", "default", "--subresource=scale")
        assert scale["kind"] == "Scale"
        assert scale["spec"]["replicas"] == 3
        crd.kubectl("scale", "cg", "orders", "-n", "default", "--replicas=5")
        assert get_json(crd, "cg", "orders", "-n", "default")["spec"]["replicas"] == 5
    finally:
        crd.kubectl("delete", "-f", str(EXAMPLE_PATH), "--wait=false", check=False)


def test_status_subresource_takes_status(crd: LocalKube, namespace: str) -> None:
    apply(crd, group("g", namespace))
    status = {
        "observedGeneration": 1,
        "replicas": 3,
        "readyReplicas": 2,
        "selector": "shoal.dev/group=g",
        "leader": "g-abc",
        "skew": 1,
        "lag": 42,
        "partitionsPerMember": {"min": 42, "max": 43},
        # Kept, not pruned: the schema has it.
        "stalledPartitions": [{"partition": 7, "member": "g-abc"}],
        "conditions": [
            {
                "type": "Ready",
                "status": "Unknown",
                "reason": "Starting",
                "message": "Waiting for the first member",
                "lastTransitionTime": "2025-01-01T00:00:00Z",
                "observedGeneration": 1,
            }
        ],
    }
    crd.kubectl(
        "patch",
        "cg",
        "g",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    assert get_json(crd, "cg", "g", "-n", namespace)["status"] == status
    _, row = crd.kubectl("get", "cg", "g", "-n", namespace).stdout.strip().splitlines()
    assert row.split()[:6] == ["g", "3", "2", "g-abc", "1", "42"]
    scale = get_json(crd, "cg", "g", "-n", namespace, "--subresource=scale")
    assert scale["status"] == {"replicas": 3, "selector": "shoal.dev/group=g"}


def test_invalid_groups_are_refused_with_readable_messages(crd: LocalKube, namespace: str) -> None:
    message = refused(crd, group("too-many", namespace, partitions=4, maxReplicas=8))
    assert "maxReplicas must not exceed partitions" in message
    message = refused(crd, group("negative", namespace, replicas=-1))
    assert "spec.replicas" in message
    assert "should be greater than or equal to 0" in message
    message = refused(crd, group("no-min", namespace, minReplicas=0))
    assert "minReplicas must be at least 1: a group scaled to 0 has no member" in message
    message = refused(crd, group("min-max", namespace, minReplicas=6, maxReplicas=5))
    assert "minReplicas must not exceed maxReplicas" in message
    message = refused(crd, group("no-colon", namespace, handler="shoal.consumer.handlers.ledger"))
    assert "spec.handler" in message
    assert "should match" in message
    message = refused(crd, group("no-handler", namespace, handler=None))
    assert "spec.handler: Required value" in message
    # An HTTP handler: a well-formed URL is accepted, a malformed one refused in words.
    url = group("url", namespace, handler="http://127.0.0.1:8080/messages")
    url["spec"]["handlerReadyPath"] = "/healthz"
    apply(crd, url)
    crd.kubectl("delete", "cg", "url", "-n", namespace)
    message = refused(crd, group("bad-url", namespace, handler="http:/127.0.0.1:8080/messages"))
    assert (
        "handler must look like 'package.module:function' or be an http:// or https:// URL"
        in " ".join(message.split())
    ), message
    message = refused(crd, group("bad-ready", namespace, handlerReadyPath="healthz"))
    assert "spec.handlerReadyPath" in message
    # spec.handlerSocket: with an http:// handler only, an absolute path, not in Secrets.
    message = refused(crd, group("sock-py", namespace, handlerSocket="/run/h/http.sock"))
    assert "handlerSocket needs an http:// URL handler" in " ".join(message.split()), message
    web = {"handler": "http://localhost/messages"}
    message = refused(crd, group("sock-rel", namespace, handlerSocket="run/http.sock", **web))
    assert "spec.handlerSocket" in message
    message = refused(crd, group("sock-opt", namespace, handlerSocket="/opt/http.sock", **web))
    assert "spec.handlerSocket" in message
    message = refused(crd, group("retention", namespace, nats={"stream": {"retention": "forever"}}))
    assert "spec.nats.stream.retention" in message
    assert '"workqueue", "limits", "interest"' in message
    message = refused(crd, group("prefix", namespace, nats={"subjectPrefix": "orders.*"}))
    assert "spec.nats.subjectPrefix" in message
    message = refused(
        crd, group("weighed", namespace, assignment={"strategy": "modulo", "loadAware": True})
    )
    assert "loadAware needs strategy sticky" in message
    message = refused(crd, group("orders.eu", namespace))
    assert "metadata.name must not contain '.'" in message
    # 0 as an integer: the schema's minimum (0.1) alone would let it through.
    for wait in (0, 0.05):
        message = refused(crd, group("ack", namespace, nats={"consumer": {"ackWaitSeconds": wait}}))
        assert "spec.nats.consumer.ackWaitSeconds" in message
    # maxMessagesPerSecond: a positive number (issue 27); 0 as an integer too.
    for rate in (-5, 0, -0.5):
        consumer = {"maxMessagesPerSecond": rate}
        message = refused(crd, group("rate", namespace, nats={"consumer": consumer}))
        assert "spec.nats.consumer.maxMessagesPerSecond" in message
        assert "should be greater than 0" in message
    # A positive one is kept, and a merge patch of null removes it (no limit; no default).
    apply(crd, group("rate", namespace, nats={"consumer": {"maxMessagesPerSecond": 0.5}}))
    consumer = get_json(crd, "cg", "rate", "-n", namespace)["spec"]["nats"]["consumer"]
    assert consumer["maxMessagesPerSecond"] == 0.5
    unset = '{"spec":{"nats":{"consumer":{"maxMessagesPerSecond":null}}}}'
    crd.kubectl("patch", "cg", "rate", "-n", namespace, "--type", "merge", "-p", unset)
    consumer = get_json(crd, "cg", "rate", "-n", namespace)["spec"]["nats"]["consumer"]
    assert "maxMessagesPerSecond" not in consumer
    crd.kubectl("delete", "cg", "rate", "-n", namespace)
    # Nothing was stored.
    assert get_json(crd, "cg", "-n", namespace)["items"] == []


ZERO_WITH_AUTOSCALING = "replicas must be at least 1 while autoscaling is enabled"


def test_replicas_zero_is_refused_while_autoscaling_is_enabled(
    crd: LocalKube, namespace: str
) -> None:
    """Issue 24, defect 10d: the autoscaler runs in the members, so an autoscaled group
    at 0 never comes back. Refused, also through the scale subresource (kubectl scale,
    an HPA); without autoscaling, 0 stops the group by hand and is accepted."""
    message = refused(crd, group("zero", namespace, replicas=0, autoscaling={"enabled": True}))
    assert ZERO_WITH_AUTOSCALING in message
    apply(crd, group("auto", namespace, autoscaling={"enabled": True}))
    result = crd.kubectl("scale", "cg", "auto", "-n", namespace, "--replicas=0", check=False)
    assert result.returncode != 0 and ZERO_WITH_AUTOSCALING in result.stderr, result.stderr
    assert get_json(crd, "cg", "auto", "-n", namespace)["spec"]["replicas"] == 3
    # Stopping it by hand: autoscaling off and 0 in one change.
    apply(crd, group("auto", namespace, replicas=0, autoscaling={"enabled": False}))
    assert get_json(crd, "cg", "auto", "-n", namespace)["spec"]["replicas"] == 0


def test_replicas_beyond_partitions_are_refused(crd: LocalKube, namespace: str) -> None:
    """A member beyond the partition count owns none: `kubectl scale cg --replicas=20` on a
    group of 16 partitions made 4 idle members and said nothing. Refused, through the
    scale subresource too, as maxReplicas beyond partitions is."""
    message = refused(crd, group("wide", namespace, partitions=4, maxReplicas=4, replicas=5))
    assert "replicas must not exceed partitions" in message
    apply(crd, group("narrow", namespace, partitions=4, maxReplicas=4, replicas=4))
    result = crd.kubectl("scale", "cg", "narrow", "-n", namespace, "--replicas=5", check=False)
    assert result.returncode != 0, result.stdout
    assert "replicas must not exceed partitions" in result.stderr, result.stderr
    assert get_json(crd, "cg", "narrow", "-n", namespace)["spec"]["replicas"] == 4


def test_partitions_are_immutable(crd: LocalKube, namespace: str) -> None:
    apply(crd, group("fixed", namespace, partitions=64))
    message = refused(crd, group("fixed", namespace, partitions=32))
    assert "partitions is immutable" in message
    # Everything else still changes, and the same value is no change.
    apply(crd, group("fixed", namespace, partitions=64, replicas=4))
    spec = get_json(crd, "cg", "fixed", "-n", namespace)["spec"]
    assert (spec["partitions"], spec["replicas"]) == (64, 4)
    # Leaving partitions out defaults it to 128: also a change, also refused.
    message = refused(crd, group("fixed", namespace))
    assert "partitions is immutable" in message


def patch_refused(plane: LocalKube, name: str, namespace: str, patch: dict[str, Any]) -> str:
    """`kubectl patch` (merge) that the API server must refuse; its message, on one line."""
    result = plane.kubectl(
        "patch", "cg", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch), check=False
    )
    assert result.returncode != 0, f"accepted: {patch}\n{result.stdout}"
    assert "is invalid" in result.stderr, result.stderr
    return " ".join(result.stderr.split())


def test_subject_prefix_and_stream_name_are_immutable(crd: LocalKube, namespace: str) -> None:
    """Changed after creation, the durables would keep filtering the old subjects, or the
    pods would roll to a stream that does not exist: refused, as partitions is."""
    nats = {"subjectPrefix": "orders.in", "stream": {"name": "orders"}}
    apply(crd, group("moved", namespace, nats=nats))
    message = patch_refused(crd, "moved", namespace, {"spec": {"nats": {"subjectPrefix": "x.y"}}})
    assert "nats.subjectPrefix is immutable" in message, message
    assert "create another group" in message, message
    message = patch_refused(
        crd, "moved", namespace, {"spec": {"nats": {"stream": {"name": "other"}}}}
    )
    assert "nats.stream.name is immutable" in message, message
    # Removing them is a change too (back to the defaults).
    message = patch_refused(
        crd, "moved", namespace, {"spec": {"nats": {"subjectPrefix": None, "stream": None}}}
    )
    assert "nats.subjectPrefix is immutable" in message, message
    assert "nats.stream.name is immutable" in message, message
    # Everything else in nats still changes, and the same values are no change.
    crd.kubectl(
        "patch",
        "cg",
        "moved",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"nats": {**nats, "stream": {"name": "orders", "ledger": True}}}}),
    )
    stored = get_json(crd, "cg", "moved", "-n", namespace)["spec"]["nats"]
    assert (stored["subjectPrefix"], stored["stream"]["name"]) == ("orders.in", "orders")
    assert stored["stream"]["ledger"] is True

    # Unset at creation: setting either later is refused, even to the default's value
    # (the default holds the namespace, which the rule cannot read).
    apply(crd, group("plain", namespace))
    default = {"subjectPrefix": f"shoal.{namespace}.plain"}
    message = patch_refused(crd, "plain", namespace, {"spec": {"nats": default}})
    assert "nats.subjectPrefix is immutable" in message, message
    message = patch_refused(
        crd, "plain", namespace, {"spec": {"nats": {"stream": {"name": "plain"}}}}
    )
    assert "nats.stream.name is immutable" in message, message


def test_the_api_server_and_the_model_agree_on_whitespace_and_empty(
    crd: LocalKube, namespace: str
) -> None:
    """U+00A0 is no whitespace to the API server's RE2: the stored spec must pass the model
    too (before, the model's Unicode `\\s` refused it, and the operator's status timer and
    finalizer failed on the group). A tab is whitespace to both: refused. An empty stream
    name and subject prefix mean the defaults, as the CRD's descriptions say (before, the
    CRD refused them)."""
    odd = {
        "subjectPrefix": "orders.in\u00a0x",
        "stream": {"name": "orders\u00a0x"},
    }
    made = group("odd", namespace, nats=odd)
    made["spec"].update(handler="http://127.0.0.1:8080/in\u00a0x", handlerReadyPath="/r\u00a0x")
    apply(crd, made)
    stored = get_json(crd, "cg", "odd", "-n", namespace)["spec"]
    assert stored["nats"]["subjectPrefix"] == "orders.in\u00a0x"
    model = parse_spec(stored)  # what the operator reads
    assert (model.nats.subject_prefix, model.nats.stream.name) == (
        "orders.in\u00a0x",
        "orders\u00a0x",
    )
    assert model.handler_ready_path == "/r\u00a0x"

    for nats in ({"subjectPrefix": "orders.in\tx"}, {"stream": {"name": "orders\tx"}}):
        message = refused(crd, group("tabbed", namespace, nats=nats))
        assert "should match" in message, message
        with pytest.raises(SpecError):
            parse_spec(group("tabbed", namespace, nats=nats)["spec"])

    apply(crd, group("empty", namespace, nats={"subjectPrefix": "", "stream": {"name": ""}}))
    stored = get_json(crd, "cg", "empty", "-n", namespace)["spec"]
    model = parse_spec(stored)
    assert (model.nats.subject_prefix, model.nats.stream.name) == ("", "")


# -- spec.containers: the team's services, as native sidecars ----------------------------

SERVICE_CONTAINER = {
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


def with_containers(name: str, namespace: str, containers: Any) -> dict[str, Any]:
    return group(name, namespace, containers=containers)


def words(message: str) -> str:
    """A refusal's message on one line (kubectl wraps long ones)."""
    return " ".join(message.split())


def test_bad_containers_are_refused_with_readable_messages(crd: LocalKube, namespace: str) -> None:
    message = words(refused(crd, with_containers("no-name", namespace, [{"image": "x:1"}])))
    assert "spec.containers[0].name: Required value" in message
    message = words(refused(crd, with_containers("no-image", namespace, [{"name": "api"}])))
    assert "spec.containers[0].image: Required value" in message
    message = words(
        refused(crd, with_containers("empty-image", namespace, [{"name": "api", "image": ""}]))
    )
    assert "spec.containers[0].image" in message
    message = words(
        refused(crd, with_containers("ours", namespace, [{"name": "consumer", "image": "x:1"}]))
    )
    assert "containers must not be named 'consumer': that is the name of Shoal's own" in message
    twice = [{"name": "api", "image": "x:1"}, {"name": "cache", "image": "y"}]
    twice.append({"name": "api", "image": "x:2"})
    message = words(refused(crd, with_containers("twice", namespace, twice)))
    assert "spec.containers: Invalid value" in message
    assert "containers must have unique names" in message
    message = words(
        refused(crd, with_containers("upper", namespace, [{"name": "API", "image": "x:1"}]))
    )
    assert "spec.containers[0].name" in message and "should match" in message
    message = words(
        refused(
            crd,
            with_containers(
                "never", namespace, [{"name": "api", "image": "x", "restartPolicy": "Never"}]
            ),
        )
    )
    assert "spec.containers[0].restartPolicy: Unsupported value" in message
    message = words(
        refused(
            crd,
            with_containers(
                "many", namespace, [{"name": f"c{i}", "image": "x"} for i in range(17)]
            ),
        )
    )
    assert "spec.containers: Too many" in message
    assert get_json(crd, "cg", "-n", namespace)["items"] == []


def test_a_good_group_keeps_every_container_field(crd: LocalKube, namespace: str) -> None:
    apply(
        crd,
        with_containers(
            "served", namespace, [SERVICE_CONTAINER, {"name": "agent", "image": "a:2"}]
        ),
    )
    stored = get_json(crd, "cg", "served", "-n", namespace)["spec"]["containers"]
    # Unknown fields are kept (the item preserves them), nothing is defaulted.
    assert stored == [SERVICE_CONTAINER, {"name": "agent", "image": "a:2"}]


def test_the_built_deployment_is_a_valid_pod_template_with_native_sidecars(
    crd: LocalKube, namespace: str
) -> None:
    spec = {
        "handler": "shoal.consumer.handlers:ledger",
        "containers": [SERVICE_CONTAINER, {"name": "agent", "image": "a:2"}],
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


def test_a_handler_socket_deployment_is_a_valid_pod_template(
    crd: LocalKube, namespace: str
) -> None:
    """spec.handlerSocket's shared directory, as the API server takes it: one emptyDir,
    mounted by the member and the sidecar; in /tmp, the tmp volume once."""
    for socket, volume in (("/run/handler/http.sock", "handler-socket"), ("/tmp/h.sock", "tmp")):
        spec = {
            "handler": "http://localhost/messages",
            "handlerSocket": socket,
            "containers": [SERVICE_CONTAINER],
        }
        apply(crd, group("sock", namespace, **spec))
        crd.kubectl("delete", "cg", "sock", "-n", namespace)
        deployment = build_deployment("sock", namespace, spec, OperatorSettings())
        result = apply(crd, deployment, "--dry-run=server", "-o", "json")
        template = json.loads(result.stdout)["spec"]["template"]["spec"]
        directory = socket.rsplit("/", 1)[0]
        for container in (template["containers"][0], template["initContainers"][0]):
            assert {"name": volume, "mountPath": directory} in container["volumeMounts"]
        assert [v["name"] for v in template["volumes"]].count(volume) == 1
