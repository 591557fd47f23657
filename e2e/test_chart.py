"""The Helm chart rendered with `helm template`: what each value puts where (no cluster).

Marked e2e because it needs the helm binary `make tools` builds; it starts no server.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.localkube.tools import find_tools

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "shoal"
SOURCE_CRD = REPO / "crds" / "consumergroup.yaml"
KUBE_VERSION = "1.35.0"
KEEP = "helm.sh/resource-policy"


def helm_template(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(find_tools().helm),
            "template",
            "shoal",
            str(CHART),
            "-n",
            "shoal-system",
            "--kube-version",
            KUBE_VERSION,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=check,
    )


def render(*args: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(helm_template(*args).stdout) if doc]


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in docs if doc["kind"] == kind]
    return found


def test_rendered_crd_is_the_source_crd_plus_helm_metadata() -> None:
    rendered = only(render(), "CustomResourceDefinition")
    source = yaml.safe_load(SOURCE_CRD.read_text())
    # Helm's labels are added, the CRD's own kept; the keep policy is on by default.
    assert source["metadata"]["labels"].items() <= rendered["metadata"]["labels"].items()
    assert rendered["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert rendered["metadata"]["annotations"] == {KEEP: "keep"}
    # Everything else is the source, value for value (JSON: YAML's 5.0 and 5 are one number).
    rendered_rest = {k: v for k, v in rendered.items() if k != "metadata"}
    source_rest = {k: v for k, v in source.items() if k != "metadata"}
    assert json.loads(json.dumps(rendered_rest)) == json.loads(json.dumps(source_rest))
    assert rendered["metadata"]["name"] == source["metadata"]["name"]


def test_crds_keep_false_and_crds_enabled_false() -> None:
    crd = only(render("--set", "crds.keep=false"), "CustomResourceDefinition")
    assert KEEP not in crd["metadata"].get("annotations", {})
    kinds = [doc["kind"] for doc in render("--set", "crds.enabled=false")]
    assert "CustomResourceDefinition" not in kinds and "Deployment" in kinds


def test_operator_extension_points_reach_the_operator_pod(tmp_path: Path) -> None:
    values = {
        "extraEnv": [
            {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
            {"name": "SHOAL_LOG_LEVEL", "value": "debug"},
        ],
        "resources": {"requests": {"cpu": "50m"}, "limits": {"memory": "256Mi"}},
        "nodeSelector": {"pool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "podAnnotations": {"example.com/scrape": "true"},
        "priorityClassName": "system-cluster-critical",
        "imagePullSecrets": [{"name": "registry"}],
    }
    path = tmp_path / "values.json"
    path.write_text(json.dumps(values))
    deployment = only(render("-f", str(path)), "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = container["env"]
    # extraEnv comes last, so its SHOAL_LOG_LEVEL is the one the container gets.
    assert env[-2:] == values["extraEnv"]
    assert [v["value"] for v in env if v["name"] == "SHOAL_LOG_LEVEL"][-1] == "debug"
    assert container["resources"] == values["resources"]
    assert pod["metadata"]["annotations"] == values["podAnnotations"]
    for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert pod["spec"][field] == values[field], field
    assert pod["spec"]["imagePullSecrets"] == values["imagePullSecrets"]


def test_unset_extension_points_leave_the_operator_pod_plain() -> None:
    pod = only(render(), "Deployment")["spec"]["template"]
    for field in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert field not in pod["spec"], field
    assert "annotations" not in pod["metadata"]
    # An operator that fails says why in `kubectl describe pod`: its log's end.
    (container,) = pod["spec"]["containers"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize(
    ("setting", "where"),
    [
        ("crds.enabled=maybe", "/crds/enabled"),
        ("extraEnv[0].value=x", "/extraEnv/0"),
        ("priorityClassName[0]=x", "/priorityClassName"),
        ("consumerPodPolicy.annotation=a' || true || 'b", "/consumerPodPolicy/annotation"),
        ("nats.credentialsType=password", "/nats/credentialsType"),
        ("nats.tlsClientCertificate=perhaps", "/nats/tlsClientCertificate"),
        ("replicas=0", "/replicas"),
    ],
)
def test_the_schema_refuses_bad_values(setting: str, where: str) -> None:
    result = helm_template("--set", setting, check=False)
    assert result.returncode != 0
    assert where in result.stderr, result.stderr


def test_one_operator_replica_runs_alone_and_more_elect_a_leader_on_one_lease() -> None:
    def lease_rules(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            rule
            for doc in docs
            if doc["kind"] in ("Role", "ClusterRole")
            for rule in doc["rules"]
            if "leases" in rule["resources"]
        ]

    alone = render()
    deployment = only(alone, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert not any(arg.startswith("--leader-elect") for arg in container["args"])
    assert not lease_rules(alone)

    docs = render("--set", "replicas=2", "--set", "watchNamespaces={a,b}")
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--leader-elect" in args
    assert args[args.index("--leader-elect-lease") + 1] == "shoal-operator"
    assert args[args.index("--leader-elect-namespace") + 1] == "shoal-system"
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Least privilege: create any Lease (create cannot be narrowed to a name), get and
    # update only this one, in the release namespace only, whatever namespaces it serves.
    (role,) = [doc for doc in docs if doc["kind"] == "Role" and lease_rules([doc])]
    assert role["metadata"]["namespace"] == "shoal-system"
    assert lease_rules([role]) == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["shoal-operator"],
            "verbs": ["get", "update"],
        },
    ]
    (binding,) = [
        doc
        for doc in docs
        if doc["kind"] == "RoleBinding" and doc["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["metadata"]["namespace"] == "shoal-system"
    service_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"][0]["name"] == service_account


def test_operator_secret_access_is_get_only_and_narrowed_by_secret_names() -> None:
    def secret_rules(*args: str) -> list[dict[str, Any]]:
        return [
            rule
            for doc in render(*args)
            if doc["kind"] in ("Role", "ClusterRole")
            for rule in doc["rules"]
            if "secrets" in rule["resources"]
        ]

    (everywhere,) = secret_rules()
    assert everywhere == {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    narrowed = secret_rules(
        "--set", "watchNamespaces={a,b}", "--set", "rbac.secretNames={etcd-client}"
    )
    assert len(narrowed) == 2  # one Role per watched namespace, no cluster-wide rule
    for rule in narrowed:
        assert rule["verbs"] == ["get"] and rule["resourceNames"] == ["etcd-client"]


def test_consumer_pod_policy_is_bound_to_the_watched_namespaces() -> None:
    docs = render("--set", "watchNamespaces={a,b}")
    policy = only(docs, "ValidatingAdmissionPolicy")
    binding = only(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["paramKind"] == {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "ConsumerGroup",
    }
    (expression,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == ["a", "b"]
    # Cluster-wide without a list; none at all when switched off.
    assert "matchResources" not in only(render(), "ValidatingAdmissionPolicyBinding")["spec"]
    kinds = {doc["kind"] for doc in render("--set", "consumerPodPolicy.enabled=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_monitoring_resources_ship_the_files_as_they_are() -> None:
    docs = render(
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "watchNamespaces={team-a}",
    )
    rule = only(docs, "PrometheusRule")
    alerts = yaml.safe_load((CHART / "files" / "prometheus" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    monitor = only(docs, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "shoal-consumer"}
    }
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets == {
        "group": ["__meta_kubernetes_pod_label_shoal_dev_group"],
        "member": ["__meta_kubernetes_pod_name"],
    }
    dashboard = only(docs, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(dashboard["data"]["shoal.json"])
    assert shipped == json.loads((CHART / "files" / "dashboards" / "shoal.json").read_text())


def test_monitoring_is_opt_in_except_the_dashboard_and_the_metrics_port() -> None:
    docs = render()
    kinds = {doc["kind"] for doc in docs}
    assert not kinds & {"PodMonitor", "PrometheusRule"}
    assert "ConfigMap" in kinds
    (container,) = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["SHOAL_CONSUMER_METRICS_PORT"] == "9102"
    (container,) = only(render("--set", "consumerMetrics.port=null"), "Deployment")["spec"][
        "template"
    ]["spec"]["containers"]
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["SHOAL_CONSUMER_METRICS_PORT"] == ""


def test_consumer_probes_are_http_on_8081_unless_the_port_is_null() -> None:
    """What the operator reads (settings_from_env): 8081 gives the pods httpGet probes on
    a container port named health; null (the local plane without --pod-network) exec."""
    from shoal.operator.settings import settings_from_env

    def operator_env(*args: str) -> dict[str, str]:
        deployment = only(render(*args), "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return {var["name"]: var.get("value", "") for var in container["env"] if "value" in var}

    assert settings_from_env(operator_env()).consumer_health_port == 8081
    nulled = operator_env("--set", "consumerProbes.port=null")
    assert nulled["SHOAL_CONSUMER_HEALTH_PORT"] == ""
    assert settings_from_env(nulled).consumer_health_port is None
    refused = helm_template("--set", "consumerProbes.port=0", check=False)
    assert refused.returncode != 0 and "/consumerProbes/port" in refused.stderr, refused.stderr


def operator_nats(*args: str) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """The operator container's NATS_* env (name -> var), its mounts and the pod's volumes."""
    pod = only(render(*args), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {var["name"]: var for var in container["env"] if var["name"].startswith("NATS_")}
    return env, container["volumeMounts"], pod["volumes"]


def test_the_operator_is_plain_and_anonymous_on_nats_by_default() -> None:
    env, mounts, volumes = operator_nats()
    assert list(env) == ["NATS_URL"]
    assert [m["name"] for m in mounts] == ["tmp"] and [v["name"] for v in volumes] == ["tmp"]


def test_the_operators_own_nats_tls_and_password_come_from_secrets() -> None:
    env, mounts, volumes = operator_nats(
        "--set",
        "nats.tlsSecret=operator-nats-tls",
        "--set",
        "nats.credentialsSecret=operator-nats",
        "--set",
        "nats.credentialsType=userPassword",
    )
    assert env["NATS_CA_FILE"]["value"] == "/etc/shoal/nats-tls/ca.crt"
    assert env["NATS_CERT_FILE"]["value"] == "/etc/shoal/nats-tls/tls.crt"
    assert env["NATS_KEY_FILE"]["value"] == "/etc/shoal/nats-tls/tls.key"
    for var, key in (("NATS_USER", "user"), ("NATS_PASSWORD", "password")):
        assert env[var]["valueFrom"] == {"secretKeyRef": {"name": "operator-nats", "key": key}}
    assert "NATS_CREDS_FILE" not in env
    assert {"name": "nats-tls", "mountPath": "/etc/shoal/nats-tls", "readOnly": True} in mounts
    (tls,) = [v for v in volumes if v["name"] == "nats-tls"]
    assert tls["secret"]["secretName"] == "operator-nats-tls"
    assert [i["key"] for i in tls["secret"]["items"]] == ["ca.crt", "tls.crt", "tls.key"]
    assert "nats-credentials" not in [v["name"] for v in volumes]  # env, not a file


@pytest.mark.parametrize(
    ("kind", "var", "key"),
    [("creds", "NATS_CREDS_FILE", "creds"), ("nkey", "NATS_NKEY_SEED_FILE", "nkey")],
)
def test_the_operators_credentials_file_is_mounted(kind: str, var: str, key: str) -> None:
    env, mounts, volumes = operator_nats(
        "--set",
        "nats.credentialsSecret=operator-nats",
        "--set",
        f"nats.credentialsType={kind}",
        "--set",
        "nats.tlsSecret=ca-only",
        "--set",
        "nats.tlsClientCertificate=false",
    )
    assert env[var]["value"] == f"/etc/shoal/nats/{key}"
    assert "NATS_PASSWORD" not in env and "NATS_CERT_FILE" not in env
    (creds,) = [v for v in volumes if v["name"] == "nats-credentials"]
    assert creds["secret"] == {"secretName": "operator-nats", "items": [{"key": key, "path": key}]}
    assert {"name": "nats-credentials", "mountPath": "/etc/shoal/nats", "readOnly": True} in mounts
    (tls,) = [v for v in volumes if v["name"] == "nats-tls"]
    assert tls["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_consumer_metrics_and_probe_ports_must_differ() -> None:
    """One number for both would give the consumer pods two container ports with one
    number, and each member would fail to bind its metrics server: refused at render, and
    by the operator's settings for an operator configured by hand."""
    from pydantic import ValidationError

    from shoal.operator.settings import settings_from_env

    same = helm_template(
        "--set", "consumerMetrics.port=8081", "--set", "consumerProbes.port=8081", check=False
    )
    assert same.returncode != 0
    assert "consumerMetrics.port and consumerProbes.port" in same.stderr, same.stderr
    # Either one off (null) leaves nothing to clash with; 0 is any free port.
    for setting in ("consumerProbes.port=null", "consumerMetrics.port=null"):
        helm_template("--set", "consumerMetrics.port=8081", "--set", setting)
    with pytest.raises(ValidationError, match="SHOAL_CONSUMER_METRICS_PORT"):
        settings_from_env(
            {"SHOAL_CONSUMER_METRICS_PORT": "8081", "SHOAL_CONSUMER_HEALTH_PORT": "8081"}
        )
    assert (
        settings_from_env(
            {"SHOAL_CONSUMER_METRICS_PORT": "0", "SHOAL_CONSUMER_HEALTH_PORT": "8081"}
        ).consumer_metrics_port
        == 0
    )


def test_consumer_pod_policy_names_the_label_and_annotation_shoal_writes() -> None:
    """The operator labels pods shoal.dev/group and the leader writes pod-deletion-cost:
    the policy names those two, and the values that once let them differ are refused
    (their old defaults, the only values that ever worked, are still accepted)."""
    from shoal.contracts.names import DELETION_COST_ANNOTATION, GROUP_LABEL

    policy = only(render(), "ValidatingAdmissionPolicy")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["cost"] == f"'{DELETION_COST_ANNOTATION}'"
    assert f"[?'{GROUP_LABEL}']" in policy["spec"]["validations"][0]["expression"]
    for setting, where in (
        ("consumerPodPolicy.groupLabel=example.com/group", "/consumerPodPolicy/groupLabel"),
        ("consumerPodPolicy.annotation=example.com/cost", "/consumerPodPolicy/annotation"),
    ):
        refused = helm_template("--set", setting, check=False)
        assert refused.returncode != 0 and where in refused.stderr, refused.stderr
    old_defaults = render(
        "--set",
        f"consumerPodPolicy.groupLabel={GROUP_LABEL}",
        "--set",
        f"consumerPodPolicy.annotation={DELETION_COST_ANNOTATION}",
    )
    assert only(old_defaults, "ValidatingAdmissionPolicy") == policy


def test_an_image_pinned_by_digest_is_repository_at_digest() -> None:
    def images(*args: str) -> tuple[str, str]:
        (container,) = only(render(*args), "Deployment")["spec"]["template"]["spec"]["containers"]
        env = {var["name"]: var.get("value") for var in container["env"]}
        return container["image"], env["SHOAL_OPERATOR_IMAGE"]

    digest = "sha256:" + "0" * 64
    assert images() == ("shoal:dev", "shoal:dev")
    # The digest wins over the tag, for the operator and the consumer pods alike.
    pinned = images(
        "--set", "image.repository=reg.example/shoal", "--set", f"image.digest={digest}"
    )
    assert pinned == (f"reg.example/shoal@{digest}",) * 2
    for setting, where in (
        (f"image.repository=reg.example/shoal@{digest}", "/image/repository"),
        ("image.digest=0000", "/image/digest"),
    ):
        refused = helm_template("--set", setting, check=False)
        assert refused.returncode != 0 and where in refused.stderr, refused.stderr


def test_pod_labels_cannot_set_the_selectors_labels() -> None:
    deployment = only(render("--set", "podLabels.team=payments"), "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "payments"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for key in ("app\\.kubernetes\\.io/component", "app\\.kubernetes\\.io/instance"):
        refused = helm_template("--set", f"podLabels.{key}=x", check=False)
        assert refused.returncode != 0, refused.stdout[:400]
        assert "podLabels" in refused.stderr and "selector" in refused.stderr, refused.stderr


def test_an_existing_service_account_must_be_named() -> None:
    """Without a name the pod would run as the namespace's `default` ServiceAccount, and
    the chart would grant it the operator's ClusterRole (get on every Secret)."""
    unnamed = helm_template("--set", "serviceAccount.create=false", check=False)
    assert unnamed.returncode != 0
    assert "serviceAccount.name" in unnamed.stderr, unnamed.stderr
    docs = [
        doc
        for doc in render(
            "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops"
        )
        if "helm.sh/hook" not in doc["metadata"].get("annotations", {})  # `helm test`'s own
    ]
    assert "ServiceAccount" not in {doc["kind"] for doc in docs}
    assert only(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    subjects = [
        subject
        for doc in docs
        if doc["kind"] in ("ClusterRoleBinding", "RoleBinding")
        for subject in doc["subjects"]
    ]
    assert subjects and all(s["name"] == "ops" for s in subjects), subjects
