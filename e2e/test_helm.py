"""The Helm chart on the local control plane: lint, install, a working group, test, uninstall.

The operator runs as a Pod of the release (the process kubelet starts `shoal-operator`
from this virtualenv with its ServiceAccount's token, so the chart's RBAC is what it gets)
and watches only `helm-demo`: other suites run their own operators on the same plane.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from harness.kubetest import adopt_crd_for_helm, condition, get_json, wait_until
from harness.localkube.plane import LocalKube
from harness.servers import free_port
from harness.waiting import eventually
from shoal.contracts.names import DELETION_COST_ANNOTATION

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "shoal"
EXAMPLE = REPO / "examples" / "consumergroup.yaml"
RELEASE, RELEASE_NS, DEMO_NS = "shoal", "shoal-system", "helm-demo"
OPERATOR = f"{RELEASE}-operator"  # the chart's Deployment: <fullname>-operator
CRD = "consumergroups.shoal.dev"
GROUP = "orders"
RELEASE_LABELS = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/managed-by=Helm"


def run(
    plane: LocalKube, *command: str, check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """helm or kubectl with the plane's environment (KUBECONFIG, PATH to the tools)."""
    result = subprocess.run(
        list(command),
        env={**os.environ, **plane.env()},
        capture_output=True,
        text=True,
        input=input_text,
        timeout=200,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def helm(plane: LocalKube, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(plane, "helm", *args, check=check)


def kubectl(
    plane: LocalKube, *args: str, check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    return run(plane, "kubectl", *args, check=check, input_text=input_text)


def ensure_namespace(plane: LocalKube, name: str) -> None:
    """Create a namespace (if missing) and wait for its default ServiceAccount."""
    if kubectl(plane, "get", "namespace", name, check=False).returncode != 0:
        kubectl(plane, "create", "namespace", name)
    wait_until(
        lambda: kubectl(plane, "get", "sa", "default", "-n", name, check=False).returncode == 0,
        30,
        f"the default service account of {name}",
    )


def release_objects(plane: LocalKube) -> list[str]:
    """Whatever the release labelled that still exists, anywhere in the cluster."""
    found = kubectl(
        plane,
        "get",
        "deployments,replicasets,pods,serviceaccounts,roles,rolebindings,"
        "clusterroles,clusterrolebindings",
        "--all-namespaces",
        "-l",
        RELEASE_LABELS,
        "-o",
        "name",
    )
    return found.stdout.split()


def operator_log(plane: LocalKube) -> str:
    """The operator container's log, as the process kubelet writes it."""
    logs = sorted((plane.root / "logs" / "pods").glob(f"{RELEASE_NS}_{OPERATOR}-*_operator.log"))
    assert logs, "no operator log"
    return "".join(path.read_text(errors="replace") for path in logs)


def diagnostics(plane: LocalKube) -> str:
    """What to look at when the release misbehaves: pods, the group, the operator's log."""
    parts = []
    for args in (
        ("get", "pods", "-n", RELEASE_NS, "-o", "wide"),
        ("get", "pods", "-n", DEMO_NS, "-o", "wide"),
        ("get", "cg", "-n", DEMO_NS, "-o", "yaml"),
        ("get", "events", "-n", RELEASE_NS),
    ):
        result = kubectl(plane, *args, check=False)
        parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
    for log in sorted((plane.root / "logs" / "pods").glob(f"{RELEASE_NS}_*.log")):
        parts.append(f"--- {log.name} (last 4000 chars)\n{log.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def chart(localkube: LocalKube) -> Path:
    """The chart to install; the plane's API server reports its real version (build.sh)."""
    server = json.loads(kubectl(localkube, "get", "--raw", "/version").stdout)["gitVersion"]
    assert not server.startswith("v0.0.0"), (
        f"the plane's API server calls itself {server}: rebuild it with `make tools` "
        "(build.sh stamps the version)"
    )
    return CHART


def test_chart_lints_clean(localkube: LocalKube) -> None:
    result = helm(localkube, "lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in result.stdout
    assert "[ERROR]" not in result.stdout and "[WARNING]" not in result.stdout, result.stdout


def test_schema_refuses_bad_values(localkube: LocalKube) -> None:
    result = helm(
        localkube,
        "lint",
        str(CHART),
        "--set",
        "image.pullPolicy=Sometimes",
        "--set",
        "logLevel=loud",
        "--set",
        "watchNamespaces[0]=Not_A_Namespace",
        check=False,
    )
    assert result.returncode != 0
    out = result.stdout + result.stderr
    for path in ("/image/pullPolicy", "/logLevel", "/watchNamespaces/0"):
        assert path in out, out


def group_manifest() -> str:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"] = {"name": GROUP, "namespace": DEMO_NS}
    manifest["spec"]["replicas"] = 2
    return json.dumps(manifest)


def test_install_run_a_group_test_and_uninstall(localkube: LocalKube, chart: Path) -> None:
    plane = localkube
    # The chart puts the operator's Role in each watched namespace: they must exist first.
    ensure_namespace(plane, DEMO_NS)
    try:
        _install_run_a_group_test_and_uninstall(plane, chart)
    except BaseException:
        print(diagnostics(plane))
        raise
    finally:
        helm(plane, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)
        for ns in (DEMO_NS, RELEASE_NS):
            kubectl(plane, "delete", "namespace", ns, "--wait=false", check=False)


def _install_run_a_group_test_and_uninstall(plane: LocalKube, chart: Path) -> None:
    # The chart manages the CRD; other suites may have applied it with kubectl already.
    adopt_crd_for_helm(plane, RELEASE, RELEASE_NS)
    # Pods share the host's loopback: the liveness endpoint gets a free port, not 8080.
    started = time.monotonic()
    helm(
        plane,
        "install",
        RELEASE,
        str(chart),
        "-n",
        RELEASE_NS,
        "--create-namespace",
        "-f",
        str(plane.root / "values.yaml"),
        "--set",
        f"watchNamespaces={{{DEMO_NS}}}",
        "--set",
        f"livenessProbe.port={free_port()}",
        "--wait",
        "--timeout",
        "120s",
    )
    installed = time.monotonic() - started
    print(f"helm install --wait took {installed:.1f} s")

    # The operator runs as the release's Pod, on this plane's NATS and etcd, watching only
    # helm-demo, with the chart's security settings.
    deployment = get_json(plane, "deployment", OPERATOR, "-n", RELEASE_NS)
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["shoal-operator"]
    assert container["args"][:2] == ["--namespace", DEMO_NS]
    assert container["args"].count("--namespace") == 1
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["NATS_URL"] == plane.state.nats_url
    assert env["ETCD_ENDPOINTS"] == plane.state.etcd_endpoint
    assert env["SHOAL_OPERATOR_IMAGE"] == "shoal:dev"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    pods = get_json(plane, "pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=operator")
    assert len(pods["items"]) == 1
    assert pods["items"][0]["status"]["phase"] == "Running"
    # Namespaced mode: the ConsumerGroup permissions are a Role in helm-demo only.
    kubectl(plane, "get", "role", OPERATOR, "-n", DEMO_NS)
    cluster_role = get_json(plane, "clusterrole", f"{RELEASE_NS}-{RELEASE}-operator")
    assert not any("shoal.dev" in rule["apiGroups"] for rule in cluster_role["rules"])
    # Groups' spec.etcd.tlsSecret: the operator may get Secrets in the watched namespace
    # only, and never list them.
    operator_sa = f"system:serviceaccount:{RELEASE_NS}:{OPERATOR}"
    for verb, namespace, allowed in (
        ("get", DEMO_NS, "yes"),
        ("list", DEMO_NS, "no"),
        ("get", "default", "no"),
    ):
        answer = kubectl(
            plane,
            "auth",
            "can-i",
            verb,
            "secrets",
            "-n",
            namespace,
            "--as",
            operator_sa,
            check=False,
        ).stdout.strip()
        assert answer == allowed, (verb, namespace, answer)

    # A first group, as NOTES.txt suggests: Ready with a leader and balanced partitions.
    started = time.monotonic()
    kubectl(plane, "apply", "-f", "-", input_text=group_manifest())
    cg = wait_until(
        lambda: (
            (c := get_json(plane, "cg", GROUP, "-n", DEMO_NS))
            and condition(c, "Ready").get("status") == "True"
            and c
        ),
        90,
        "the group to become Ready",
    )
    print(f"the group became Ready in {time.monotonic() - started:.1f} s")
    status = cg["status"]
    assert status["leader"].startswith(f"{GROUP}-consumer-")
    assert status["skew"] <= 1
    assert status["members"] == 2 and status["readyReplicas"] == 2

    # The leader marks its members' pods with pod-deletion-cost (its own highest) through
    # the chart's consumer-pod policy, which lets exactly that through.
    leader_pod = wait_until(
        lambda: (
            (p := get_json(plane, "pod", status["leader"], "-n", DEMO_NS))
            and DELETION_COST_ANNOTATION in p["metadata"].get("annotations", {})
            and p
        ),
        30,
        "the leader to mark its pod with pod-deletion-cost",
    )
    assert int(leader_pod["metadata"]["annotations"][DELETION_COST_ANNOTATION]) > 0
    for pod_log in (plane.root / "logs" / "pods").glob(f"{DEMO_NS}_{GROUP}-consumer-*.log"):
        assert "Forbidden" not in pod_log.read_text(errors="replace"), pod_log.name

    header, row = kubectl(plane, "get", "cg", "-n", DEMO_NS).stdout.strip().splitlines()
    assert header.split() == ["NAME", "REPLICAS", "READY", "LEADER", "STATUS", "SKEW", "LAG", "AGE"]
    assert row.split()[:3] == [GROUP, "2", "2"]
    assert row.split()[3].startswith(f"{GROUP}-consumer-")
    described = wait_until(
        lambda: (
            (d := kubectl(plane, "describe", "cg", GROUP, "-n", DEMO_NS).stdout)
            and "Reconciled" in d
            and d
        ),
        30,
        "a Reconciled event in kubectl describe",
    )
    assert "Events:" in described

    # helm test: its hook pod checks the CRD is served and the operator available.
    started = time.monotonic()
    tested = helm(plane, "test", RELEASE, "-n", RELEASE_NS, "--timeout", "120s")
    print(f"helm test took {time.monotonic() - started:.1f} s")
    assert re.search(r"Phase:\s+Succeeded", tested.stdout), tested.stdout
    # Passed: its hook resources are deleted (hook-succeeded).
    wait_until(
        lambda: (
            not [
                name
                for name in release_objects(plane)
                if name.rsplit("/", 1)[1] in (f"{RELEASE}-test", f"{RELEASE_NS}-{RELEASE}-test")
            ]
        ),
        60,
        "the test hook's resources to be deleted",
    )

    # The group goes first (the operator must still run to remove its finalizer) ...
    kubectl(plane, "delete", "cg", GROUP, "-n", DEMO_NS, "--timeout=60s")
    wait_until(
        lambda: not get_json(plane, "deployments", "-n", DEMO_NS)["items"],
        60,
        "the group's Deployment to be deleted",
    )
    # The chart's RBAC is complete: kopf never fell back for lack of permissions, and no
    # API call of the operator (create, observe, delete) was refused.
    log = operator_log(plane)
    for refusal in ("Forbidden", "Not enough permissions"):
        assert refusal not in log, log[-4000:]

    # ... then the release: nothing of it is left, the CRD stays (crds.keep, the default).
    helm(plane, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "120s")
    assert helm(plane, "list", "-n", RELEASE_NS, "-q").stdout.strip() == ""
    wait_until(
        lambda: not get_json(plane, "pods", "-n", RELEASE_NS)["items"],
        60,
        "the operator pod to be gone",
    )
    assert kubectl(plane, "get", "deployment", OPERATOR, "-n", RELEASE_NS, check=False).returncode
    eventually(
        lambda: release_objects(plane),
        60,
        "no resources of the release left after helm uninstall",
        until=lambda left: not left,
        interval=0.5,
    )
    assert get_json(plane, "crd", CRD)["metadata"]["name"] == CRD
