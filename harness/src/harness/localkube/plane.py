"""A real Kubernetes control plane on loopback, without containers.

etcd, kube-apiserver (Node and RBAC authorization, NodeRestriction, service-account
tokens, a self-signed serving certificate), kube-controller-manager (deployments,
replicasets, service accounts and their tokens, namespaces, garbage collection,
disruption budgets, node lifecycle and taint-based eviction, pod GC) and kube-scheduler
run as local processes; one process kubelet per node (harness.localkube.kubelet,
`nodes=`: 1 by default, a Node named `localkube`; with more, `localkube-a`, `-b`, ... in
zones `zone-a`, `zone-b`, `zone-c`, round robin) registers its Node and runs the Pods the
scheduler bound to it as processes of this project's virtualenv, or, with `image=`,
chrooted into that image's root filesystem as the pod's user. Each kubelet is a node to
the API server (`system:node:<name>` in `system:nodes`), with its own state directory
(`root/kubelet` or `root/kubelet-<letter>`), pod logs (`root/logs/pods[-<letter>]`) and
log server port. A NATS server and a second etcd serve the consumer groups; every pod of
every node shares the host's loopback (unless `pod_network`).

`LocalKube(root).up()` starts everything and writes `root/env` (KUBECONFIG, PATH,
NATS_URL, ETCD_ENDPOINTS) and `root/values.yaml` (Helm values for the chart);
`LocalKube(root).down()` (from any process) stops them, using the pids recorded in
`root/state.json`. The processes die with this one, even by SIGKILL (harness.children:
the kubelet's pods die with the kubelet), unless `outlive=True` (`make cluster-up`, the
demo): then they run until `down()`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from harness.children import spawn
from harness.localkube.image import remove_recorded
from harness.localkube.pki import Pki, ensure_pki
from harness.localkube.tools import KubeTools, find_tools
from harness.servers import EtcdServer, NatsServer, free_port
from harness.waiting import WaitTimeout, eventually

log = logging.getLogger(__name__)

NODE_NAME = "localkube"  # the single node's name (several: localkube-a, -b, ...)
ZONES = ("zone-a", "zone-b", "zone-c")
MAX_NODES = 9
SERVICE_CIDR = "10.0.0.0/24"
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
# kube-controller-manager's default: how long a node may stay silent before the node
# lifecycle controller marks it NotReady (Unknown) and taints it unreachable.
NODE_MONITOR_GRACE = 50.0

# Controllers the tests and the operator need (Kubernetes >= 1.28 names).
CONTROLLERS = [
    "deployment-controller",
    "replicaset-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "garbage-collector-controller",
    # What PodDisruptionBudgets, and so `kubectl drain`'s evictions, read their state from.
    "disruption-controller",
    # A silent node turns NotReady (Unknown) and is tainted unreachable; pods that do not
    # tolerate the taint (their default tolerationSeconds: 300) are deleted.
    "node-lifecycle-controller",
    "taint-eviction-controller",
    # Force-deletes pods of deleted nodes and terminated pods past the threshold.
    "pod-garbage-collector-controller",
]

CLIENTS = {
    "admin": "shoal-admin|system:masters",
    "controller-manager": "system:kube-controller-manager",
    "scheduler": "system:kube-scheduler",
}


@dataclass(frozen=True)
class PlaneNode:
    """A node of the plane: its Node's name and zone, and its kubelet's component name
    (in state.json; its log `logs/<component>.log`, its state directory `<component>/`)."""

    name: str
    zone: str
    component: str

    @property
    def client(self) -> str:
        """Its client certificate's file name in pki/ (node-<name>.crt)."""
        return f"node-{self.name}"

    @property
    def pod_logs(self) -> str:
        """Its container logs' directory under logs/."""
        return "pods" + self.component.removeprefix("kubelet")


def plane_nodes(count: int) -> list[PlaneNode]:
    """One node `localkube` in zone-a; several: localkube-a, -b, ... in zone-a, -b, -c, -a ..."""
    if not 1 <= count <= MAX_NODES:
        raise ValueError(f"nodes must be between 1 and {MAX_NODES}, not {count}")
    if count == 1:
        return [PlaneNode(NODE_NAME, ZONES[0], "kubelet")]
    letters = "abcdefghi"
    return [
        PlaneNode(f"{NODE_NAME}-{letters[i]}", ZONES[i % len(ZONES)], f"kubelet-{letters[i]}")
        for i in range(count)
    ]


def _mount_points() -> list[Path]:
    """Where something is mounted on this host (the mount namespace we run in)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    # Fields are space-separated, with spaces in paths escaped as \040.
    return [Path(line.split()[1].replace("\\040", " ")) for line in lines if line.split()]


def is_kubelet(component: str) -> bool:
    return component == "kubelet" or component.startswith("kubelet-")


class PortTaken(RuntimeError):
    """The port chosen for a component was taken before it could bind it."""


@dataclass
class Component:
    name: str
    pid: int
    port: int | None = None
    log: str = ""


@dataclass
class State:
    components: list[Component] = field(default_factory=list)
    apiserver_url: str = ""
    nats_url: str = ""
    etcd_endpoint: str = ""

    def save(self, path: Path) -> None:
        path.write_text(
            json.dumps(
                {
                    "components": [vars(c) for c in self.components],
                    "apiserver_url": self.apiserver_url,
                    "nats_url": self.nats_url,
                    "etcd_endpoint": self.etcd_endpoint,
                },
                indent=2,
            )
        )

    @classmethod
    def load(cls, path: Path) -> State:
        raw = json.loads(path.read_text())
        return cls(
            components=[Component(**c) for c in raw["components"]],
            apiserver_url=raw["apiserver_url"],
            nats_url=raw["nats_url"],
            etcd_endpoint=raw["etcd_endpoint"],
        )


def kubeconfig(server: str, pki: Pki, client: str, ca: Path | None = None) -> dict[str, Any]:
    cert, key = pki.client(client)
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "localkube",
                "cluster": {"server": server, "certificate-authority": str(ca or pki.ca_cert)},
            }
        ],
        "users": [
            {"name": client, "user": {"client-certificate": str(cert), "client-key": str(key)}}
        ],
        "contexts": [
            {
                "name": "localkube",
                "context": {"cluster": "localkube", "user": client, "namespace": "default"},
            }
        ],
        "current-context": "localkube",
    }


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is not: it has stopped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _reap(pid: int) -> None:
    """Collect pid's exit status if it is our child (when the plane runs in-process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_process_group(pid: int, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM the process group led by pid, SIGKILL what is left after timeout."""
    try:
        _stop_process_group(pid, timeout)
    finally:
        _reap(pid)


def _stop_process_group(pid: int, timeout: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        try:
            eventually(lambda: _exited(pid), timeout, f"pid {pid} to exit", interval=0.05)
            return
        except WaitTimeout:
            continue  # SIGKILL next; after that, give up as before


def _exited(pid: int) -> bool:
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        reaped = 0  # not our child: poll for its exit instead
    return reaped == pid or not alive(pid)


class LocalKube:
    def __init__(
        self,
        root: Path,
        *,
        tools: KubeTools | None = None,
        venv_bin: Path | None = None,
        image: str | None = None,
        local_images: dict[str, Path] | None = None,
        outlive: bool = False,
        pod_network: bool = False,
        nodes: int = 1,
        node_monitor_grace: float = NODE_MONITOR_GRACE,
    ) -> None:
        """`image`: the kubelet runs shoal:dev pods from this image's root filesystem
        (chroot, the pod's uid; needs root and buildah), not as processes of `venv_bin`,
        and other images from their own where buildah has them.
        `local_images`: image -> a local executable that stands in for it where it cannot
        run from an image (no `image`, or buildah lacks it): the kubelet says so.
        `outlive`: the plane's processes outlive this one (else they die with it).
        `pod_network`: each pod gets a network namespace of its own (its own loopback, so
        pods may listen on the same port), into which the API server's, NATS' and etcd's
        ports are forwarded (the kubelet's --pod-network; needs `image`).
        `nodes`: how many nodes (process kubelets) the plane has (see plane_nodes).
        `node_monitor_grace`: seconds a node may be silent before the node lifecycle
        controller marks it NotReady and taints it; the kubelets renew their Leases every
        quarter of min(40 s, this), as a real kubelet renews its 40 s Lease every 10 s."""
        self.root = Path(root).resolve()
        self.outlive = outlive
        self.tools = tools
        self.venv_bin = venv_bin or Path(sys.executable).parent
        self.image = image
        self.local_images = dict(local_images or {})
        if pod_network and not image:
            raise ValueError("pod_network needs image= (the kubelet's image runtime, as root)")
        self.pod_network = pod_network
        self.nodes = plane_nodes(nodes)
        if node_monitor_grace < 4:
            raise ValueError("node_monitor_grace must be at least 4 s")
        self.node_monitor_grace = node_monitor_grace
        self.state = State()
        self._servers: list[Any] = []

    # -- paths ---------------------------------------------------------------------------

    @property
    def kubeconfig_path(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def _tools(self) -> KubeTools:
        """The binaries, looked up once (every kubectl call goes through here)."""
        if self.tools is None:
            self.tools = find_tools()
        return self.tools

    # -- up ------------------------------------------------------------------------------

    def up(self) -> Self:
        if self.state_path.exists() and self._any_alive(State.load(self.state_path)):
            raise RuntimeError(
                f"a local plane is already running from {self.root}; run `make cluster-down` first"
            )
        started = time.monotonic()
        tools = self._tools()
        self._forget_earlier_plane()
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        clients: dict[str, str | None] = dict(CLIENTS)
        for node in self.nodes:
            # A node's identity: the Node authorizer and NodeRestriction key on it.
            clients[node.client] = f"system:node:{node.name}|system:nodes"
        pki = ensure_pki(self.root / "pki", clients)
        try:
            self._start_kube_etcd(tools)
            self._start_apiserver(tools, pki)
            self._write_kubeconfigs(pki)
            self._start_controller_manager(tools, pki)
            self._start_scheduler(tools)
            # The group servers first: the kubelet forwards their ports into pods' networks.
            self._start_group_servers()
            for node in self.nodes:
                self._start_kubelet(node)
            self._wait_for_nodes()
        except BaseException:
            self.state.save(self.state_path)
            self.down()
            raise
        self.state.save(self.state_path)
        self._write_env()
        self._write_values()
        log.info(
            "Local plane up in %.1f s (%s)", time.monotonic() - started, self.state.apiserver_url
        )
        return self

    def _forget_earlier_plane(self) -> None:
        """Every up() is a new cluster: the data of a plane stopped before (its API
        objects in kube-etcd, the groups' etcd and NATS, the kubelets' state, the logs)
        is removed; the PKI stays (ensure_pki adds what a new node needs). Kept, an
        earlier cluster's Helm release, groups, pods and Nodes came back pointing at
        NATS and etcd ports the new servers no longer use: the operator and every group
        failed, the old operator pod stayed Terminating on a node that no longer
        exists, and `helm install` refused the release name."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.iterdir()):
            kubelet = path.is_dir() and is_kubelet(path.name)
            if path.name not in ("kube-etcd", "etcd", "nats", "logs", "state.json") and not kubelet:
                continue
            if kubelet:  # what down() would have done, had it run to its end
                self._kill_leftover_pods(path)
                remove_recorded(path)
            if not path.is_dir():
                path.unlink(missing_ok=True)
            elif any(m == path or path in m.parents for m in _mount_points()):
                # Never delete through a mount (an image's root a crash left mounted).
                log.warning("Kept %s: something is mounted below it", path)
            else:
                shutil.rmtree(path, ignore_errors=True)

    def _record(self, name: str, pid: int, port: int | None = None, log_file: str = "") -> None:
        self.state.components.append(Component(name, pid, port, log_file))
        self.state.save(self.state_path)

    def _start_kube_etcd(self, tools: KubeTools) -> None:
        etcd = EtcdServer(self.root / "kube-etcd", binary=tools.etcd)
        etcd.start(outlive=self.outlive)
        self._record("kube-etcd", etcd.detach(), None, str(etcd.log_path))
        self._kube_etcd_endpoint = etcd.endpoint

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> int:
        log_path = self.logs / f"{name}.log"
        with log_path.open("ab") as out:
            process = spawn(
                command,
                outlive=self.outlive,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                env=env or dict(os.environ),
                start_new_session=True,
            )
        self._record(name, process.pid, None, str(log_path))
        return process.pid

    def _start_apiserver(self, tools: KubeTools, pki: Pki) -> None:
        """Start kube-apiserver; a port taken since it was chosen moves it to another."""
        for attempt in range(1, 4):
            try:
                self._try_apiserver(tools, pki, free_port())
                return
            except PortTaken as exc:
                log.info("%s; retrying on another port (attempt %d)", exc, attempt)
                self.state.components.pop()
        raise RuntimeError("kube-apiserver found no free port in 3 attempts")

    def _try_apiserver(self, tools: KubeTools, pki: Pki, port: int) -> None:
        url = f"https://127.0.0.1:{port}"
        self._spawn(
            "kube-apiserver",
            [
                str(tools.kube_apiserver),
                f"--etcd-servers=http://{self._kube_etcd_endpoint}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                # The kubelets are nodes: the Node authorizer and NodeRestriction admission
                # (beside the default admission plugins) limit each to its own Node, Lease,
                # pods, and the Secrets, ConfigMaps and tokens those pods need.
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--kubelet-client-certificate={pki.client('admin')[0]}",
                f"--kubelet-client-key={pki.client('admin')[1]}",
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--endpoint-reconciler-type=none",
            ],
        )
        self.state.components[-1].port = port
        self.state.apiserver_url = url
        self._wait_ready(f"{url}/readyz", pki, "kube-apiserver")

    def _ssl_context(self, pki: Pki) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        cert, key = pki.client("admin")
        context.load_cert_chain(str(cert), str(key))
        return context

    def _wait_ready(self, url: str, pki: Pki, name: str, *, verify: bool = True) -> None:
        """verify=False: a component serving its own self-signed certificate."""
        if verify:
            context = self._ssl_context(pki)
        else:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=context), urllib.request.ProxyHandler({})
        )
        pid = self.state.components[-1].pid

        def ready() -> bool:
            if not alive(pid):
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                if "address already in use" in tail:
                    raise PortTaken(f"{name}: port already in use")
                raise RuntimeError(f"{name} exited during start; see {self.logs}/{name}.log")
            with opener.open(url, timeout=2) as response:
                return bool(response.status == 200)

        try:
            # Refused connections, TLS errors and HTTP errors (non-2xx) mean "not yet".
            eventually(
                ready,
                READY_TIMEOUT,
                f"{name} to answer {url}",
                interval=0.2,
                retry_on=(OSError, http.client.HTTPException),
            )
        except WaitTimeout as exc:
            raise RuntimeError(
                f"{name} not ready after {READY_TIMEOUT:.0f} s ({exc.last!r}); "
                f"see {self.logs}/{name}.log"
            ) from exc

    def _write_kubeconfigs(self, pki: Pki) -> None:
        url = self.state.apiserver_url
        for client, path in (
            ("admin", self.kubeconfig_path),
            ("controller-manager", self.root / "controller-manager.kubeconfig"),
            ("scheduler", self.root / "scheduler.kubeconfig"),
            *((node.client, self._kubelet_kubeconfig(node)) for node in self.nodes),
        ):
            path.write_text(yaml.safe_dump(kubeconfig(url, pki, client)))
            path.chmod(0o600)

    def _start_controller_manager(self, tools: KubeTools, pki: Pki) -> None:
        kubeconfig_path = self.root / "controller-manager.kubeconfig"
        self._spawn(
            "kube-controller-manager",
            [
                str(tools.kube_controller_manager),
                f"--kubeconfig={kubeconfig_path}",
                f"--authentication-kubeconfig={kubeconfig_path}",
                f"--authorization-kubeconfig={kubeconfig_path}",
                f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_cert}",
                # Each controller under its own service account and bootstrap role, as in a
                # real cluster (the manager's own identity may only set those up).
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--concurrent-deployment-syncs=2",
                "--concurrent-replicaset-syncs=2",
                # Node lifecycle: a node whose Lease and status have not been renewed for
                # the grace period turns NotReady (Unknown) and is tainted unreachable,
                # checked every monitor period.
                f"--node-monitor-grace-period={self.node_monitor_grace:g}s",
                f"--node-monitor-period={self._node_monitor_period():g}s",
            ],
        )

    def _node_monitor_period(self) -> float:
        """How often the node lifecycle controller looks: its default 5 s, shorter for a
        short grace period (a fifth of it, at least 1 s)."""
        return max(1.0, min(5.0, round(self.node_monitor_grace / 5, 1)))

    def _lease_seconds(self) -> int:
        """The kubelets' Lease duration: the real 40 s, or the grace period if shorter
        (renewed every quarter of it)."""
        return int(min(40.0, self.node_monitor_grace))

    def _start_scheduler(self, tools: KubeTools) -> None:
        """kube-scheduler with its default profile (spreading, affinity, taints, fit),
        as system:kube-scheduler; it binds every pod, the kubelets none."""
        kubeconfig_path = self.root / "scheduler.kubeconfig"
        port = free_port()
        self._spawn(
            "kube-scheduler",
            [
                str(tools.kube_scheduler),
                f"--kubeconfig={kubeconfig_path}",
                f"--authentication-kubeconfig={kubeconfig_path}",
                f"--authorization-kubeconfig={kubeconfig_path}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--profiling=false",
            ],
        )
        self.state.components[-1].port = port
        self._wait_ready(
            f"https://127.0.0.1:{port}/readyz",
            Pki(self.root / "pki"),
            "kube-scheduler",
            verify=False,
        )

    def _kubelet_kubeconfig(self, node: PlaneNode) -> Path:
        return self.root / f"{node.component}.kubeconfig"

    def _start_kubelet(self, node: PlaneNode) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        self._spawn(
            node.component,
            [
                str(self.venv_bin / "python"),
                "-m",
                "harness.localkube.kubelet",
                "--kubeconfig",
                str(self._kubelet_kubeconfig(node)),
                "--root",
                str(self.root),
                "--node",
                node.name,
                "--zone",
                node.zone,
                "--state-dir",
                str(self.root / node.component),
                "--pod-log-dir",
                str(self.logs / node.pod_logs),
                "--lease-seconds",
                str(self._lease_seconds()),
                "--venv-bin",
                str(self.venv_bin),
                *(["--image", self.image] if self.image else []),
                *(f"--local-image={image}={path}" for image, path in self.local_images.items()),
                *(self._forwarded() if self.pod_network else []),
            ],
            env,
        )

    def _forwarded(self) -> list[str]:
        """--pod-network and the ports pods reach on the host: API server, NATS, etcd."""
        urls = [self.state.apiserver_url, self.state.nats_url, f"//{self.state.etcd_endpoint}"]
        ports = [urllib.parse.urlsplit(url).port for url in urls]
        return ["--pod-network", *(f"--forward-port={port}" for port in ports if port)]

    def _start_group_servers(self) -> None:
        nats = NatsServer(self.root / "nats")
        nats.start(outlive=self.outlive)
        self.state.nats_url = nats.url
        self._record("nats-server", nats.detach(), None, str(nats.log_path))
        etcd = EtcdServer(self.root / "etcd")
        etcd.start(outlive=self.outlive)
        self.state.etcd_endpoint = etcd.endpoint
        self._record("etcd", etcd.detach(), None, str(etcd.log_path))

    def _wait_for_nodes(self) -> None:
        """Every node Ready, and free of the not-ready taint the node lifecycle controller
        puts on a node until it is (the scheduler places nothing there before)."""
        kubelets = [c for c in self.state.components if is_kubelet(c.name)]
        names = [node.name for node in self.nodes]

        def nodes_ready() -> dict[str, str]:
            for kubelet in kubelets:
                if not alive(kubelet.pid):
                    raise RuntimeError(f"{kubelet.name} exited; see {self.logs}/{kubelet.name}.log")
            result = self.kubectl("get", "nodes", "-o", "json", check=False)
            if result.returncode != 0:
                return {"error": result.stderr.strip()}
            seen = {}
            for node in json.loads(result.stdout)["items"]:
                conditions = node.get("status", {}).get("conditions") or []
                ready = next((c["status"] for c in conditions if c["type"] == "Ready"), "?")
                taints = [t["key"] for t in node.get("spec", {}).get("taints") or []]
                seen[node["metadata"]["name"]] = f"Ready={ready} taints={taints}"
            return seen

        try:
            eventually(
                nodes_ready,
                READY_TIMEOUT,
                f"nodes {', '.join(names)} to be Ready",
                until=lambda seen: all(seen.get(n) == "Ready=True taints=[]" for n in names),
                interval=0.3,
            )
        except WaitTimeout as exc:
            raise RuntimeError(
                f"nodes not Ready ({exc}); see the kubelets' logs in {self.logs}"
            ) from exc

    def kubectl(
        self, *args: str, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        tools = self._tools()
        return subprocess.run(
            [str(tools.kubectl), f"--kubeconfig={self.kubeconfig_path}", *args],
            capture_output=True,
            text=True,
            check=check,
            input=input_text,
            timeout=60,
        )

    def env(self) -> dict[str, str]:
        tools = self._tools()
        path = ":".join(
            [*(str(d) for d in tools.bin_dirs), str(self.venv_bin), os.environ.get("PATH", "")]
        )
        return {
            "KUBECONFIG": str(self.kubeconfig_path),
            "PATH": path,
            "NATS_URL": self.state.nats_url,
            "ETCD_ENDPOINTS": self.state.etcd_endpoint,
        }

    def _write_env(self) -> None:
        lines = ["# Written by `make cluster-up`: source it to use the local plane."]
        lines += [f"export {k}={json.dumps(v)}" for k, v in self.env().items()]
        (self.root / "env").write_text("\n".join(lines) + "\n")

    def _write_values(self) -> None:
        values = {
            "image": {"repository": "shoal", "tag": "dev", "pullPolicy": "Never"},
            "nats": {"url": self.state.nats_url},
            "etcd": {"endpoints": self.state.etcd_endpoint},
            # Every pod shares the host's loopback here: a fixed metrics port would let one
            # consumer per machine bind it. 0: each picks a free one (and logs it).
            "consumerMetrics": {"port": 0},
            # The same for the probes' port: exec probes (shoal-ready) unless every pod has
            # a loopback of its own (--pod-network).
            "consumerProbes": {"port": 8081 if self.pod_network else None},
            # And the operator's /healthz: 8080 is where handler services (the README's
            # examples) listen, on this loopback too.
            "livenessProbe": {"port": 8080 if self.pod_network else free_port()},
        }
        (self.root / "values.yaml").write_text(
            "# Written by `make cluster-up`: Helm values for the local plane.\n"
            + yaml.safe_dump(values, sort_keys=False)
        )

    # -- down ----------------------------------------------------------------------------

    @staticmethod
    def _any_alive(state: State) -> bool:
        return any(alive(c.pid) for c in state.components)

    def down(self) -> None:
        """Stop every component in reverse start order (the kubelets first stop their pods)."""
        if not self.state_path.exists():
            return
        state = State.load(self.state_path)
        # The kubelets first, at once, while their pods can still reach NATS, etcd and the
        # API server to leave their groups gracefully; then the rest in reverse start order.
        kubelets = [c for c in state.components if is_kubelet(c.name)]
        threads = [
            threading.Thread(target=self._stop_component, args=(c, 40.0), name=c.name)
            for c in kubelets  # they need time to stop their pods gracefully
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for component in reversed(state.components):
            if not is_kubelet(component.name):
                self._stop_component(component, STOP_TIMEOUT)
        for kubelet in kubelets:
            self._kill_leftover_pods(self.root / kubelet.name)
            # A kubelet killed before its shutdown leaves the image's working container.
            remove_recorded(self.root / kubelet.name)
        self.state_path.unlink()

    @staticmethod
    def _stop_component(component: Component, timeout: float) -> None:
        started = time.monotonic()
        stop_process_group(component.pid, timeout)
        log.info("Stopped %s in %.1f s", component.name, time.monotonic() - started)

    def _kill_leftover_pods(self, state_dir: Path) -> None:
        """Pods whose kubelet died without stopping them are recorded in its pids/."""
        pids = state_dir / "pids"
        if not pids.is_dir():
            return
        for pid_file in pids.glob("*.pid"):
            try:
                pid = int(pid_file.read_text())
            except ValueError:
                pid_file.unlink(missing_ok=True)
                continue
            stop_process_group(pid, STOP_TIMEOUT)
            # What the container's first process left in its group (a runtime kills
            # everything in the container when its init exits).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            pid_file.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()
