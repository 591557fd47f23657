"""A process kubelet: runs the local plane's Pods as processes of this virtualenv, or, with
`--image`, chrooted into that image's root filesystem as the pod's user.

It registers one Node (`--node`, labelled with `kubernetes.io/hostname` and, with
`--zone`, `topology.kubernetes.io/zone`), keeps its Lease in kube-node-lease renewed
(every quarter of `--lease-seconds`, as the real kubelet) and its status posted, and runs
the Pods kube-scheduler bound to it (it watches only pods whose spec.nodeName is its
node; it binds nothing). For each container of such a Pod it starts `command + args` as a
local process with the Pod's environment (downward-API fieldRefs, secret and config-map
refs) and a kubeconfig holding a real token of the Pod's ServiceAccount (TokenRequest,
bound to the pod, for the API server's own audiences: what the pod's automounted
kube-api-access volume asks for; a pod without one, automountServiceAccountToken false,
gets no token and no KUBECONFIG, as from a real kubelet), so RBAC applies to what the
process does. It reports phase, readiness (exec, HTTP and TCP probes) and restarts;
restarts crashed containers per restartPolicy with backoff; on deletion sends SIGTERM,
then SIGKILL after the grace period (at least 2 s); a shorter grace period given later (a
forced deletion) takes over. Logs go to
`<pod log dir>/<namespace>_<pod>_<container>.log` and are served to `kubectl logs` on the
port the Node's status names (the API server proxies there).

Its identity is a node's: a client certificate `system:node:<node>` in `system:nodes`,
so the API server's Node authorizer and NodeRestriction admission decide what it may do,
as for a real kubelet: its own Node, Lease and pods' status, the Secrets and ConfigMaps
its pods name, tokens for its pods' service accounts. It needs nothing more (it reads
Secrets and ConfigMaps only for pods bound to it, by name; a read made before the
authorizer has seen the binding is refused and retried, like a missing Secret).

Init containers, native sidecars, probes, restarts and the order of termination: one
pod at a time, in podrunner.py (its docstring says what it does as the real kubelet).

Images. In the venv runtime only `shoal:dev` runs (it is this checkout's installation);
an image given a local stand-in (`--local-image IMAGE=PATH`, `SHOAL_KUBELET_LOCAL_IMAGES`
for the plane) runs as a host process of that executable (the container's args after
it, or its command with a command[0] named like the stand-in replaced by it), and its log
starts with a line saying so; any other image leaves the container waiting with reason
ErrImageNotLocal and a message saying what would run it. In the image runtime (below),
shoal:dev runs from the image given, and any other image from its own root filesystem if
`buildah images` has it (mounted on first use, once per image, kept until shutdown); an
image buildah lacks falls back to its stand-in if it has one (and says so), else waits
with reason ErrImageNeverPull (nothing is pulled; asked again every few seconds).

Secret volumes are written, before the pod's containers start, into a private per-pod
directory (`<root>/kubelet/pods/<uid>/volumes/<volume>`: directories 0700, files 0600,
whatever defaultMode says; `items` and `optional` as in Kubernetes). A Secret or a listed
key that is missing (and not optional) keeps the containers waiting in ContainerCreating
with the reason, retried every few seconds, like a real kubelet's FailedMount. Env
`secretKeyRef`/`configMapKeyRef` and `envFrom` honour `optional`; a missing non-optional
one leaves the container in CreateContainerConfigError, retried. Volumes are written once
per pod: a Secret changed later is not synced into a running pod. The directory is
removed when the pod goes away.

The venv runtime (the default). Containers are host processes of the checkout's venv,
as the kubelet's own user, without a mount namespace, so a volume cannot appear at its mountPath.
Instead, every env value (and every command argument) that is a mountPath of a
materialized volume, or a path under one, is rewritten to the materialized location
(`ETCD_CA_FILE=/etc/shoal/etcd/ca.crt` becomes `.../volumes/etcd-tls/ca.crt`). A program
that builds such paths itself, or reads them from a file, will not find them. Other
volume types are not materialized (emptyDir `/tmp` is simply the host's /tmp).

The image runtime (`--image shoal:dev`; root and buildah, see image.py). At start the
kubelet makes a buildah working container of the image and mounts it (removed at
shutdown, or by the plane's `down` after a killed kubelet). Each container is started by
sandbox.py, which execs into it (same pid, process group, exit status, so signals,
restarts, logs and status work as above): a new mount namespace with private
propagation, a throwaway overlay (tmpfs upper layer) over the image as its root, chroot,
/proc, a minimal /dev (null, zero, full, random, urandom, tty, shm), /sys read-only, the
pod's Secret (read-only) and emptyDir volumes bound at their real mountPaths (no path
rewriting), a per-pod /tmp unless a volume is mounted there, the ServiceAccount token,
ca.crt, namespace and a kubeconfig using them at
/var/run/secrets/kubernetes.io/serviceaccount (KUBECONFIG points there), the host's
/etc/resolv.conf and /etc/hosts; the root remounted read-only when
readOnlyRootFilesystem is set. It then takes the uid/gid of runAsUser/runAsGroup
(container, then pod), else the image's USER, plus supplementalGroups and fsGroup,
refuses uid 0 under runAsNonRoot, sets no_new_privs when allowPrivilegeEscalation is
false, and execs the command on the image's PATH with the image's ENV (then the pod's),
in the image's WORKDIR; an empty command means the image's ENTRYPOINT/CMD. Exec probes
enter the container's mount namespace and root as its user. Secret files and the token
stay 0600, owned by the pod's user (its fsGroup if set). What a real container runtime
does and this does not: no network namespace unless --pod-network (below; else pods
share the host's loopback and ports), no PID, UTS or IPC namespace (pods see every host
process and the host name), no user namespace, no cgroups (resources.limits and requests
are not enforced), no seccomp or AppArmor profile and no capability bounding beyond what
leaving uid 0 drops, no image pulls (the one image given for every shoal:dev pod, other
images only as buildah already has them), and what a container writes on a writable root
goes to a tmpfs that is gone at its restart. Each container gets its own image's ENV,
USER, WORKDIR and ENTRYPOINT/CMD; the pod's Secret files and token belong to its first
container's user, so a container of another image running as another uid cannot read
them (unless fsGroup is set).

Pod networks (`--pod-network`, image runtime only; `--forward-port PORT` for each port of
the host's loopback pods must reach: the plane passes the API server's, NATS' and
etcd's). Before a pod's first container the kubelet starts podnet.py, which makes a new
network namespace, brings its loopback up, forwards 127.0.0.1:PORT inside to the host's
and holds the namespace until the pod is stopped (after its last container: the pause
container). Every container of the pod joins it (sandbox.py), so a pod has a loopback of
its own and two pods can both listen on 127.0.0.1:8080; HTTP and TCP probes connect from
a thread that joined it, exec probes enter it. Nothing else: no interface but lo, no
route out, no pod-to-pod traffic, podIP stays 127.0.0.1. A namespace that cannot be made
leaves the pod's containers waiting with FailedCreatePodSandBox.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import datetime
import http.server
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from harness.children import spawn
from harness.localkube import image as image_runtime
from harness.localkube.image import (
    SERVICE_ACCOUNT_DIR,
    Identity,
    ImageNotPresent,
    ImageRoot,
    parse_stand_ins,
)
from harness.localkube.podrunner import PodRunner, pod_grace
from harness.localkube.podspec import (
    POD_IP,
    ConfigError,
    VolumeError,
    expand,
    now,
    wants_token,
)
from harness.waiting import WaitTimeout, eventually

log = logging.getLogger("localkube.kubelet")
_libc = ctypes.CDLL(None, use_errno=True)

LOCAL_IMAGES = {"shoal:dev", "docker.io/library/shoal:dev", "localhost/shoal:dev"}
PODNET = Path(__file__).resolve().parent / "podnet.py"
CLONE_NEWNET = 0x40000000
# The real kubelet's defaults: a Lease of 40 s renewed every 10 s, the status posted
# every 10 s.
LEASE_SECONDS = 40
STATUS_PERIOD_NODE = 10.0
ZONE_LABEL = "topology.kubernetes.io/zone"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# What the node offers the scheduler. Nothing enforces requests or limits here (pods are
# plain processes), so this is not the machine's size: it is large enough that any test's
# requests fit, while the scheduler still spreads, filters and places by it.
CAPACITY = {"cpu": "32", "memory": "64Gi", "pods": "110"}


def in_network_namespace(path: str, call: Any) -> Any:
    """`call()` in a thread of its own that joined the network namespace at `path` (a
    thread's namespace is its own; the thread ends with it). Its exception is raised."""
    result: list[Any] = []

    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {path}")
            finally:
                os.close(fd)
            result.append((True, call()))
        except BaseException as exc:
            result.append((False, exc))

    thread = threading.Thread(target=run, name="netns-probe", daemon=True)
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _empty_dir(path: Path) -> Path:
    """An emptyDir volume: writable by any user, as Kubernetes makes it (0777)."""
    path.mkdir(exist_ok=True)
    path.chmod(0o777)
    return path


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for child in path.rglob("*"):
        os.chown(child, uid, gid, follow_symlinks=False)


class ProcessKubelet:
    def __init__(
        self,
        kubeconfig: Path,
        root: Path,
        node: str,
        venv_bin: Path,
        image: str | None = None,
        stand_ins: dict[str, Path] | None = None,
        pod_network: list[int] | None = None,
        *,
        zone: str | None = None,
        state_dir: Path | None = None,
        log_dir: Path | None = None,
        lease_seconds: int = LEASE_SECONDS,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.root = root
        self.node = node
        self.zone = zone
        self.venv_bin = venv_bin
        # Each node's own: pod directories, pid records, the image's working containers
        # (state_dir) and container logs (log_dir), so that kubelets never share state.
        self.state_dir = state_dir or root / "kubelet"
        self.log_dir = log_dir or root / "logs" / "pods"
        self.pid_dir = self.state_dir / "pids"
        for d in (self.state_dir, self.log_dir, self.pid_dir):
            d.mkdir(parents=True, exist_ok=True)
        # The real kubelet's nodeLeaseDurationSeconds; it renews every quarter of it.
        self.lease_seconds = lease_seconds
        self.node_uid: str | None = None
        self.api = config.new_client_from_config(str(kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        raw = yaml.safe_load(kubeconfig.read_text())
        self.server = raw["clusters"][0]["cluster"]["server"]
        self.ca_file = raw["clusters"][0]["cluster"]["certificate-authority"]
        self.pods: dict[str, PodRunner] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.log_port = 0
        # Image runtime: shoal:dev containers run from this image's root filesystem
        # (open() mounts it); other images from their own, mounted on first use.
        self.image = ImageRoot(image, self.state_dir) if image else None
        self.images: dict[str, ImageRoot] = {}
        self.images_lock = threading.Lock()
        # Image -> when to ask buildah again whether it has it now.
        self.missing: dict[str, float] = {}
        # Image -> a local executable standing in for it (--local-image).
        self.stand_ins = dict(stand_ins or {})
        # --pod-network: each pod in a network namespace of its own, the host's loopback
        # ports listed here forwarded into it (podnet.py); None: pods share the host's.
        self.pod_network = list(pod_network) if pod_network is not None else None
        if self.pod_network is not None and self.image is None:
            raise ValueError("--pod-network needs the image runtime (--image, as root)")

    def start_pod_network(self, key: str) -> subprocess.Popen[bytes]:
        """The process holding a pod's network namespace, once it says it is ready."""
        assert self.pod_network is not None
        with (self.log_dir / f"podnet_{key.replace('/', '_')}.log").open("ab") as err:
            process = spawn(
                [sys.executable, "-I", "-S", str(PODNET), *map(str, self.pod_network)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env={},
                cwd="/",
                start_new_session=True,
            )
        assert process.stdout is not None
        line = process.stdout.readline()  # "ready", or nothing if it died (its log says)
        if line.strip() != b"ready":
            process.kill()
            process.wait()
            raise RuntimeError(f"podnet.py exited with {process.returncode}; see its log")
        log.info("Pod %s: network namespace held by pid %d", key, process.pid)
        return process

    # -- images ---------------------------------------------------------------------------

    def runtime_note(self) -> str:
        if self.image is None:
            return "the kubelet runs the venv runtime, not --image (which needs root and buildah)"
        return "buildah has no such image on this machine"

    def refuse_image(self, image: str) -> tuple[str, str] | None:
        """Why a container of `image` cannot start here, as (reason, message); None: it
        can (shoal:dev; in the image runtime, any image buildah has; a stand-in)."""
        if image in LOCAL_IMAGES:
            return None
        if self.image is None:
            if image in self.stand_ins:
                return None
            return (
                "ErrImageNotLocal",
                f"image {image!r} is not available in the local plane: the venv runtime runs "
                "only shoal:dev (this checkout's installation); run the kubelet with --image "
                "(as root) to run images buildah has, or give it a local stand-in with "
                f"--local-image {image}=PATH",
            )
        try:
            self.open_image(image)
            return None
        except ImageNotPresent:
            if image in self.stand_ins:
                return None
            return (
                "ErrImageNeverPull",
                f'Container image "{image}" is not present with pull policy of Never: the '
                "local plane pulls nothing, and `buildah images` has no such image here "
                "(build it with buildah, or give a local stand-in with --local-image)",
            )

    def open_image(self, image: str) -> ImageRoot:
        """The mounted image (image runtime), mounted once and kept until shutdown;
        ImageNotPresent (asked again at most every few seconds) if buildah lacks it."""
        assert self.image is not None
        if image in LOCAL_IMAGES:
            return self.image
        with self.images_lock:
            root = self.images.get(image)
            if root is not None:
                return root
            if time.monotonic() < self.missing.get(image, 0.0):
                raise ImageNotPresent(image)
            root = ImageRoot(image, self.state_dir)
            try:
                root.open()
            except ImageNotPresent:
                self.missing[image] = time.monotonic() + 5.0
                raise
            self.images[image] = root
            return root

    def image_for(self, spec: Any) -> ImageRoot | None:
        """The image a container runs from; None: it runs as a host process (the venv
        runtime, or a stand-in for an image buildah does not have)."""
        if self.image is None:
            return None
        image = spec.image or ""
        if image in LOCAL_IMAGES:
            return self.image
        with self.images_lock:
            return self.images.get(image)

    def image_env(self, spec: Any) -> dict[str, str]:
        """The ENV of the container's image (image runtime); empty for host processes."""
        root = self.image_for(spec)
        return dict(root.config.env) if root is not None else {}

    # -- paths and processes ------------------------------------------------------------

    def resolve(self, name: str) -> str | None:
        for directory in (str(self.venv_bin), *os.environ.get("PATH", "").split(":")):
            candidate = Path(directory) / name
            if directory and candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
        return None

    def pod_dir(self, pod: Any) -> Path:
        path = self.state_dir / "pods" / str(pod.metadata.uid)
        if not path.is_dir():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def staging_dir(self, pod: Any, container: str) -> Path:
        """Where a container's root is assembled: empty on the host, since everything
        mounted on it lives in the container's own mount namespace."""
        path = self.pod_dir(pod) / "containers" / container
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    def identity(self, pod: Any, spec: Any) -> Identity | None:
        """Who the container runs as (image runtime); None: as the kubelet's processes."""
        root = self.image_for(spec)
        return None if root is None else root.identity(pod, spec)

    def _owner(self, pod: Any) -> tuple[int, int]:
        """Who owns the pod's secret files and token in the image runtime: the first
        container's user, and the pod's fsGroup if it has one (else that user's group)."""
        assert self.image is not None
        first = pod.spec.containers[0]
        identity = (self.image_for(first) or self.image).identity(pod, first, check=False)
        fs_group = getattr(pod.spec.security_context, "fs_group", None)
        return identity.uid, identity.gid if fs_group is None else int(fs_group)

    def binds(self, pod: Any, spec: Any, volumes: dict[str, Path]) -> list[dict[str, Any]]:
        """The image runtime's bind mounts: volumes at their mountPaths (Secrets always
        read-only, as in Kubernetes), a per-pod /tmp unless a volume is there, the token."""
        secrets = {v.name for v in pod.spec.volumes or [] if v.secret is not None}
        binds = [
            {
                "source": str(volumes[mount.name] / (mount.sub_path or "")),
                "target": mount.mount_path,
                "read_only": bool(mount.read_only) or mount.name in secrets,
            }
            for mount in spec.volume_mounts or []
            if mount.name in volumes
        ]
        if not any(b["target"].rstrip("/") == "/tmp" for b in binds):
            tmp = self.pod_dir(pod) / "tmp"
            tmp.mkdir(exist_ok=True)
            tmp.chmod(0o1777)
            binds.append({"source": str(tmp), "target": "/tmp"})
        account = self.pod_dir(pod) / "serviceaccount"
        if account.is_dir():  # not for a pod that asked for no token
            binds.append({"source": str(account), "target": SERVICE_ACCOUNT_DIR, "read_only": True})
        return binds

    def remove_pod_dir(self, pod: Any) -> None:
        """The pod's kubeconfig (a token) and materialized volumes (secrets) go with it."""
        shutil.rmtree(self.state_dir / "pods" / str(pod.metadata.uid), ignore_errors=True)

    # -- volumes --------------------------------------------------------------------------

    def mount_volumes(self, pod: Any) -> dict[str, Path]:
        """Write the pod's secret volumes into its private directory; name -> directory.

        VolumeError if a Secret, or a key listed in `items`, is missing and not optional.
        """
        root = self.pod_dir(pod) / "volumes"
        root.mkdir(mode=0o700, exist_ok=True)
        mounted: dict[str, Path] = {}
        for volume in pod.spec.volumes or []:
            if volume.empty_dir is not None and self.image is not None:
                mounted[volume.name] = _empty_dir(root / volume.name)
                continue
            source = volume.secret
            if source is None:
                continue
            files = self._secret_volume_files(pod.metadata.namespace, volume.name, source)
            target = root / volume.name
            fresh = root / f".{volume.name}.new"
            shutil.rmtree(fresh, ignore_errors=True)
            fresh.mkdir(mode=0o700)
            for relative, content in files.items():
                path = fresh / relative
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, content)
                finally:
                    os.close(fd)
            if self.image is not None:
                # The pod's user reads them (0600 stays: nobody else on the host may).
                _chown_tree(fresh, *self._owner(pod))
            shutil.rmtree(target, ignore_errors=True)
            fresh.rename(target)
            mounted[volume.name] = target
        return mounted

    def _secret_volume_files(self, namespace: str, volume: str, source: Any) -> dict[str, bytes]:
        """relative path -> content, as the kubelet projects a secret volume."""
        name = source.secret_name
        secret = self._read_secret(namespace, name)
        if secret is None:
            if source.optional:
                return {}
            raise VolumeError(
                f'MountVolume.SetUp failed for volume "{volume}": secret "{name}" not found'
            )
        data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        if not source.items:
            return data
        files: dict[str, bytes] = {}
        for item in source.items:
            if item.key not in data:
                if source.optional:
                    continue
                raise VolumeError(
                    f'MountVolume.SetUp failed for volume "{volume}": references '
                    f"non-existent secret key: {item.key}"
                )
            if item.path.startswith("/") or ".." in Path(item.path).parts:
                raise VolumeError(f'volume "{volume}": invalid item path {item.path!r}')
            files[item.path] = data[item.key]
        return files

    def record_pid(self, pod: Any, container: str, pid: int) -> None:
        (self.pid_dir / f"{pod.metadata.uid}_{container}.pid").write_text(str(pid))

    def forget_pid(self, pod: Any, container: str) -> None:
        (self.pid_dir / f"{pod.metadata.uid}_{container}.pid").unlink(missing_ok=True)

    # -- environment ----------------------------------------------------------------------

    def pod_env(self, pod: Any) -> dict[str, str]:
        """What every container of the pod gets: PATH into the venv (the image's ENV in
        the image runtime), a kubeconfig."""
        token = wants_token(pod)
        if self.image is not None:
            if not token:
                return {"HOSTNAME": pod.metadata.name}
            self._write_service_account(pod)
            # The image's ENV comes per container (image_env): images differ.
            return {
                "HOSTNAME": pod.metadata.name,
                "KUBECONFIG": f"{SERVICE_ACCOUNT_DIR}/kubeconfig",
            }
        env = {
            k: v
            for k, v in os.environ.items()
            if k in ("HOME", "LANG", "LC_ALL", "TZ", "XDG_CACHE_HOME", "TMPDIR")
        }
        env["PATH"] = f"{self.venv_bin}:/usr/local/bin:/usr/bin:/bin"
        env["HOSTNAME"] = pod.metadata.name
        env["PYTHONUNBUFFERED"] = "1"
        if token:
            env["KUBECONFIG"] = str(self._pod_kubeconfig(pod))
        return env

    def _pod_kubeconfig(self, pod: Any) -> Path:
        path = self.pod_dir(pod) / "kubeconfig"
        path.write_text(yaml.safe_dump(self._kubeconfig(pod, self._pod_token(pod), self.ca_file)))
        path.chmod(0o600)
        return path

    def _write_service_account(self, pod: Any) -> None:
        """The image runtime's token directory, as Kubernetes projects it (token, ca.crt,
        namespace), plus a kubeconfig using them; owned by the pod's user."""
        directory = self.pod_dir(pod) / "serviceaccount"
        directory.mkdir(mode=0o700, exist_ok=True)
        token = self._pod_token(pod)
        files = {
            "token": token,
            "ca.crt": Path(self.ca_file).read_text(),
            "namespace": pod.metadata.namespace,
            "kubeconfig": yaml.safe_dump(
                self._kubeconfig(pod, token, f"{SERVICE_ACCOUNT_DIR}/ca.crt")
            ),
        }
        for name, content in files.items():
            (directory / name).write_text(content)
            (directory / name).chmod(0o600)
        _chown_tree(directory, *self._owner(pod))

    def _pod_token(self, pod: Any) -> str:
        sa = pod.spec.service_account_name or "default"
        namespace = pod.metadata.namespace
        # No audiences: the API server's own, what the pod's kube-api-access volume asks
        # for. NodeRestriction lets a node request only the audiences its pods' volumes name.
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=24 * 3600,
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
                ),
            )
        )

        def create_token() -> str:
            try:
                token: str = self.core.create_namespaced_service_account_token(
                    sa, namespace, request
                ).status.token
                return token
            except ApiException as exc:
                # 404: the service account may not exist yet (a controller creates it).
                # 403: the Node authorizer has not seen the pod's binding yet.
                if exc.status in (403, 404):
                    raise
                raise RuntimeError(
                    f"no token for service account {namespace}/{sa}: {exc.reason}"
                ) from exc

        try:
            token = eventually(
                create_token,
                30,
                f"service account {namespace}/{sa} to exist",
                interval=0.5,
                retry_on=(ApiException,),
            )
        except WaitTimeout as exc:
            raise RuntimeError(f"no token for service account {namespace}/{sa}: {exc}") from exc
        return token

    def _kubeconfig(self, pod: Any, token: str, ca_file: str) -> dict[str, Any]:
        sa = pod.spec.service_account_name or "default"
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {"server": self.server, "certificate-authority": ca_file},
                }
            ],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "pod",
                    "context": {
                        "cluster": "local",
                        "user": sa,
                        "namespace": pod.metadata.namespace,
                    },
                }
            ],
            "current-context": "pod",
        }

    def _field(self, pod: Any, path: str) -> str:
        meta = pod.metadata
        simple = {
            "metadata.name": meta.name,
            "metadata.namespace": meta.namespace,
            "metadata.uid": meta.uid,
            "spec.nodeName": self.node,
            "spec.serviceAccountName": pod.spec.service_account_name or "default",
            "status.podIP": POD_IP,
            "status.hostIP": POD_IP,
        }
        if path in simple:
            return str(simple[path])
        for prefix, values in (
            ("metadata.labels", meta.labels),
            ("metadata.annotations", meta.annotations),
        ):
            if path.startswith(prefix + "['") and path.endswith("']"):
                return str((values or {}).get(path[len(prefix) + 2 : -2], ""))
        raise ValueError(f"unsupported fieldRef {path!r}")

    def _read_secret(self, namespace: str, name: str) -> Any:
        """The Secret, or None if it does not exist."""
        try:
            return self.core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _read_config_map(self, namespace: str, name: str) -> Any:
        try:
            return self.core.read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _secret_data(self, namespace: str, name: str, optional: bool | None) -> dict[str, str]:
        secret = self._read_secret(namespace, name)
        if secret is None:
            if optional:
                return {}
            raise ConfigError(f'secret "{name}" not found')
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    def _config_map_data(self, namespace: str, name: str, optional: bool | None) -> dict[str, str]:
        cm = self._read_config_map(namespace, name)
        if cm is None:
            if optional:
                return {}
            raise ConfigError(f'configmap "{name}" not found')
        return {k: str(v) for k, v in (cm.data or {}).items()}

    def container_env(self, pod: Any, spec: Any, base: dict[str, str]) -> dict[str, str]:
        """The container's own variables. ConfigError: a non-optional reference to a
        Secret, ConfigMap or key that does not exist."""
        namespace = pod.metadata.namespace
        env: dict[str, str] = {}
        for source in spec.env_from or []:
            prefix = source.prefix or ""
            if source.config_map_ref is not None:
                ref = source.config_map_ref
                data = self._config_map_data(namespace, ref.name, ref.optional)
                env.update({prefix + k: v for k, v in data.items()})
            if source.secret_ref is not None:
                ref = source.secret_ref
                data = self._secret_data(namespace, ref.name, ref.optional)
                env.update({prefix + k: v for k, v in data.items()})
        for var in spec.env or []:
            if var.value_from is None:
                env[var.name] = expand(var.value or "", {**base, **env})
                continue
            source = var.value_from
            value: str | None = None
            if source.field_ref is not None:
                value = self._field(pod, source.field_ref.field_path)
            elif source.secret_key_ref is not None or source.config_map_key_ref is not None:
                is_secret = source.secret_key_ref is not None
                ref = source.secret_key_ref if is_secret else source.config_map_key_ref
                data = (self._secret_data if is_secret else self._config_map_data)(
                    namespace, ref.name, ref.optional
                )
                value = data.get(ref.key)
                if value is None and not ref.optional and ref.name is not None:
                    kind = "Secret" if is_secret else "ConfigMap"
                    raise ConfigError(
                        f"couldn't find key {ref.key} in {kind} {namespace}/{ref.name}"
                    )
            elif source.resource_field_ref is not None:
                value = "0"
            if value is not None:
                env[var.name] = value
        return env

    # -- probes ----------------------------------------------------------------------------

    def run_probe(
        self,
        probe: Any,
        spec: Any,
        env: dict[str, str],
        cwd: Path,
        inside: tuple[int, dict[str, Any]] | None = None,
        netns: str | None = None,
    ) -> bool:
        """`inside`: (pid, sandbox spec) of a container of the image runtime, whose exec
        probes run in its mount namespace and root, as its user. `netns`: the pod's
        network namespace (--pod-network), where HTTP and TCP probes connect."""
        timeout = probe.timeout_seconds or 1
        if netns is not None and probe._exec is None:
            return bool(in_network_namespace(netns, lambda: self.run_probe(probe, spec, env, cwd)))
        try:
            if probe._exec is not None and inside is not None:
                command = list(probe._exec.command or [])
                result = image_runtime.run_inside(*inside, command, timeout)
                return result.returncode == 0
            if probe._exec is not None:
                command = list(probe._exec.command or [])
                if command and "/" not in command[0]:
                    command[0] = self.resolve(command[0]) or command[0]
                result = subprocess.run(
                    command,
                    env=env,
                    cwd=cwd,
                    capture_output=True,
                    timeout=timeout,
                )
                return result.returncode == 0
            if probe.http_get is not None:
                port = self._port(probe.http_get.port, spec)
                url = f"http://127.0.0.1:{port}{probe.http_get.path or '/'}"
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(url, timeout=timeout) as response:
                    return bool(200 <= response.status < 400)
            if probe.tcp_socket is not None:
                port = self._port(probe.tcp_socket.port, spec)
                with socket.create_connection(("127.0.0.1", port), timeout=timeout):
                    return True
        except Exception:
            return False
        return True

    @staticmethod
    def _port(port: Any, spec: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for container_port in spec.ports or []:
            if container_port.name == port:
                return int(container_port.container_port)
        raise ValueError(f"unknown port {port!r}")

    # -- node ------------------------------------------------------------------------------

    def labels(self) -> dict[str, str]:
        labels = {
            HOSTNAME_LABEL: self.node,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        if self.zone:
            labels[ZONE_LABEL] = self.zone
        return labels

    def register_node(self) -> None:
        """Create the Node (or take over the one of that name, with this kubelet's labels),
        post its status and create its Lease."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node, "labels": self.labels()},
        }
        try:
            created = self.core.create_node(node)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # NodeRestriction lets a node set these labels on itself.
            created = self.core.patch_node(self.node, {"metadata": {"labels": self.labels()}})
        self.node_uid = created.metadata.uid
        self.heartbeat()
        self.renew_lease()
        log.info("Registered node %s (zone %s)", self.node, self.zone or "none")

    def heartbeat(self) -> None:
        """Post the node's status: Ready, no pressure, its address and log port."""
        stamp = now()
        previous: dict[str, Any] = {}
        try:
            current = self.core.read_node(self.node)
            previous = {c.type: c for c in current.status.conditions or []}
        except ApiException as exc:
            if exc.status != 404:
                raise

        def condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
            old = previous.get(kind)
            # lastTransitionTime only when the status changes (the node lifecycle
            # controller sets Unknown while the kubelet is silent).
            since = old.last_transition_time if old is not None and old.status == status else None
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": since.strftime("%Y-%m-%dT%H:%M:%SZ") if since else stamp,
            }

        status = {
            "capacity": dict(CAPACITY),
            "allocatable": dict(CAPACITY),
            "addresses": [
                {"type": "InternalIP", "address": POD_IP},
                {"type": "Hostname", "address": self.node},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.log_port}},
            "nodeInfo": {
                "machineID": self.node,
                "systemUUID": self.node,
                "bootID": self.node,
                "kernelVersion": os.uname().release,
                "osImage": "local processes" if self.image is None else self.image.image,
                "containerRuntimeVersion": "process://1" if self.image is None else "chroot://1",
                "kubeletVersion": "v0.0.0-shoal",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no pressure"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "no pressure"),
                condition(
                    "Ready", "True", "KubeletReady", "process kubelet is posting ready status"
                ),
            ],
        }
        self.core.patch_node_status(self.node, {"status": status})

    def renew_lease(self) -> None:
        """The node's Lease in kube-node-lease (what the node lifecycle controller watches
        for life), created on first use and owned by the Node, as the real kubelet's."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {
            "holderIdentity": self.node,
            "leaseDurationSeconds": self.lease_seconds,
            "renewTime": stamp,
        }
        try:
            self.coordination.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec})
            return
        except ApiException as exc:
            if exc.status != 404:
                raise
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": self.node_uid}
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.node,
                "namespace": "kube-node-lease",
                "ownerReferences": [owner] if self.node_uid else [],
            },
            "spec": spec,
        }
        try:
            self.coordination.create_namespaced_lease("kube-node-lease", lease)
        except ApiException as exc:
            if exc.status != 409:
                raise

    # -- pods ------------------------------------------------------------------------------

    def handle(self, pod: Any) -> None:
        # kube-scheduler binds; the watch only shows this node's pods (a field selector).
        if pod.spec.node_name != self.node:
            return
        uid = pod.metadata.uid
        with self.lock:
            runner = self.pods.get(uid)
            if pod.metadata.deletion_timestamp is not None:
                grace = float(pod.metadata.deletion_grace_period_seconds or 0)
                if runner is not None and runner.deleting:
                    # A shorter grace period (a forced deletion after a graceful one)
                    # starts the termination again with it (the pod workers' UpdatePod).
                    runner.set_grace(grace)
                    return
                if runner is None:
                    runner = PodRunner(self, pod)
                    self.pods[uid] = runner
                runner.deleting = True
                threading.Thread(target=self._delete, args=(runner, grace), daemon=True).start()
                return
            if runner is not None:
                # What the API server holds now (the status manager's reconciliation).
                runner.observe(pod)
            elif pod.status.phase not in ("Succeeded", "Failed"):
                runner = PodRunner(self, pod)
                self.pods[uid] = runner
                runner.start()

    def _delete(self, runner: PodRunner, grace: float) -> None:
        runner.terminate(grace)
        pod = runner.pod
        try:
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                pod.metadata.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0,
                    preconditions=client.V1Preconditions(uid=pod.metadata.uid),
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("Deleting pod %s failed: %s", runner.key, exc.reason)
        log.info("Pod %s stopped and deleted", runner.key)
        with self.lock:
            self.pods.pop(pod.metadata.uid, None)

    def watch_pods(self) -> None:
        """The pods bound to this node (spec.nodeName), as the real kubelet watches them."""
        selector = f"spec.nodeName={self.node}"
        while not self.stopping.is_set():
            try:
                listed = self.core.list_pod_for_all_namespaces(field_selector=selector)
                seen = set()
                for pod in listed.items:
                    seen.add(pod.metadata.uid)
                    self.handle(pod)
                self._forget_vanished(seen)
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=60,
                )
                for event in stream:
                    if self.stopping.is_set():
                        return
                    pod = event["object"]
                    if event["type"] == "DELETED":
                        self._vanished(pod.metadata.uid)
                    else:
                        self.handle(pod)
            except Exception as exc:
                if not self.stopping.is_set():
                    log.warning("Pod watch failed (%s); listing again", exc)
                    time.sleep(1)

    def _vanished(self, uid: str) -> None:
        with self.lock:
            runner = self.pods.pop(uid, None)
        if runner is None:
            return
        if runner.deleting:
            # Forced deletion during a graceful one: its grace period shrinks to the least.
            runner.set_grace(0.0)
        else:
            # Deleted with grace 0 by someone else: stop its processes now (within the
            # least grace period: 1 s for the pod, 2 s for each container).
            threading.Thread(target=runner.terminate, args=(0.0,), daemon=True).start()

    def _forget_vanished(self, seen: set[str]) -> None:
        with self.lock:
            gone = [uid for uid in self.pods if uid not in seen]
        for uid in gone:
            self._vanished(uid)

    def heartbeats(self) -> None:
        """Renew the Lease every quarter of its duration; post the status every 10 s."""
        renew = self.lease_seconds / 4
        next_status = time.monotonic() + STATUS_PERIOD_NODE
        while not self.stopping.wait(renew):
            try:
                self.renew_lease()
            except Exception as exc:
                log.warning("Node lease renewal failed: %s", exc)
            if time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + STATUS_PERIOD_NODE
            try:
                self.heartbeat()
            except Exception as exc:
                log.warning("Node heartbeat failed: %s", exc)

    def shutdown(self) -> None:
        self.stopping.set()
        with self.lock:
            runners = list(self.pods.values())
        threads = []
        for runner in runners:
            grace = pod_grace(runner.pod)
            thread = threading.Thread(target=runner.terminate, args=(min(grace, 30.0),))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        for root in self.images.values():
            root.close()
        if self.image is not None:
            self.image.close()

    # -- logs for `kubectl logs` -----------------------------------------------------------

    def serve_logs(self, cert: Path, key: Path) -> None:
        kubelet = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _not_here(self) -> bool:
                """exec, attach and port-forward (the API server proxies them here): one
                plain line kubectl shows, not http.server's HTML error page."""
                verb = urllib.parse.urlparse(self.path).path.strip("/").split("/")[0]
                if verb not in ("exec", "attach", "portForward"):
                    return False
                body = (
                    f"{verb}: the local plane's process kubelet runs pods as processes of "
                    "this host and cannot enter them: use kubectl logs, and reach their "
                    "ports on 127.0.0.1\n"
                ).encode()
                self.send_response(501)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return True

            def do_POST(self) -> None:
                if not self._not_here():
                    self.send_error(404)

            def do_GET(self) -> None:
                if self._not_here():
                    return
                url = urllib.parse.urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(404)
                    return
                _, namespace, pod, container = parts
                path = kubelet.log_dir / f"{namespace}_{pod}_{container}.log"
                if not path.exists():
                    self.send_error(404, f"no logs for {namespace}/{pod}/{container}")
                    return
                query = urllib.parse.parse_qs(url.query)
                lines = path.read_bytes().splitlines(keepends=True)
                if "tailLines" in query:
                    lines = lines[-int(query["tailLines"][0]) :]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"".join(lines))

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("logs: " + format, *args)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(cert), str(key))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        self.log_port = int(server.server_address[1])
        threading.Thread(target=server.serve_forever, name="logs", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True, help="the plane's directory")
    parser.add_argument("--node", default="localkube")
    parser.add_argument("--zone", help="the node's topology.kubernetes.io/zone label")
    parser.add_argument(
        "--state-dir", type=Path, help="pod directories and pid records (<root>/kubelet)"
    )
    parser.add_argument("--pod-log-dir", type=Path, help="container logs (<root>/logs/pods)")
    parser.add_argument(
        "--lease-seconds",
        type=int,
        default=LEASE_SECONDS,
        help="the node Lease's duration; renewed every quarter of it (40)",
    )
    parser.add_argument(
        "--venv-bin", type=Path, required=True, help="bin directory of the virtualenv pods run in"
    )
    parser.add_argument(
        "--image",
        help="run shoal:dev pods from this image's root filesystem, and other images from "
        "their own where buildah has them (needs root)",
    )
    parser.add_argument(
        "--local-image",
        action="append",
        default=[],
        metavar="IMAGE=PATH",
        help="run containers of IMAGE as host processes of the executable PATH where IMAGE "
        "cannot run from an image (no --image, or buildah lacks it); repeatable",
    )
    parser.add_argument(
        "--pod-network",
        action="store_true",
        help="run each pod in a network namespace of its own (image runtime, root), with "
        "the --forward-port ports of the host's loopback forwarded into it",
    )
    parser.add_argument(
        "--forward-port",
        action="append",
        type=int,
        default=[],
        metavar="PORT",
        help="with --pod-network: 127.0.0.1:PORT inside each pod reaches the host's; repeatable",
    )
    args = parser.parse_args()
    if args.pod_network and not args.image:
        parser.error("--pod-network needs --image (the image runtime, as root)")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kubelet = ProcessKubelet(
        args.kubeconfig,
        args.root,
        args.node,
        args.venv_bin,
        args.image,
        parse_stand_ins(args.local_image),
        args.forward_port if args.pod_network else None,
        zone=args.zone,
        state_dir=args.state_dir,
        log_dir=args.pod_log_dir,
        lease_seconds=args.lease_seconds,
    )
    if kubelet.image is not None:
        # What a killed kubelet left mounted, then the image for shoal:dev.
        image_runtime.remove_recorded(kubelet.state_dir)
        kubelet.image.open()
    pki = args.root / "pki"
    kubelet.serve_logs(pki / "apiserver.crt", pki / "apiserver.key")
    kubelet.register_node()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=kubelet.watch_pods, name="pods", daemon=True).start()
    threading.Thread(target=kubelet.heartbeats, name="heartbeat", daemon=True).start()
    stop.wait()
    log.info("Stopping: terminating every pod")
    kubelet.shutdown()
    log.info("Stopped")


if __name__ == "__main__":
    main()
