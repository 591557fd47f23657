"""The chart's consumer-pod policy while the ConsumerGroup CRD is not served.

The policy (templates/consumer-pod-policy.yaml) takes each ConsumerGroup as a parameter.
While the API server cannot resolve that paramKind (the chart installed with
crds.enabled=false and no CRD applied yet; the half minute after the CRD is created; a CRD
deleted later) it applies the policy's failurePolicy to every pod update, before it looks
at matchConditions: with Fail, every pod update in the cluster was refused, the
cluster-admin's and the controllers' too. Here the chart is installed by helm on an API
server of its own (the local plane's etcd and kube-apiserver, no controllers, scheduler or
kubelet: only admission matters, and the pods stay unscheduled) in each of those states.

The rest of what the policy refuses, with a real pod-bound token, is in
test_least_privilege.py; here a ServiceAccount is impersonated (admission sees the same
user).
"""

from __future__ import annotations

import json
import string
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest

from harness.kubetest import wait_established
from harness.localkube.pki import ensure_pki
from harness.localkube.plane import CLIENTS, LocalKube
from harness.localkube.tools import find_tools
from shoal.contracts.names import DELETION_COST_ANNOTATION, GROUP_LABEL
from shoal.operator.builders import (
    build_role,
    build_role_binding,
    build_service_account,
    resource_names,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "shoal"
CRD_FILE = REPO / "crds" / "consumergroup.yaml"
CRD = "consumergroups.shoal.dev"
NAMESPACE = "team"
GROUP = "orders"
CONSUMER = f"system:serviceaccount:{NAMESPACE}:{resource_names(GROUP)['service_account']}"
# A controller that updates pods (impersonated in system:masters: as admission sees it,
# RBAC aside).
CONTROLLER = "system:serviceaccount:kube-system:replicaset-controller"
POLICY = "ValidatingAdmissionPolicy 'shoal-system-shoal-consumer-pods'"
# How long the API server may take to see a new CRD and load the groups (~25 s seen).
POLICY_LOADS = 120.0


class ApiServerOnly(LocalKube):
    """The local plane's etcd and kube-apiserver, nothing else."""

    def up(self) -> Self:
        tools = self._tools()
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        pki = ensure_pki(self.root / "pki", dict(CLIENTS))
        self.nodes = []
        try:
            self._start_kube_etcd(tools)
            self._start_apiserver(tools, pki)
            self._write_kubeconfigs(pki)
        except BaseException:
            self.state.save(self.state_path)
            self.down()
            raise
        self.state.save(self.state_path)
        return self


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[LocalKube]:
    kube = ApiServerOnly(tmp_path / "plane")
    try:
        kube.up()
        setup_namespace(kube)
        yield kube
    finally:
        kube.down()


def apply(plane: LocalKube, *objects: dict[str, Any]) -> None:
    body = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(body))


def create_pod(plane: LocalKube, body: dict[str, Any]) -> None:
    """`kubectl create`: apply would add a copy of the annotations as one more."""
    path = plane.root / f"{body['metadata']['name']}.json"
    path.write_text(json.dumps(body))
    plane.kubectl("create", "-f", str(path))


def pod(name: str, group: str | None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {GROUP_LABEL: group} if group else {"app": "unrelated"},
            "annotations": annotations or {},
        },
        "spec": {
            "serviceAccountName": resource_names(GROUP)["service_account"],
            "containers": [{"name": "consumer", "image": "not-on-this-node:1"}],
        },
    }


def setup_namespace(plane: LocalKube) -> None:
    """Group orders' identity as the operator builds it, one of its pods and an unrelated
    pod (no controllers here: the default ServiceAccount is made by hand)."""
    plane.kubectl("create", "namespace", NAMESPACE)
    plane.kubectl("create", "serviceaccount", "default", "-n", NAMESPACE)
    apply(
        plane,
        build_service_account(GROUP, NAMESPACE),
        build_role(GROUP, NAMESPACE),
        build_role_binding(GROUP, NAMESPACE),
    )
    apply(plane, pod(f"{GROUP}-0", GROUP), pod("unrelated", None))


def helm_install(plane: LocalKube, *args: str) -> None:
    subprocess.run(
        [
            str(find_tools().helm),
            f"--kubeconfig={plane.kubeconfig_path}",
            "install",
            "shoal",
            str(CHART),
            "-n",
            "shoal-system",
            "--create-namespace",
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )


def update(
    plane: LocalKube, *args: str, user: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`kubectl ARGS` on a pod of the namespace, as `user` (else the cluster-admin)."""
    group = "system:masters" if user == CONTROLLER else "system:authenticated"
    who = [f"--as={user}", f"--as-group={group}"] if user else []
    return plane.kubectl(*args, "-n", NAMESPACE, *who, check=False)


def label(
    plane: LocalKube, name: str, user: str | None = None, **kw: str
) -> subprocess.CompletedProcess[str]:
    pairs = [f"{k}={v}" for k, v in kw.items()] or [f"touched={time.monotonic_ns()}"]
    return update(plane, "label", "pod", name, "--overwrite", *pairs, user=user)


def set_cost(plane: LocalKube, name: str, value: str) -> subprocess.CompletedProcess[str]:
    return update(
        plane,
        "annotate",
        "pod",
        name,
        "--overwrite",
        f"{DELETION_COST_ANNOTATION}={value}",
        user=CONSUMER,
    )


def assert_allowed(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr


def assert_refused(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, f"allowed: {result.stdout}"
    assert POLICY in result.stderr, result.stderr
    return result.stderr


def everyone_may_update_pods(plane: LocalKube) -> None:
    """The cluster-admin and a controller update any pod; nothing says "failed to configure
    policy" (the paramKind the API server cannot resolve)."""
    for name in (f"{GROUP}-0", "unrelated"):
        assert_allowed(label(plane, name))
        assert_allowed(label(plane, name, user=CONTROLLER))


def create_group(plane: LocalKube) -> None:
    group = {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
        "metadata": {"name": GROUP, "namespace": NAMESPACE},
        "spec": {"handler": "shoal.consumer.handlers:noop", "replicas": 1},
    }
    deadline = time.monotonic() + 60
    while True:  # the CRD is Established a moment before its resource is served
        created = plane.kubectl("apply", "-f", "-", input_text=json.dumps(group), check=False)
        if created.returncode == 0:
            return
        assert time.monotonic() < deadline, created.stderr
        time.sleep(0.5)


def wait_for_the_policy_while_everyone_updates_pods(plane: LocalKube) -> float:
    """Until the API server has the CRD and the group loaded, the group's consumer is not
    narrowed; all the while, everyone else's pod updates go through. Returns the wait."""
    started = time.monotonic()
    while True:
        everyone_may_update_pods(plane)
        probe = update(
            plane, "label", "pod", f"{GROUP}-0", "evil=1", "--dry-run=server", user=CONSUMER
        )
        if probe.returncode != 0:
            assert POLICY in probe.stderr, probe.stderr
            return time.monotonic() - started
        assert time.monotonic() - started < POLICY_LOADS, "the policy never narrowed the consumer"
        time.sleep(1.0)


def the_consumer_is_narrowed(plane: LocalKube) -> None:
    assert_allowed(set_cost(plane, f"{GROUP}-0", "5"))
    message = assert_refused(label(plane, f"{GROUP}-0", user=CONSUMER, evil="1"))
    assert f"may change only the {DELETION_COST_ANNOTATION} annotation" in message
    message = assert_refused(set_cost(plane, "unrelated", "5"))
    assert "only their own group's pods" in message
    everyone_may_update_pods(plane)


def test_without_the_crd_pod_updates_go_through(plane: LocalKube) -> None:
    """crds.enabled=false and the CRD applied later, then deleted."""
    helm_install(plane, "--set", "crds.enabled=false")
    assert plane.kubectl("get", "crd", CRD, check=False).returncode != 0
    everyone_may_update_pods(plane)
    # No groups, so no consumer pods to narrow: the consumer's identity is not held either.
    assert_allowed(label(plane, f"{GROUP}-0", user=CONSUMER, before="crd"))

    plane.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    everyone_may_update_pods(plane)
    wait_established(plane, CRD)
    create_group(plane)
    waited = wait_for_the_policy_while_everyone_updates_pods(plane)
    print(f"the policy narrowed the consumer {waited:.1f} s after the group was created")
    the_consumer_is_narrowed(plane)

    # The CRD deleted (and with it the group): pod updates still go through, at once and
    # for as long as the API server takes to notice.
    plane.kubectl("delete", "crd", CRD, "--wait=true", "--timeout=60s")
    for _ in range(10):
        everyone_may_update_pods(plane)
        time.sleep(1.0)


def test_right_after_an_install_that_creates_the_crd(plane: LocalKube) -> None:
    helm_install(plane)  # crds.enabled=true: the CRD comes with the release
    everyone_may_update_pods(plane)
    wait_established(plane, CRD)
    everyone_may_update_pods(plane)
    create_group(plane)
    wait_for_the_policy_while_everyone_updates_pods(plane)
    the_consumer_is_narrowed(plane)


def many_annotations() -> dict[str, str]:
    """As many annotations as a pod may carry (256 KiB in all): the shortest keys, empty
    values, ~88,000 of them; with a little room left for kubectl's own."""
    alnum = string.ascii_letters + string.digits
    keys = list(alnum) + [a + b for a in alnum for b in alnum]
    room = 256 * 1024 - sum(map(len, keys)) - 2000
    keys += [a + m + c for a in alnum for m in alnum + "-._" for c in alnum][: room // 3]
    return dict.fromkeys(keys, "")


def test_no_patch_makes_the_policy_run_out_of_cost_budget(plane: LocalKube) -> None:
    """failurePolicy: Ignore admits a request whose evaluation fails, running out of the CEL
    cost budget included: walking ~88,000 annotations does. No patch may get there."""
    helm_install(plane)
    create_pod(plane, pod(f"{GROUP}-1", GROUP, many_annotations()))
    wait_established(plane, CRD)
    create_group(plane)
    wait_for_the_policy_while_everyone_updates_pods(plane)
    patch = plane.root / "annotations.json"
    patch.write_text(json.dumps({"metadata": {"annotations": many_annotations()}}))
    # Adding them all to a pod with few ...
    assert_refused(
        update(
            plane,
            "patch",
            "pod",
            f"{GROUP}-0",
            "--type=merge",
            f"--patch-file={patch}",
            user=CONSUMER,
        )
    )
    # ... or changing one of a pod that has them all, or its image.
    assert_refused(
        update(plane, "annotate", "pod", f"{GROUP}-1", "--overwrite", "zz9=x", user=CONSUMER)
    )
    image = {"spec": {"containers": [{"name": "consumer", "image": "attacker.example/miner"}]}}
    assert_refused(
        update(plane, "patch", "pod", f"{GROUP}-1", "-p", json.dumps(image), user=CONSUMER)
    )
    # Its cost is refused too (a pod the policy could not check in budget), with the reason.
    message = assert_refused(set_cost(plane, f"{GROUP}-1", "3"))
    assert "with at most 1000 other annotations" in message
    # 1000 others are still fine.
    thousand = {f"a{i}": "v" for i in range(1000)}
    create_pod(plane, pod(f"{GROUP}-2", GROUP, thousand))
    for value in ("1", "2"):
        assert_allowed(set_cost(plane, f"{GROUP}-2", value))
    assert_refused(
        update(plane, "annotate", "pod", f"{GROUP}-2", "--overwrite", "a999=x", user=CONSUMER)
    )
