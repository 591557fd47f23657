"""The local control plane behaves like a cluster: controllers, RBAC, CRDs, process pods."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.kubetest import create_namespace, get_json, wait_until
from harness.localkube.plane import LocalKube, State, alive
from harness.servers import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# A container that runs until SIGTERM, then records that it stopped gracefully.
SLEEPER = (
    "import os, signal, sys, time\n"
    "def bye(*_):\n"
    "    open(os.environ['MARK_DIR'] + '/' + os.environ['POD'], 'w').write('term')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "print('started', os.environ['POD'], flush=True)\n"
    "while True: time.sleep(0.2)\n"
)


def apply(plane: LocalKube, manifest: dict[str, Any] | list[dict[str, Any]]) -> None:
    items = manifest if isinstance(manifest, list) else [manifest]
    plane.kubectl(
        "apply",
        "-f",
        "-",
        input_text=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )


def pod_pids(plane: LocalKube, selector: str, namespace: str) -> dict[str, int]:
    pods = get_json(plane, "pods", "-n", namespace, "-l", selector)["items"]
    result = {}
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses", []):
            running = status.get("state", {}).get("running")
            cid = status.get("containerID", "")
            if (
                running
                and cid.startswith("process://")
                and not pod["metadata"].get("deletionTimestamp")
            ):
                result[pod["metadata"]["name"]] = int(cid.removeprefix("process://"))
    return result


def test_up_and_down_twice_leaves_nothing(tmp_path: Path) -> None:
    """Twice up and down in one directory: nothing left running, and the second plane is a
    new cluster. (It kept the first one's API objects, which pointed at NATS and etcd
    ports the new servers no longer used: a new user's groups and operator all failed
    after `make cluster-down` and `make cluster-up`.)"""
    for round_ in range(2):
        plane = LocalKube(tmp_path / "plane")
        started = time.monotonic()
        plane.up()
        took = time.monotonic() - started
        state = State.load(plane.state_path)
        try:
            nodes = get_json(plane, "nodes")["items"]
            assert [n["metadata"]["name"] for n in nodes] == ["localkube"]
            assert took < 60, f"round {round_}: up took {took:.1f} s"
            env = (plane.root / "env").read_text()
            for var in ("KUBECONFIG", "PATH", "NATS_URL", "ETCD_ENDPOINTS"):
                assert f"export {var}=" in env
            values = yaml.safe_load((plane.root / "values.yaml").read_text())
            assert values["image"]["repository"] == "shoal"
            # Not 8080, where handler services listen on this shared loopback.
            assert values["livenessProbe"]["port"] != 8080
            namespaces = {n["metadata"]["name"] for n in get_json(plane, "namespaces")["items"]}
            assert "left-by-the-first" not in namespaces, f"round {round_}"
            plane.kubectl("create", "namespace", "left-by-the-first")
        finally:
            plane.down()
        for component in state.components:
            assert not alive(component.pid), component
        port = int(state.apiserver_url.rsplit(":", 1)[1])
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0


# Starts a plane and a pod in it, writes `ready`, then waits to be killed.
PLANE_PARENT = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path

    from harness.localkube.plane import LocalKube

    plane = LocalKube(Path(sys.argv[1])).up()
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sleeper", "namespace": "default"},
        "spec": {"containers": [{
            "name": "main", "image": "shoal:dev",
            "command": ["python", "-c", "import time; time.sleep(600)"],
        }]},
    }
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(pod))
    pids = plane.root / "kubelet" / "pids"
    deadline = time.monotonic() + 60
    while not list(pids.glob("*.pid")):
        assert time.monotonic() < deadline, "the pod did not start"
        time.sleep(0.2)
    (plane.root / "ready").write_text("")
    threading.Event().wait()
    """
)


def test_the_plane_and_its_pods_die_with_the_process_that_started_it(tmp_path: Path) -> None:
    """SIGKILL to the process that started a plane: its components and pods go too."""
    root = tmp_path / "plane"
    with (tmp_path / "parent.log").open("wb") as out:
        parent = subprocess.Popen(
            [sys.executable, "-c", PLANE_PARENT, str(root)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    pids: list[int] = []
    try:

        def ready() -> bool:
            if parent.poll() is not None:
                log = (tmp_path / "parent.log").read_text(errors="replace")
                raise AssertionError(f"the parent exited ({parent.returncode}): {log[-3000:]}")
            return (root / "ready").exists()

        wait_until(ready, 120, "the parent's plane and pod")
        components = State.load(root / "state.json").components
        pids = [c.pid for c in components]
        pids += [int(f.read_text()) for f in (root / "kubelet" / "pids").glob("*.pid")]
        assert len(pids) == len(components) + 1 and all(alive(pid) for pid in pids)

        parent.kill()
        parent.wait(10)
        # The pod goes with the kubelet, which goes with the parent.
        wait_until(
            lambda: not [pid for pid in pids if alive(pid)], 10, "the plane and its pod to die"
        )
    finally:
        parent.kill()
        parent.wait(10)
        LocalKube(root).down()  # whatever state.json and the kubelet's pids/ record


def test_deployment_runs_processes_scales_and_cascades(
    localkube: LocalKube, tmp_path: Path
) -> None:
    plane, ns = localkube, "deploy-test"
    create_namespace(plane, ns)
    marks = tmp_path / "marks"
    marks.mkdir()
    apply(
        plane,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "sleeper", "namespace": ns},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "sleeper"}},
                "template": {
                    "metadata": {"labels": {"app": "sleeper"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 10,
                        "containers": [
                            {
                                "name": "main",
                                "image": "shoal:dev",
                                "command": ["python", "-c", SLEEPER],
                                "env": [
                                    {"name": "MARK_DIR", "value": str(marks)},
                                    {
                                        "name": "POD",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    },
                                ],
                                "readinessProbe": {
                                    "exec": {"command": ["true"]},
                                    "periodSeconds": 1,
                                },
                            }
                        ],
                    },
                },
            },
        },
    )
    pids = wait_until(
        lambda: (p := pod_pids(plane, "app=sleeper", ns)) and len(p) == 3 and p,
        60,
        "3 running pods",
    )
    assert all(alive(pid) for pid in pids.values())
    wait_until(
        lambda: (
            get_json(plane, "deployment", "sleeper", "-n", ns)["status"].get("readyReplicas") == 3
        ),
        60,
        "3 ready replicas",
    )
    logs = plane.kubectl("logs", "-n", ns, next(iter(pids))).stdout
    assert "started" in logs

    plane.kubectl("scale", "deployment", "sleeper", "-n", ns, "--replicas=1")
    wait_until(
        lambda: (
            len(pod_pids(plane, "app=sleeper", ns)) == 1
            and len(get_json(plane, "pods", "-n", ns)["items"]) == 1
        ),
        60,
        "1 pod left",
    )
    stopped = [name for name, pid in pids.items() if not alive(pid)]
    assert len(stopped) == 2
    # They got SIGTERM and exited on their own (the marker), not SIGKILL.
    assert sorted(p.name for p in marks.iterdir()) == sorted(stopped)

    plane.kubectl("delete", "deployment", "sleeper", "-n", ns)
    wait_until(lambda: not get_json(plane, "pods", "-n", ns)["items"], 60, "cascade to pods")
    wait_until(
        lambda: not get_json(plane, "replicasets", "-n", ns)["items"], 60, "cascade to replicasets"
    )
    assert not any(alive(pid) for pid in pids.values())


def test_service_account_rbac_is_enforced(localkube: LocalKube) -> None:
    plane, ns = localkube, "rbac-test"
    create_namespace(plane, ns)
    script = (
        "from kubernetes import client, config\n"
        "config.load_kube_config()\n"
        "api = client.CoreV1Api()\n"
        f"print('pods', len(api.list_namespaced_pod('{ns}').items), flush=True)\n"
        "try:\n"
        f"    api.list_namespaced_secret('{ns}')\n"
        "    print('secrets allowed', flush=True)\n"
        "except client.ApiException as e:\n"
        "    print('secrets', e.status, flush=True)\n"
    )
    apply(
        plane,
        [
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "reader", "namespace": ns},
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "pod-reader", "namespace": ns},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": "pod-reader", "namespace": ns},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "pod-reader",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
            },
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "probe", "namespace": ns},
                "spec": {
                    "serviceAccountName": "reader",
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "main", "image": "shoal:dev", "command": ["python", "-c", script]}
                    ],
                },
            },
        ],
    )
    wait_until(
        lambda: get_json(plane, "pod", "probe", "-n", ns)["status"].get("phase") == "Succeeded",
        60,
        "the probe pod to finish",
    )
    logs = plane.kubectl("logs", "-n", ns, "probe").stdout
    assert "pods 1" in logs
    assert "secrets 403" in logs


def test_crd_with_subresources_and_printer_columns(localkube: LocalKube) -> None:
    plane = localkube
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.shoal.dev"},
        "spec": {
            "group": "example.shoal.dev",
            "names": {
                "kind": "Widget",
                "plural": "widgets",
                "singular": "widget",
                "shortNames": ["wd"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"replicas": {"type": "integer", "minimum": 0}},
                                },
                                "status": {
                                    "type": "object",
                                    "properties": {
                                        "replicas": {"type": "integer"},
                                        "selector": {"type": "string"},
                                    },
                                },
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"}
                    ],
                }
            ],
        },
    }
    apply(plane, crd)
    plane.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.example.shoal.dev", "--timeout=30s"
    )
    apply(
        plane,
        {
            "apiVersion": "example.shoal.dev/v1",
            "kind": "Widget",
            "metadata": {"name": "w1", "namespace": "default"},
            "spec": {"replicas": 2},
        },
    )
    table = plane.kubectl("get", "wd", "w1").stdout
    header, row = (line.split() for line in table.strip().splitlines())
    assert dict(zip(header, row, strict=True))["REPLICAS"] == "2"
    plane.kubectl("scale", "widget", "w1", "--replicas=5")
    assert get_json(plane, "widget", "w1")["spec"]["replicas"] == 5
    refused = plane.kubectl(
        "apply",
        "-f",
        "-",
        check=False,
        input_text=json.dumps(
            {
                "apiVersion": "example.shoal.dev/v1",
                "kind": "Widget",
                "metadata": {"name": "bad", "namespace": "default"},
                "spec": {"replicas": -1},
            }
        ),
    )
    assert refused.returncode != 0
    assert "spec.replicas" in refused.stderr


def test_bad_pods_fail_clearly_and_the_plane_keeps_running(localkube: LocalKube) -> None:
    plane, ns = localkube, "bad-pods"
    create_namespace(plane, ns)
    apply(
        plane,
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "nocmd", "namespace": ns},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "main", "image": "shoal:dev", "command": ["no-such-command-xyz"]}
                    ],
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "foreign", "namespace": ns},
                "spec": {
                    "containers": [{"name": "main", "image": "nginx:1.27", "command": ["nginx"]}]
                },
            },
            # One container runs, the other never starts: Pending (the kubelet's getPhase).
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "half", "namespace": ns},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {"name": "runs", "image": "shoal:dev", "command": ["sleep", "600"]},
                        {"name": "waits", "image": "nginx:1.27", "command": ["nginx"]},
                    ],
                },
            },
        ],
    )

    def state(name: str) -> dict[str, Any]:
        statuses = get_json(plane, "pod", name, "-n", ns)["status"].get("containerStatuses")
        return statuses[0]["state"] if statuses else {}

    failed = wait_until(lambda: state("nocmd").get("terminated"), 60, "nocmd to fail")
    assert failed["reason"] == "StartError"
    assert "no-such-command-xyz" in failed["message"]
    assert get_json(plane, "pod", "nocmd", "-n", ns)["status"]["phase"] == "Failed"
    waiting = wait_until(lambda: state("foreign").get("waiting"), 60, "foreign to wait")
    assert waiting["reason"] == "ErrImageNotLocal"
    assert "nginx:1.27" in waiting["message"]

    def half() -> dict[str, Any]:
        return dict(get_json(plane, "pod", "half", "-n", ns)["status"])

    wait_until(
        lambda: any("running" in c["state"] for c in half().get("containerStatuses", [])),
        60,
        "half's first container to run",
    )
    time.sleep(1)  # a status or two later
    assert half()["phase"] == "Pending"
    # Still serving: a new namespace round-trips.
    plane.kubectl("create", "namespace", "still-alive")
    assert get_json(plane, "namespace", "still-alive")["metadata"]["name"] == "still-alive"


def test_apiserver_moves_off_a_taken_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(
            "harness.localkube.plane.free_port", lambda: next(ports, None) or free_port()
        )
        plane = LocalKube(tmp_path / "plane")
        try:
            plane.up()
            assert not plane.state.apiserver_url.endswith(f":{taken}")
            assert get_json(plane, "nodes")["items"]
        finally:
            plane.down()


def test_crashing_containers_restart_and_http_probes_gate_readiness(
    localkube: LocalKube,
) -> None:
    plane, ns = localkube, "restarts"
    create_namespace(plane, ns)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    server = (
        "import http.server, time\n"
        "time.sleep(4)\n"
        f"http.server.HTTPServer(('127.0.0.1', {free}), "
        "http.server.SimpleHTTPRequestHandler).serve_forever()\n"
    )
    apply(
        plane,
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "crasher", "namespace": ns},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "shoal:dev",
                            "command": ["python", "-c", "raise SystemExit(3)"],
                        }
                    ]
                },
            },
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "web", "namespace": ns},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "shoal:dev",
                            "command": ["python", "-c", server],
                            "ports": [{"name": "http", "containerPort": free}],
                            "readinessProbe": {
                                "httpGet": {"path": "/", "port": "http"},
                                "periodSeconds": 1,
                            },
                        }
                    ]
                },
            },
        ],
    )

    def web_ready() -> bool:
        pod = get_json(plane, "pod", "web", "-n", ns)
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod["status"].get("conditions", [])
        )

    def web_running() -> bool:
        statuses = get_json(plane, "pod", "web", "-n", ns)["status"].get("containerStatuses")
        return bool(statuses and "running" in statuses[0]["state"])

    wait_until(web_running, 30, "the web container to run")
    assert not web_ready()  # running, but the server sleeps 4 s before it listens
    wait_until(web_ready, 30, "the web pod to become ready")

    def crasher() -> dict[str, Any]:
        statuses = get_json(plane, "pod", "crasher", "-n", ns)["status"].get(
            "containerStatuses"
        ) or [{}]
        return dict(statuses[0])

    restarted = wait_until(
        lambda: (c := crasher()).get("restartCount", 0) >= 2 and c,
        60,
        "the crasher to be restarted twice",
    )
    last = restarted.get("lastState", {}).get("terminated", {})
    assert last.get("exitCode") == 3


def test_commands_expand_only_kubernetes_variables(localkube: LocalKube) -> None:
    plane, ns = localkube, "expand"
    create_namespace(plane, ns)
    apply(
        plane,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "echo", "namespace": ns},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": "shoal:dev",
                        "env": [
                            {
                                "name": "WHO",
                                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                            }
                        ],
                        "command": [
                            "python",
                            "-c",
                            "import sys; print(sys.argv[1:])",
                            "$(WHO)",
                            "$HOME",
                        ],
                    }
                ],
            },
        },
    )
    wait_until(
        lambda: get_json(plane, "pod", "echo", "-n", ns)["status"].get("phase") == "Succeeded",
        60,
        "the echo pod to finish",
    )
    assert "['echo', '$HOME']" in plane.kubectl("logs", "-n", ns, "echo").stdout


def test_exec_and_port_forward_are_refused_in_one_line(localkube: LocalKube) -> None:
    """The process kubelet cannot enter a pod: kubectl exec and port-forward said so with
    http.server's HTML error page ("unable to upgrade connection: <!DOCTYPE HTML>...")."""
    plane, ns = localkube, "no-exec"
    create_namespace(plane, ns)
    container = {"name": "main", "image": "shoal:dev", "command": ["sleep", "600"]}
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1}
    apply(
        plane,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper", "namespace": ns},
            "spec": {**pod, "containers": [container]},
        },
    )
    wait_until(
        lambda: get_json(plane, "pod", "sleeper", "-n", ns)["status"].get("phase") == "Running",
        60,
        "the pod to run",
    )
    for command in (["exec", "sleeper", "--", "true"], ["port-forward", "pod/sleeper", "0:8081"]):
        result = plane.kubectl("-n", ns, *command, check=False)
        assert result.returncode != 0
        assert "cannot enter them" in result.stderr, result.stderr
        assert "<!doctype" not in result.stderr.lower(), result.stderr
    plane.kubectl("delete", "namespace", ns, "--wait=false")


# Prints what a pod sees of its secret volume and secret env, for the test below.
SECRET_READER = (
    "import os, stat\n"
    "path = os.environ['CA_FILE']\n"
    "print('content', open(path).read(), flush=True)\n"
    "print('file mode', oct(stat.S_IMODE(os.stat(path).st_mode)), flush=True)\n"
    "print('dir mode', oct(stat.S_IMODE(os.stat(os.environ['CREDS']).st_mode)), flush=True)\n"
    "print('moved', not path.startswith('/etc/creds'), flush=True)\n"
    "print('listing', sorted(os.listdir(os.environ['CREDS'])), flush=True)\n"
    "print('user', os.environ.get('USER_NAME'), 'missing', 'NOPE' in os.environ, flush=True)\n"
)


def test_secret_volumes_and_secret_refs(localkube: LocalKube) -> None:
    plane, ns = localkube, "secret-volumes"
    create_namespace(plane, ns)
    secret_ref = {"secretKeyRef": {"name": "creds", "key": "username"}}
    reader = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reader", "namespace": ns},
        "spec": {
            "restartPolicy": "Never",
            "volumes": [
                {
                    "name": "creds",
                    "secret": {
                        "secretName": "creds",
                        "items": [{"key": "ca.crt", "path": "sub/ca.pem"}],
                    },
                }
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "shoal:dev",
                    "command": ["python", "-c", SECRET_READER],
                    "env": [
                        {"name": "CREDS", "value": "/etc/creds"},
                        {"name": "CA_FILE", "value": "$(CREDS)/sub/ca.pem"},
                        {"name": "USER_NAME", "valueFrom": secret_ref},
                        {
                            "name": "NOPE",
                            "valueFrom": {
                                "secretKeyRef": {"name": "creds", "key": "no", "optional": True}
                            },
                        },
                    ],
                    "volumeMounts": [
                        {"name": "creds", "mountPath": "/etc/creds/", "readOnly": True}
                    ],
                }
            ],
        },
    }
    apply(plane, reader)

    def waiting(name: str) -> dict[str, Any]:
        pod = get_json(plane, "pod", name, "-n", ns)
        statuses = pod["status"].get("containerStatuses") or [{}]
        return dict(statuses[0].get("state", {}).get("waiting") or {})

    # No Secret yet: the volume cannot be set up, and the pod says so (and keeps trying).
    stuck = wait_until(lambda: waiting("reader").get("message"), 60, "a mount failure")
    assert waiting("reader")["reason"] == "ContainerCreating"
    assert 'secret "creds" not found' in stuck

    plane.kubectl(
        "create",
        "secret",
        "generic",
        "creds",
        "-n",
        ns,
        "--from-literal=ca.crt=PEM DATA",
        "--from-literal=username=alice",
        "--from-literal=other=not mounted",
    )
    wait_until(
        lambda: get_json(plane, "pod", "reader", "-n", ns)["status"].get("phase") == "Succeeded",
        60,
        "the reader pod to run once the Secret exists",
    )
    logs = plane.kubectl("logs", "-n", ns, "reader").stdout
    assert "content PEM DATA" in logs
    assert "file mode 0o600" in logs and "dir mode 0o700" in logs
    assert "moved True" in logs  # the env pointed into the mount: rewritten
    assert "listing ['sub']" in logs  # only the listed item, at its path
    assert "user alice missing False" in logs

    # A non-optional key that does not exist: the container cannot be configured.
    broken = json.loads(json.dumps(reader))
    broken["metadata"]["name"] = "broken"
    broken["spec"]["containers"][0]["env"][2]["valueFrom"]["secretKeyRef"]["key"] = "absent"
    apply(plane, broken)
    failed = wait_until(lambda: waiting("broken").get("message"), 60, "a config error")
    assert waiting("broken")["reason"] == "CreateContainerConfigError"
    assert failed == f"couldn't find key absent in Secret {ns}/creds"

    # The pods' directories (kubeconfig, secrets) go with them.
    uids = [
        get_json(plane, "pod", name, "-n", ns)["metadata"]["uid"] for name in ("reader", "broken")
    ]
    plane.kubectl("delete", "pod", "reader", "broken", "-n", ns, "--wait=true", "--timeout=60s")
    pod_dirs = [plane.root / "kubelet" / "pods" / uid for uid in uids]
    wait_until(
        lambda: not any(d.exists() for d in pod_dirs), 30, "the pod directories to be removed"
    )
    plane.kubectl("delete", "namespace", ns, "--wait=false")


def notes(path: Path) -> list[tuple[float, str]]:
    """(time, what) a TRAPPER container wrote, in order."""
    if not path.exists():
        return []
    lines = [line.split(" ", 1) for line in path.read_text().splitlines() if line]
    return [(float(stamp), what) for stamp, what in lines]


def trapper(name: str, log: Path, on_term: str) -> list[str]:
    """A container that notes `<name>-start`, and on SIGTERM `<name>-term`, then runs
    `on_term` (`exit 0`: it stops; nothing: it ignores SIGTERM)."""
    note = f'echo "$(date +%s.%N) {name}-$1" >> {log}'
    return [
        "sh",
        "-c",
        f"note() {{ {note}; }}\n"
        f"trap 'note term; {on_term}' TERM\n"
        "note start\n"
        "while true; do sleep 0.1; done\n",
    ]


def container_status(plane: LocalKube, pod: str, ns: str, name: str) -> dict[str, Any]:
    status = get_json(plane, "pod", pod, "-n", ns).get("status", {})
    for item in status.get("containerStatuses", []) + status.get("initContainerStatuses", []):
        if item["name"] == name:
            return dict(item)
    return {}


def running_pid(plane: LocalKube, pod: str, ns: str, name: str) -> int | None:
    status = container_status(plane, pod, ns, name)
    if "running" not in status.get("state", {}):
        return None
    return int(status["containerID"].removeprefix("process://"))


def test_failed_probes_stop_containers_gracefully_and_run_apart(
    localkube: LocalKube, tmp_path: Path
) -> None:
    """A container failing its liveness or startup probe gets SIGTERM, then SIGKILL after
    the probe's terminationGracePeriodSeconds (at least 2 s), not the pod's 30 s; the exit
    is reported as containerd does (Error, 137; Completed, 0). Each probe runs apart: a
    readiness probe taking 8 s delays no other container's liveness probe."""
    plane, ns = localkube, "probe-kills"
    create_namespace(plane, ns)
    log = tmp_path / "notes"
    failing = {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 1}
    slow = {"exec": {"command": ["sleep", "8"]}, "periodSeconds": 1, "timeoutSeconds": 10}
    apply(
        plane,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probed", "namespace": ns},
            "spec": {
                "terminationGracePeriodSeconds": 30,
                "containers": [
                    {
                        "name": "slow",
                        "image": "shoal:dev",
                        "command": trapper("slow", log, "exit 0"),
                        "readinessProbe": slow,
                    },
                    {
                        "name": "live",
                        "image": "shoal:dev",
                        "command": trapper("live", log, ""),  # ignores SIGTERM
                        "livenessProbe": {
                            **failing,
                            "initialDelaySeconds": 1,
                            "terminationGracePeriodSeconds": 1,
                        },
                    },
                    {
                        "name": "boot",
                        "image": "shoal:dev",
                        "command": trapper("boot", log, "exit 0"),
                        "startupProbe": failing,
                    },
                ],
            },
        },
    )
    try:
        live = wait_until(
            lambda: (c := container_status(plane, "probed", ns, "live")).get("restartCount") and c,
            60,
            "the container failing its liveness probe to restart",
        )
        boot = wait_until(
            lambda: (c := container_status(plane, "probed", ns, "boot")).get("restartCount") and c,
            30,
            "the container failing its startup probe to restart",
        )
        said = notes(log)
        what = [w for _, w in said]
        stamps = {w: t for t, w in reversed(said)}  # the first of each
        assert "live-term" in what and "boot-term" in what, what
        terminated = live["lastState"]["terminated"]
        assert (terminated["exitCode"], terminated["reason"]) == (137, "Error"), terminated
        terminated = boot["lastState"]["terminated"]
        assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed"), terminated
        # Its first liveness probe came 1 s after its start, not after the slow readiness
        # probe (8 s) of the container before it.
        assert stamps["live-term"] - stamps["live-start"] < 5, said
        # SIGKILL 2 s after SIGTERM (the probe's 1 s raised to the least), then a restart.
        second = [t for t, w in said if w == "live-start"][1:]
        assert second, said
        assert 1.9 <= second[0] - stamps["live-term"] < 10, said
    finally:
        plane.kubectl("delete", "namespace", ns, "--wait=false")


def test_forced_deletion_still_gives_two_seconds_and_shortens_a_graceful_one(
    localkube: LocalKube, tmp_path: Path
) -> None:
    """A forced deletion (grace 0) gives each container SIGTERM and at least 2 s before
    SIGKILL; one during a graceful deletion of 60 s shortens it to that."""
    plane, ns = localkube, "forced"
    create_namespace(plane, ns)
    log = tmp_path / "notes"

    def pod(name: str, command: list[str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "terminationGracePeriodSeconds": 60,
                "containers": [{"name": "main", "image": "shoal:dev", "command": command}],
            },
        }

    # Takes 1 s to stop after SIGTERM; the other ignores SIGTERM.
    apply(
        plane,
        [
            pod("handler", trapper("handler", log, "sleep 1; note done; exit 0")),
            pod("stubborn", trapper("stubborn", log, "")),
        ],
    )
    handler = wait_until(lambda: running_pid(plane, "handler", ns, "main"), 60, "handler to run")
    stubborn = wait_until(lambda: running_pid(plane, "stubborn", ns, "main"), 60, "stubborn")
    wait_until(lambda: len(notes(log)) >= 2, 30, "both to start")

    plane.kubectl("delete", "pod", "handler", "-n", ns, "--grace-period=0", "--force")
    wait_until(lambda: not alive(handler), 10, "the handler to stop")
    assert [w for _, w in notes(log) if w.startswith("handler")] == [
        "handler-start",
        "handler-term",
        "handler-done",
    ]

    plane.kubectl("delete", "pod", "stubborn", "-n", ns, "--wait=false")
    wait_until(lambda: "stubborn-term" in [w for _, w in notes(log)], 10, "stubborn's SIGTERM")
    time.sleep(1)
    forced = time.monotonic()
    plane.kubectl("delete", "pod", "stubborn", "-n", ns, "--grace-period=0", "--force")
    wait_until(lambda: not alive(stubborn), 10, "the stubborn container to be killed")
    took = time.monotonic() - forced
    print(f"stubborn killed {took:.1f} s after the forced deletion")
    assert took >= 1.5, took
    plane.kubectl("delete", "namespace", ns, "--wait=false")


# Leaves a process behind: a child that ignores SIGTERM, its pid in $LEFT.
LEAVER = (
    "python -c 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "time.sleep(600)' &\n"
    'echo $! > "$LEFT"\n'
)


def test_what_a_container_leaves_behind_dies_with_it(localkube: LocalKube, tmp_path: Path) -> None:
    """A container's other processes go when its first one exits (a runtime kills the
    container's PID namespace): one that exits on its own, one stopped by deletion."""
    plane, ns = localkube, "leftovers"
    create_namespace(plane, ns)

    def pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
        env = [{"name": "LEFT", "value": str(tmp_path / name)}]
        main = {"name": "main", "image": "shoal:dev", "command": ["sh", "-c", script], "env": env}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"terminationGracePeriodSeconds": 10, "containers": [main], **spec},
        }

    apply(
        plane,
        [
            pod("exits", LEAVER + "sleep 1; exit 1", restartPolicy="Never"),
            pod("deleted", LEAVER + "trap 'exit 0' TERM\nwhile true; do sleep 0.1; done"),
        ],
    )

    def left(name: str) -> int | None:
        path = tmp_path / name
        text = path.read_text().strip() if path.exists() else ""
        return int(text) if text else None

    exits = wait_until(lambda: left("exits"), 60, "the first pod's child")
    deleted = wait_until(lambda: left("deleted"), 60, "the second pod's child")
    try:
        wait_until(
            lambda: get_json(plane, "pod", "exits", "-n", ns)["status"].get("phase") == "Failed",
            30,
            "the first pod to fail",
        )
        wait_until(lambda: not alive(exits), 5, "the exited container's child to be killed")
        assert alive(deleted)
        plane.kubectl("delete", "pod", "deleted", "-n", ns, "--timeout=30s")
        assert not alive(deleted)
    finally:
        for pid in (exits, deleted):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        plane.kubectl("delete", "namespace", ns, "--wait=false")
