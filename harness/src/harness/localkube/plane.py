"""A real Kubernetes control plane on loopback, without containers.

etcd, kube-apiserver (RBAC, service-account tokens, a self-signed serving certificate)
and kube-controller-manager (deployments, replicasets, service accounts and their
tokens, namespaces, garbage collection, disruption budgets) run as local processes; a
process kubelet (harness.localkube.kubelet) registers a Node and runs Pods as processes
of this project's virtualenv, or, with `image=`, chrooted into that image's root
filesystem as the pod's user. A NATS server and a second etcd serve the consumer groups.

`LocalKube(root).up()` starts everything and writes `root/env` (KUBECONFIG, PATH,
NATS_URL, ETCD_ENDPOINTS) and `root/values.yaml` (Helm values for the chart);
`LocalKube(root).down()` (from any process) stops them, using the pids recorded in
`root/state.json`. The processes die with this one, even by SIGKILL (harness.children:
the kubelet's pods die with the kubelet), unless `outlive=True` (`make cluster-up`, the
demo): then they run until `down()`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
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

NODE_NAME = "localkube"
SERVICE_CIDR = "10.0.0.0/24"
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0

# Controllers the tests and the operator need (Kubernetes >= 1.28 names).
CONTROLLERS = [
    "deployment-controller",
    "replicaset-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "garbage-collector-controller",
    "disruption-controller",
]

CLIENTS = {
    "admin": "shoal-admin|system:masters",
    "controller-manager": "system:kube-controller-manager",
    # The process kubelet binds pods, writes their status and requests tokens for their
    # service accounts: in this single-node plane it acts as the scheduler too, so it gets
    # cluster-admin rights rather than the node authorizer's narrower ones.
    "kubelet": "system:node:localkube|system:masters",
}


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
    ) -> None:
        """`image`: the kubelet runs shoal:dev pods from this image's root filesystem
        (chroot, the pod's uid; needs root and buildah), not as processes of `venv_bin`,
        and other images from their own where buildah has them.
        `local_images`: image -> a local executable that stands in for it where it cannot
        run from an image (no `image`, or buildah lacks it): the kubelet says so.
        `outlive`: the plane's processes outlive this one (else they die with it).
        `pod_network`: each pod gets a network namespace of its own (its own loopback, so
        pods may listen on the same port), into which the API server's, NATS' and etcd's
        ports are forwarded (the kubelet's --pod-network; needs `image`)."""
        self.root = Path(root).resolve()
        self.outlive = outlive
        self.tools = tools
        self.venv_bin = venv_bin or Path(sys.executable).parent
        self.image = image
        self.local_images = dict(local_images or {})
        if pod_network and not image:
            raise ValueError("pod_network needs image= (the kubelet's image runtime, as root)")
        self.pod_network = pod_network
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
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        pki = ensure_pki(self.root / "pki", dict(CLIENTS))
        try:
            self._start_kube_etcd(tools)
            self._start_apiserver(tools, pki)
            self._write_kubeconfigs(pki)
            self._start_controller_manager(tools, pki)
            # The group servers first: the kubelet forwards their ports into pods' networks.
            self._start_group_servers()
            self._start_kubelet()
            self._wait_for_node()
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
                "--authorization-mode=RBAC",
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

    def _wait_ready(self, url: str, pki: Pki, name: str) -> None:
        context = self._ssl_context(pki)
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
            ("kubelet", self.root / "kubelet.kubeconfig"),
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
            ],
        )

    def _start_kubelet(self) -> None:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        self._spawn(
            "kubelet",
            [
                str(self.venv_bin / "python"),
                "-m",
                "harness.localkube.kubelet",
                "--kubeconfig",
                str(self.root / "kubelet.kubeconfig"),
                "--root",
                str(self.root),
                "--node",
                NODE_NAME,
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

    def _wait_for_node(self) -> None:
        kubelet = next(c.pid for c in self.state.components if c.name == "kubelet")

        def node_ready() -> subprocess.CompletedProcess[str]:
            if not alive(kubelet):
                raise RuntimeError(f"the kubelet exited; see {self.logs}/kubelet.log")
            return self.kubectl(
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                check=False,
            )

        try:
            eventually(
                node_ready,
                READY_TIMEOUT,
                f"node {NODE_NAME} to be Ready",
                until=lambda result: result.stdout.strip() == "True",
                interval=0.3,
                describe=lambda result: f"{result.stdout.strip()!r} {result.stderr.strip()!r}",
            )
        except WaitTimeout as exc:
            raise RuntimeError(
                f"node {NODE_NAME} not Ready ({exc}); see {self.logs}/kubelet.log"
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
        """Stop every component in reverse start order (the kubelet first stops its pods)."""
        if not self.state_path.exists():
            return
        state = State.load(self.state_path)
        # The kubelet first, while its pods can still reach NATS, etcd and the API server
        # to leave their groups gracefully; then the rest in reverse start order.
        order = sorted(reversed(state.components), key=lambda c: c.name != "kubelet")
        for component in order:
            # The kubelet needs time to stop its pods gracefully.
            timeout = 40.0 if component.name == "kubelet" else STOP_TIMEOUT
            started = time.monotonic()
            stop_process_group(component.pid, timeout)
            log.info("Stopped %s in %.1f s", component.name, time.monotonic() - started)
        self._kill_leftover_pods()
        # A kubelet killed before its shutdown leaves the image's working container.
        remove_recorded(self.root / "kubelet")
        self.state_path.unlink()

    def _kill_leftover_pods(self) -> None:
        """Pods whose kubelet died without stopping them are recorded in pids/."""
        pids = self.root / "kubelet" / "pids"
        if not pids.is_dir():
            return
        for pid_file in pids.glob("*.pid"):
            try:
                stop_process_group(int(pid_file.read_text()), STOP_TIMEOUT)
            except ValueError:
                pass
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
