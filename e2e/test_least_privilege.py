"""What a consumer pod may do in the cluster, proven by refusals with real tokens.

On the local plane: two groups' identities exactly as the operator builds them (its
builders' ServiceAccount, Role and RoleBinding), the chart's ValidatingAdmissionPolicy
(rendered by helm from templates/consumer-pod-policy.yaml), pods of both groups, and
a Secret. Group alpha's pod-bound ServiceAccount token, the kind the kubelet gives a
consumer pod, then tries what user handler code in that pod could try. The pods run an
image the process kubelet does not have, so they stay Pending: only the API matters here.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.kubetest import create_namespace, get_json, wait_established, wait_until
from harness.localkube.plane import LocalKube
from harness.localkube.tools import find_tools
from harness.waiting import eventually
from shoal.contracts.names import DELETION_COST_ANNOTATION
from shoal.operator.builders import (
    build_role,
    build_role_binding,
    build_service_account,
    labels,
    resource_names,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "shoal"
CRD = REPO / "crds" / "consumergroup.yaml"
NAMESPACE = "least-privilege"
RELEASE = "lp"  # only names the rendered policy
OURS, THEIRS = "alpha", "beta"
# How the API server words a refusal by the chart's policy (not RBAC's "cannot ...").
VAP_DENIAL = f"ValidatingAdmissionPolicy 'shoal-system-{RELEASE}-shoal-consumer-pods'"


def apply(plane: LocalKube, *objects: dict[str, Any]) -> None:
    body = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(body))


def pod(name: str, group: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": labels(group) if group else {"app": "unrelated"},
        },
        "spec": {
            "serviceAccountName": resource_names(group)["service_account"] if group else "default",
            "containers": [{"name": "consumer", "image": "not-on-this-node:1"}],
            "terminationGracePeriodSeconds": 0,
        },
    }


def group(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"handler": "shoal.consumer.handlers:noop", "replicas": 1},
    }


@dataclass
class Consumer:
    """kubectl as group alpha's consumer pod: its token and nothing else."""

    plane: LocalKube
    kubeconfig: Path

    def kubectl(
        self, *args: str, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(find_tools().kubectl), f"--kubeconfig={self.kubeconfig}", "-n", NAMESPACE, *args],
            capture_output=True,
            text=True,
            input=input_text,
            timeout=60,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
        )

    def refused(self, *args: str) -> str:
        result = self.kubectl(*args)
        assert result.returncode != 0, f"kubectl {' '.join(args)} was allowed: {result.stdout}"
        assert "forbidden" in result.stderr.lower(), result.stderr
        return result.stderr

    def allowed(self, *args: str) -> str:
        result = self.kubectl(*args)
        assert result.returncode == 0, f"kubectl {' '.join(args)}: {result.stderr}"
        return result.stdout


def token_kubeconfig(plane: LocalKube, token: str, path: Path) -> Path:
    """The plane's API server and CA with a bearer token and no client certificate (with
    one, the API server would authenticate the certificate: the admin)."""
    admin = yaml.safe_load(plane.kubeconfig_path.read_text())
    (cluster,) = admin["clusters"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": "consumer", "user": {"token": token}}],
                "contexts": [
                    {"name": "c", "context": {"cluster": cluster["name"], "user": "consumer"}}
                ],
                "current-context": "c",
            }
        )
    )
    path.chmod(0o600)
    return path


def rendered_policy() -> str:
    return subprocess.run(
        [
            str(find_tools().helm),
            "template",
            RELEASE,
            str(CHART),
            "-n",
            "shoal-system",
            "--kube-version",
            "1.35.0",
            "--show-only",
            "templates/consumer-pod-policy.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


@pytest.fixture(scope="module")
def consumer(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Consumer]:
    plane = localkube
    plane.kubectl("apply", "--server-side", "-f", str(CRD))
    wait_established(plane, "consumergroups.shoal.dev")
    policy = rendered_policy()
    create_namespace(plane, NAMESPACE)
    try:
        plane.kubectl("apply", "-f", "-", input_text=policy)
        apply(plane, group(OURS), group(THEIRS))
        for name in (OURS, THEIRS):
            apply(
                plane,
                build_service_account(name, NAMESPACE),
                build_role(name, NAMESPACE),
                build_role_binding(name, NAMESPACE),
            )
        # After the ServiceAccounts: a pod naming a missing one is refused.
        apply(plane, pod(f"{OURS}-0", OURS), pod(f"{THEIRS}-0", THEIRS), pod("unrelated", None))
        apply(
            plane,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "etcd-client", "namespace": NAMESPACE},
                "stringData": {"tls.key": "not for consumers"},
            },
        )
        # A token bound to the group's pod, as the kubelet makes for a consumer container.
        uid = get_json(plane, "pod", f"{OURS}-0", "-n", NAMESPACE)["metadata"]["uid"]
        created = plane.kubectl(
            "create",
            "token",
            resource_names(OURS)["service_account"],
            "-n",
            NAMESPACE,
            "--bound-object-kind=Pod",
            f"--bound-object-name={OURS}-0",
            f"--bound-object-uid={uid}",
            "--duration=10m",
            check=False,
        )
        assert created.returncode == 0, created.stderr
        token = created.stdout.strip()
        path = token_kubeconfig(plane, token, tmp_path_factory.mktemp("token") / "kubeconfig")
        yield Consumer(plane, path)
    finally:
        plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        plane.kubectl("delete", "-f", "-", "--ignore-not-found", check=False, input_text=policy)


def test_the_token_is_the_groups_service_account(consumer: Consumer) -> None:
    whoami = json.loads(consumer.allowed("auth", "whoami", "-o", "json"))
    user = whoami["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{NAMESPACE}:{OURS}-consumer"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == [f"{OURS}-0"]


def cost_patch(value: str) -> str:
    return json.dumps({"metadata": {"annotations": {DELETION_COST_ANNOTATION: value}}})


def test_the_deletion_cost_of_its_own_groups_pod_may_be_set(consumer: Consumer) -> None:
    # The policy compiles its parameters (the groups) asynchronously after they appear.
    wait_until(
        lambda: (
            consumer.kubectl("patch", "pod", f"{OURS}-0", "-p", cost_patch("7")).returncode == 0
        ),
        30,
        "the deletion-cost patch to be allowed",
    )
    annotations = get_json(consumer.plane, "pod", f"{OURS}-0", "-n", NAMESPACE)["metadata"][
        "annotations"
    ]
    assert annotations[DELETION_COST_ANNOTATION] == "7"
    # The leader also lowers a cost again, and takes it away.
    consumer.allowed("patch", "pod", f"{OURS}-0", "-p", cost_patch("-3"))
    consumer.allowed("annotate", "pod", f"{OURS}-0", f"{DELETION_COST_ANNOTATION}-")


def image_patch() -> str:
    return json.dumps(
        {"spec": {"containers": [{"name": "consumer", "image": "attacker.example/miner"}]}}
    )


def test_its_own_pods_image_labels_and_other_annotations_are_refused(consumer: Consumer) -> None:
    own = f"{OURS}-0"
    # Until the policy has loaded the groups it lets everything through, so the wait asks
    # with a server-side dry run (admission runs, nothing is stored): a real patch let
    # through here would change the image, and every later attempt would be a no-op that
    # the policy rightly allows.
    eventually(
        lambda: (
            consumer.kubectl("patch", "pod", own, "-p", image_patch(), "--dry-run=server").stderr
        ),
        30,
        "the policy to refuse an image change",
        until=lambda stderr: VAP_DENIAL in stderr,
        interval=0.3,
    )
    message = consumer.refused("patch", "pod", own, "-p", image_patch())
    assert f"may change only the {DELETION_COST_ANNOTATION} annotation" in message
    for args in (
        ("label", "pod", own, "shoal.dev/group=beta", "--overwrite"),
        ("annotate", "pod", own, "example.com/anything=1"),
        (
            "patch",
            "pod",
            own,
            "--type=json",
            "-p",
            '[{"op":"add","path":"/spec/activeDeadlineSeconds","value":1}]',
        ),
    ):
        assert VAP_DENIAL in consumer.refused(*args), args
    spec = get_json(consumer.plane, "pod", own, "-n", NAMESPACE)["spec"]
    assert spec["containers"][0]["image"] == "not-on-this-node:1"


@pytest.mark.parametrize("other", [f"{THEIRS}-0", "unrelated"])
def test_pods_of_another_group_or_none_are_refused(consumer: Consumer, other: str) -> None:
    for patch in (cost_patch("1"), image_patch()):
        message = consumer.refused("patch", "pod", other, "-p", patch)
        assert VAP_DENIAL in message and "only their own group's pods" in message, message


def test_secrets_are_refused(consumer: Consumer) -> None:
    for args in (("get", "secret", "etcd-client"), ("get", "secrets")):
        assert "cannot" in consumer.refused(*args)


def test_another_groups_scale_is_refused_its_own_allowed(consumer: Consumer) -> None:
    message = consumer.refused("scale", "cg", THEIRS, "--replicas=5")
    assert "consumergroups/scale" in message or "consumergroups.shoal.dev" in message, message
    consumer.refused("patch", "cg", THEIRS, "--type=merge", "-p", '{"spec":{"replicas":5}}')
    # Not its own spec either (image, handler): only the scale subresource.
    consumer.refused("patch", "cg", OURS, "--type=merge", "-p", '{"spec":{"image":"x"}}')
    consumer.allowed("scale", "cg", OURS, "--replicas=2")
    assert get_json(consumer.plane, "cg", OURS, "-n", NAMESPACE)["spec"]["replicas"] == 2


def test_pods_cannot_be_created_or_deleted(consumer: Consumer) -> None:
    consumer.refused("delete", "pod", f"{THEIRS}-0")
    result = consumer.kubectl("create", "-f", "-", input_text=json.dumps(pod("intruder", OURS)))
    assert result.returncode != 0 and "forbidden" in result.stderr.lower(), result.stderr


def test_the_policy_leaves_everyone_else_alone(consumer: Consumer) -> None:
    # The admin (and so controllers, the kubelet) still changes group pods freely.
    consumer.plane.kubectl(
        "label", "pod", f"{OURS}-0", "-n", NAMESPACE, "example.com/checked=yes", "--overwrite"
    )
