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
then SIGKILL after the grace period. Logs go to
`<pod log dir>/<namespace>_<pod>_<container>.log` and are served to `kubectl logs` on the
port the Node's status names (the API server proxies there).

Its identity is a node's: a client certificate `system:node:<node>` in `system:nodes`,
so the API server's Node authorizer and NodeRestriction admission decide what it may do,
as for a real kubelet: its own Node, Lease and pods' status, the Secrets and ConfigMaps
its pods name, tokens for its pods' service accounts. It needs nothing more (it reads
Secrets and ConfigMaps only for pods bound to it, by name; a read made before the
authorizer has seen the binding is refused and retried, like a missing Secret).

Init containers and native sidecars, as the real kubelet runs them (pkg/kubelet/
kuberuntime computeInitContainerActions, terminationOrdering; pkg/kubelet/prober; status
generate.go): init containers run one at a time, in order; a regular one runs to
completion (a failure is retried with backoff, or fails the pod under restartPolicy
Never); a sidecar (an init container with restartPolicy Always) is started and the next
container starts once it has started (its startupProbe succeeded; without one, once it
runs), and it is restarted with backoff whenever it exits, whatever the pod's
restartPolicy. The main containers start once every init container is done or started;
regular init containers never run again after that. A startupProbe holds back readiness
and liveness probes until it succeeds; failureThreshold failures in a row kill the
container (SIGKILL here, not the kubelet's graceful kill), which then restarts. The pod is
Pending and not Initialized until then; it is Ready when its main containers and its
sidecars are; initContainerStatuses are reported. On deletion every container is sent
SIGTERM at once, except sidecars: each waits (within the grace period) for the main
containers and the next sidecar to exit, so they stop last, in reverse order, with what is
left of the grace period (at least 2 s) before SIGKILL. A pod whose main containers have
all exited for good (restartPolicy Never or OnFailure), or whose init container failed,
stops its sidecars the same way and restarts nothing. Not done: lifecycle hooks
(postStart, preStop), container-level restartPolicy rules on regular containers, and a
grace period of 0 kills everything at once without any order.

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
import shlex
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
from dataclasses import dataclass, field
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
    RunAsError,
    parse_stand_ins,
)
from harness.waiting import WaitTimeout, eventually

log = logging.getLogger("localkube.kubelet")
_libc = ctypes.CDLL(None, use_errno=True)

LOCAL_IMAGES = {"shoal:dev", "docker.io/library/shoal:dev", "localhost/shoal:dev"}
POD_IP = "127.0.0.1"
PODNET = Path(__file__).resolve().parent / "podnet.py"
CLONE_NEWNET = 0x40000000
STATUS_PERIOD = 0.5
MAX_BACKOFF = 30.0
# A sidecar's shortest time between SIGTERM and SIGKILL (the kubelet's
# minimumGracePeriodInSeconds).
MIN_GRACE = 2.0
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


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerState:
    spec: Any
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    started_at: str | None = None
    restarts: int = 0
    ready: bool = False
    waiting: tuple[str, str] | None = None  # reason, message
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None
    next_start: float = 0.0
    probe_next: float = 0.0
    probe_successes: int = 0
    probe_failures: int = 0
    liveness_next: float = 0.0
    liveness_failures: int = 0
    env: dict[str, str] = field(default_factory=dict)  # as resolved at the last start
    # An init container ("init"), a native sidecar (an init container with restartPolicy
    # Always: "sidecar") or one of spec.containers ("main").
    kind: str = "main"
    # Its startupProbe succeeded (or it has none and is running): kubectl's "started".
    started: bool = False
    startup_next: float = 0.0
    startup_failures: int = 0
    # Image runtime: how exec probes enter the running container (sandbox.py's spec).
    enter: dict[str, Any] | None = None


@dataclass
class PodRunner:
    kubelet: ProcessKubelet
    pod: Any
    containers: dict[str, ContainerState] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    deleting: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    last_status: dict[str, Any] | None = None
    started_at: str = field(default_factory=now)
    # Volume name -> where it was materialized; None until the pod's volumes are set up.
    volumes: dict[str, Path] | None = None
    next_mount: float = 0.0
    # The pod's own environment (token, kubeconfig) could not be made: nothing will run.
    broken: bool = False
    # terminate() has stopped every process.
    stopped: bool = False
    # Every init container has run (the regular ones to completion, the sidecars have
    # started): the main containers may start. Never reset (podHasInitialized).
    initialized: bool = False
    # A regular init container failed under restartPolicy Never: the pod has failed.
    init_failed: bool = False
    # The pod has finished (init failed, or every main container exited for good): its
    # sidecars have been stopped and nothing restarts any more.
    finished: bool = False
    # --pod-network: the process holding the pod's network namespace (podnet.py).
    netns: subprocess.Popen[bytes] | None = None

    @property
    def key(self) -> str:
        return f"{self.pod.metadata.namespace}/{self.pod.metadata.name}"

    # -- start -----------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True).start()

    def _specs(self) -> list[tuple[str, Any]]:
        """(kind, spec) of every container, init containers first, in the pod's order."""
        specs = [
            ("sidecar" if is_sidecar(spec) else "init", spec)
            for spec in self.pod.spec.init_containers or []
        ]
        return specs + [("main", spec) for spec in self.pod.spec.containers]

    def _new_state(self, kind: str, spec: Any) -> ContainerState:
        return ContainerState(spec, self._log_path(spec.name), kind=kind)

    def _of_kind(self, *kinds: str) -> list[ContainerState]:
        return [s for s in self.containers.values() if s.kind in kinds]

    def _run(self) -> None:
        try:
            self.env = self.kubelet.pod_env(self.pod)
        except Exception as exc:
            log.warning("Pod %s: cannot prepare its environment: %s", self.key, exc)
            self.broken = True
            for kind, spec in self._specs():
                state = self._new_state(kind, spec)
                state.waiting = ("CreateContainerConfigError", str(exc)[:300])
                self.containers[spec.name] = state
            self.report()
            self.env = {}
        for kind, spec in self._specs():
            self.containers.setdefault(spec.name, self._new_state(kind, spec))
        if self.kubelet.pod_network is not None and not self.broken:
            self._start_network()
        while not self.deleting:
            if self.volumes is None and not self.broken:
                self._mount()
            if self.volumes is not None and not self.finished:
                self._sync()
            self.report()
            time.sleep(STATUS_PERIOD)
        self.done.set()
        if self.stopped:
            self.kubelet.remove_pod_dir(self.pod)

    # -- what runs when (the real kubelet's computeInitContainerActions) -------------------

    def _sync(self) -> None:
        """Init containers one after another, then the main containers; a pod that has
        finished stops its sidecars."""
        if self._sync_init():
            for state in self._of_kind("main"):
                self._supervise(state)
        if self._finishing():
            self._finish()

    def _sync_init(self) -> bool:
        """Advance the init containers; True once the pod is initialized.

        In order: a regular init container runs to completion (restarted with backoff
        when it fails, unless restartPolicy is Never: then the pod fails) before the next
        one starts; a sidecar is started, kept running (restarted with backoff whenever
        it exits, whatever the pod's restartPolicy) and probed, and the next container
        starts once it has started (its startupProbe succeeded; without one, once it
        runs). After initialization regular init containers never run again; sidecars
        are kept running."""
        for state in self._of_kind("init", "sidecar"):
            if state.kind == "sidecar":
                self._supervise(state)
                if not self.initialized and not self._has_started(state):
                    return False
                continue
            if self.initialized or _completed(state):
                continue
            self._supervise(state)
            if _completed(state):
                continue
            if state.terminated is not None and not self._should_restart(state):
                self.init_failed = True
            return False
        if not self.initialized:
            log.info("Pod %s initialized: starting its containers", self.key)
        self.initialized = True
        return True

    def _has_started(self, state: ContainerState) -> bool:
        return state.started and state.process is not None and state.process.poll() is None

    def _finishing(self) -> bool:
        """The pod will run nothing more: an init container failed for good, or every
        main container has exited and will not be restarted (restartPolicy Never or
        OnFailure). Its sidecars must not keep it alive."""
        if self.init_failed:
            return True
        mains = self._of_kind("main")
        return (
            self.initialized
            and bool(mains)
            and all(
                s.process is None and s.terminated is not None and not self._should_restart(s)
                for s in mains
            )
        )

    def _finish(self) -> None:
        """Stop what still runs (sidecars after the main containers, in reverse order),
        as a deletion would, and restart nothing any more."""
        grace = float(self.pod.spec.termination_grace_period_seconds or 30)
        log.info("Pod %s has finished: stopping its sidecars", self.key)
        self.finished = True
        for state, code in self._stop(grace):
            self._exited(state, code)

    def _start_network(self) -> None:
        """The pod's network namespace (--pod-network), before any of its containers; a
        pod whose namespace cannot be made runs nothing (FailedCreatePodSandBox)."""
        try:
            self.netns = self.kubelet.start_pod_network(self.key)
        except (OSError, RuntimeError) as exc:
            message = f"cannot make the pod's network namespace: {exc}"
            log.warning("Pod %s: %s", self.key, message)
            self.broken = True
            for state in self.containers.values():
                state.waiting = ("FailedCreatePodSandBox", message[:300])

    def netns_path(self) -> str | None:
        """/proc/<pid>/ns/net of the pod's network namespace; None: the host's."""
        return f"/proc/{self.netns.pid}/ns/net" if self.netns is not None else None

    def _mount(self) -> None:
        """Set up the pod's volumes (retried every few seconds while a Secret is missing)."""
        if time.monotonic() < self.next_mount:
            return
        try:
            self.volumes = self.kubelet.mount_volumes(self.pod)
        except (VolumeError, ApiException) as exc:
            message = str(exc) if isinstance(exc, VolumeError) else f"API error: {exc.reason}"
            if not any(
                s.waiting == ("ContainerCreating", message) for s in self.containers.values()
            ):
                log.warning("Pod %s: %s", self.key, message)
            for state in self.containers.values():
                state.waiting = ("ContainerCreating", message)
            self.next_mount = time.monotonic() + 2.0
            return
        for state in self.containers.values():
            if state.waiting and state.waiting[0] == "ContainerCreating":
                state.waiting = None

    def _log_path(self, container: str) -> Path:
        meta = self.pod.metadata
        return self.kubelet.log_dir / f"{meta.namespace}_{meta.name}_{container}.log"

    def _supervise(self, state: ContainerState) -> None:
        if self.broken:
            return
        if state.process is None:
            refused = self.kubelet.refuse_image(state.spec.image or "")
            if refused is not None:
                if state.waiting != refused:
                    log.warning("Pod %s container %s: %s", self.key, state.spec.name, refused[1])
                state.waiting = refused
                return
        process = state.process
        if process is not None:
            code = process.poll()
            if code is None:
                self._probe(state)
                return
            self._exited(state, code)
        if state.terminated is not None and not self._should_restart(state):
            return
        if time.monotonic() >= state.next_start:
            self._start_container(state)

    def _should_restart(self, state: ContainerState) -> bool:
        """Whether an exited container starts again: a sidecar always (unless the pod
        has finished), a regular init container only after a failure and not under
        restartPolicy Never, a main container per restartPolicy."""
        if self.finished:
            return False
        policy = self.pod.spec.restart_policy or "Always"
        if state.kind == "sidecar":
            return True
        if state.kind == "init":
            failed = state.terminated is not None and state.terminated["exitCode"] != 0
            return failed and policy != "Never"
        if policy == "Always":
            return True
        if policy == "OnFailure":
            return bool(state.terminated and state.terminated["exitCode"] != 0)
        return False

    def _command(self, spec: Any, env: dict[str, str]) -> list[str]:
        # Kubernetes expands only $(VAR), from the container's own environment; $VAR and
        # the kubelet's environment never reach a command.
        stand_in = self.kubelet.stand_ins.get(spec.image or "")
        if stand_in is not None:
            return _stand_in_command(stand_in, spec, env)
        command = [_expand(c, env) for c in list(spec.command or []) + list(spec.args or [])]
        if not command:
            raise FileNotFoundError("the container has no command (shoal:dev has no entrypoint)")
        head = command[0]
        if "/" not in head:
            resolved = self.kubelet.resolve(head)
            if resolved is None:
                raise FileNotFoundError(f'executable file "{head}" not found in $PATH')
            command[0] = resolved
        elif not os.access(head, os.X_OK):
            raise FileNotFoundError(f"{head}: no such executable")
        return command

    def _start_container(self, state: ContainerState) -> None:
        spec = state.spec
        # The image's ENV (image runtime), then the pod's, then the container's own.
        base = {**self.kubelet.image_env(spec), **self.env}
        env = dict(base)
        try:
            env.update(self.kubelet.container_env(self.pod, spec, base))
            identity = self.kubelet.identity(self.pod, spec)
        except (ConfigError, RunAsError, ApiException) as exc:
            message = f"API error: {exc.reason}" if isinstance(exc, ApiException) else str(exc)
            if state.waiting != ("CreateContainerConfigError", message):
                log.warning("Pod %s container %s: %s", self.key, spec.name, message)
            state.waiting = ("CreateContainerConfigError", message)
            state.next_start = time.monotonic() + 2.0
            return
        state.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with state.log_path.open("ab") as out:
                if identity is None:
                    command = self._start_process(state, env, out)
                else:
                    command = self._start_in_image(state, env, identity, out)
        except OSError as exc:
            message = str(exc)
            log.warning("Pod %s container %s cannot start: %s", self.key, spec.name, message)
            state.process = None
            state.last_terminated = state.terminated
            state.terminated = {
                "exitCode": 128,
                "reason": "StartError",
                "message": message,
                "startedAt": now(),
                "finishedAt": now(),
            }
            state.waiting = None
            state.restarts += 1 if state.started_at else 0
            state.started_at = state.started_at or now()
            state.next_start = time.monotonic() + self._backoff(state)
            return
        assert state.process is not None
        self.kubelet.record_pid(self.pod, spec.name, state.process.pid)
        if state.terminated is not None:
            state.restarts += 1
            state.last_terminated = state.terminated
        state.terminated = None
        state.waiting = None
        state.started_at = now()
        state.ready = spec.readiness_probe is None
        state.started = spec.startup_probe is None
        state.probe_successes = state.probe_failures = state.liveness_failures = 0
        state.startup_failures = 0
        startup_delay = getattr(spec.startup_probe, "initial_delay_seconds", 0) or 0
        state.startup_next = time.monotonic() + startup_delay
        delay = getattr(spec.readiness_probe, "initial_delay_seconds", 0) or 0
        state.probe_next = time.monotonic() + delay
        live_delay = getattr(spec.liveness_probe, "initial_delay_seconds", 0) or 0
        state.liveness_next = time.monotonic() + live_delay
        log.info(
            "Pod %s container %s started (pid %d): %s",
            self.key,
            spec.name,
            state.process.pid,
            shlex.join(command),
        )

    def _start_process(self, state: ContainerState, env: dict[str, str], out: Any) -> list[str]:
        """A host process of the virtualenv; volume paths rewritten to where they are."""
        moved = _mounted_paths(state.spec, self.volumes or {})
        env = {key: _rewrite_path(value, moved) for key, value in env.items()}
        state.env = env
        command = [_rewrite_path(arg, moved) for arg in self._command(state.spec, env)]
        stand_in = self.kubelet.stand_ins.get(state.spec.image or "")
        if stand_in is not None:
            note = (
                f"localkube: image {state.spec.image!r} is not run from an image here "
                f"({self.kubelet.runtime_note()}): the container runs its local stand-in "
                f"{stand_in} (--local-image) as a host process\n"
            )
            log.info("Pod %s container %s: %s", self.key, state.spec.name, note.strip())
            out.write(note.encode())
            out.flush()
        state.process = spawn(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.kubelet.pod_dir(self.pod),
            start_new_session=True,
        )
        return command

    def _start_in_image(
        self, state: ContainerState, env: dict[str, str], identity: Identity, out: Any
    ) -> list[str]:
        """Chrooted into the image, as the pod's user, volumes at their mountPaths."""
        spec = state.spec
        image = self.kubelet.image_for(spec)
        assert image is not None
        state.env = env
        command = [_expand(c, env) for c in image.command(spec)]
        if not command:
            raise FileNotFoundError("the container has no command, the image no ENTRYPOINT/CMD")
        if image.resolve(command[0], env.get("PATH", "")) is None:
            raise FileNotFoundError(f'executable file "{command[0]}" not found in $PATH')
        run_spec = image.run_spec(
            staging=self.kubelet.staging_dir(self.pod, spec.name),
            identity=identity,
            binds=self.kubelet.binds(self.pod, spec, self.volumes or {}),
            spec=spec,
            env=env,
            command=command,
        )
        run_spec["netns"] = self.netns_path()
        state.enter = image.enter_spec(identity, spec, env)
        state.process = image_runtime.start(run_spec, out)
        return command

    def _backoff(self, state: ContainerState) -> float:
        return min(MAX_BACKOFF, float(2 ** min(state.restarts, 6)))

    def _exited(self, state: ContainerState, code: int) -> None:
        assert state.process is not None
        self.kubelet.forget_pid(self.pod, state.spec.name)
        reason = "Completed" if code == 0 else "Error"
        if code < 0:
            reason = f"Signal{-code}"
        log.info("Pod %s container %s exited with %d", self.key, state.spec.name, code)
        state.terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": reason,
            "startedAt": state.started_at,
            "finishedAt": now(),
        }
        state.process = None
        state.ready = False
        state.next_start = time.monotonic() + self._backoff(state)

    # -- probes ----------------------------------------------------------------------------

    def _probe(self, state: ContainerState) -> None:
        """Startup probe first; readiness and liveness only once it has succeeded (as
        the real prober does). Regular init containers have no probes."""
        spec = state.spec
        t = time.monotonic()
        if state.kind == "init":
            return
        if not state.started:
            self._startup_probe(state, t)
            if not state.started:
                return
        probe = spec.readiness_probe
        if probe is not None and t >= state.probe_next:
            state.probe_next = t + (probe.period_seconds or 10)
            if self._run_probe(state, probe):
                state.probe_failures = 0
                state.probe_successes += 1
                if state.probe_successes >= (probe.success_threshold or 1):
                    state.ready = True
            else:
                state.probe_successes = 0
                state.probe_failures += 1
                if state.probe_failures >= (probe.failure_threshold or 3):
                    state.ready = False
        live = spec.liveness_probe
        if live is not None and t >= state.liveness_next and state.process is not None:
            state.liveness_next = t + (live.period_seconds or 10)
            if self._run_probe(state, live):
                state.liveness_failures = 0
            else:
                state.liveness_failures += 1
                if state.liveness_failures >= (live.failure_threshold or 3):
                    log.info(
                        "Pod %s container %s failed its liveness probe: restarting",
                        self.key,
                        spec.name,
                    )
                    _signal_group(state.process.pid, signal.SIGKILL)

    def _startup_probe(self, state: ContainerState, t: float) -> None:
        """Until it succeeds once: then the container has started. failureThreshold
        failures in a row kill it (restarted like any exit, with backoff)."""
        probe = state.spec.startup_probe
        if t < state.startup_next or state.process is None:
            return
        state.startup_next = t + (probe.period_seconds or 10)
        if self._run_probe(state, probe):
            state.started = True
            log.info("Pod %s container %s has started", self.key, state.spec.name)
            # Readiness and liveness begin now (their initial delay counts from the start).
            state.probe_next = max(state.probe_next, t)
            state.liveness_next = max(state.liveness_next, t)
            return
        state.startup_failures += 1
        if state.startup_failures >= (probe.failure_threshold or 3):
            log.info(
                "Pod %s container %s failed its startup probe: restarting",
                self.key,
                state.spec.name,
            )
            state.startup_failures = 0
            _signal_group(state.process.pid, signal.SIGKILL)

    def _run_probe(self, state: ContainerState, probe: Any) -> bool:
        inside = None
        if state.enter is not None and state.process is not None:
            inside = (state.process.pid, state.enter)
        cwd = self.kubelet.pod_dir(self.pod)
        return self.kubelet.run_probe(probe, state.spec, state.env, cwd, inside, self.netns_path())

    # -- status ----------------------------------------------------------------------------

    def _container_status(self, state: ContainerState) -> dict[str, Any]:
        running = state.process is not None and state.process.poll() is None
        # A regular init container is ready once it has completed (what the pod's
        # Initialized condition reads); the others when running, started and ready.
        ready = _completed(state) if state.kind == "init" else running and state.ready
        status: dict[str, Any] = {
            "name": state.spec.name,
            "image": state.spec.image or "",
            "imageID": "",
            "ready": bool(ready and (state.kind == "init" or state.started)),
            "started": bool(running and state.started),
            "restartCount": state.restarts,
        }
        if running:
            status["state"] = {"running": {"startedAt": state.started_at}}
            status["containerID"] = f"process://{state.process.pid}"  # type: ignore[union-attr]
        elif state.waiting is not None:
            status["state"] = {"waiting": {"reason": state.waiting[0], "message": state.waiting[1]}}
        elif (
            state.terminated is not None
            and self._should_restart(state)
            and (state.kind != "init" or not self.initialized)
        ):
            status["state"] = {
                "waiting": {
                    "reason": "CrashLoopBackOff"
                    if state.terminated["reason"] != "StartError"
                    else "RunContainerError",
                    "message": state.terminated.get("message")
                    or f"back-off restarting failed container {state.spec.name}",
                }
            }
            status["lastState"] = {"terminated": state.terminated}
        elif state.terminated is not None:
            status["state"] = {"terminated": state.terminated}
        elif not self.initialized and self.volumes is not None and state.kind != "init":
            # Waiting for the init containers before it (the kubelet's reason).
            status["state"] = {"waiting": {"reason": "PodInitializing"}}
        else:
            status["state"] = {"waiting": {"reason": "ContainerCreating"}}
        if "lastState" not in status and state.last_terminated is not None:
            status["lastState"] = {"terminated": state.last_terminated}
        return status

    def _phase(self, statuses: list[dict[str, Any]]) -> str:
        """statuses: the main containers'. Pending until initialized (kubelet's
        getPhase), Failed when an init container failed under restartPolicy Never."""
        if self.init_failed:
            return "Failed"
        if not self.initialized:
            return "Pending"
        states = [s["state"] for s in statuses]
        if any("running" in s for s in states):
            return "Running"
        if states and all("terminated" in s for s in states):
            codes = [s["terminated"]["exitCode"] for s in states]
            return "Succeeded" if all(c == 0 for c in codes) else "Failed"
        if any(s.get("waiting", {}).get("reason") == "CrashLoopBackOff" for s in states):
            return "Running"
        return "Pending"

    def report(self) -> None:
        statuses = [self._container_status(s) for s in self._of_kind("main")]
        init_statuses = [self._container_status(s) for s in self._of_kind("init", "sidecar")]
        sidecars = [
            status
            for status, state in zip(init_statuses, self._of_kind("init", "sidecar"), strict=True)
            if state.kind == "sidecar"
        ]
        # The pod is ready when its main containers and its sidecars are (the real
        # kubelet's GenerateContainersReadyCondition).
        ready = bool(statuses) and all(s["ready"] for s in statuses + sidecars)
        phase = self._phase(statuses)
        cond = "True" if ready else "False"
        initialized = "True" if self.initialized else "False"
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": POD_IP,
            "hostIPs": [{"ip": POD_IP}],
            "podIP": POD_IP,
            "podIPs": [{"ip": POD_IP}],
            "startTime": self.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": initialized},
                {"type": "ContainersReady", "status": cond},
                {"type": "Ready", "status": cond},
            ],
            "containerStatuses": statuses,
        }
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        if status == _without_stamps(self.last_status):
            return
        # lastTransitionTime only when a condition changes.
        previous = {c["type"]: c for c in (self.last_status or {}).get("conditions", [])}
        stamped = []
        for condition in status["conditions"]:
            old = previous.get(condition["type"])
            stamp = (
                (old or {}).get("lastTransitionTime")
                if old and old["status"] == condition["status"]
                else now()
            )
            stamped.append({**condition, "lastTransitionTime": stamp})
        status["conditions"] = stamped
        try:
            self.kubelet.core.patch_namespaced_pod_status(
                self.pod.metadata.name, self.pod.metadata.namespace, {"status": status}
            )
            self.last_status = status
        except ApiException as exc:
            if exc.status != 404:
                log.warning("Pod %s: status update failed: %s", self.key, exc.reason)

    # -- stop ------------------------------------------------------------------------------

    def terminate(self, grace: float) -> None:
        """Stop every container (_stop: sidecars after the main containers, in reverse
        order); returns when all are gone."""
        self.deleting = True
        self.done.wait(5)
        self._stop(grace)
        for name in self.containers:
            self.kubelet.forget_pid(self.pod, name)
        if self.netns is not None:  # after every container: the pause container goes last
            self.netns.terminate()
            try:
                self.netns.wait(5)
            except subprocess.TimeoutExpired:
                self.netns.kill()
                self.netns.wait()
        # Its directory goes once its processes are gone and its loop has ended (whichever
        # of the two comes last removes it): nothing will use it again.
        self.stopped = True
        if self.done.is_set():
            self.kubelet.remove_pod_dir(self.pod)

    def _stop(self, grace: float) -> list[tuple[ContainerState, int]]:
        """Stop the running containers as the real kubelet does (killContainersWith-
        SyncResult and terminationOrdering): every container at once, each with the
        pod's grace period, except that a sidecar first waits, within that period, for
        every main container and every later sidecar to exit, and then gets what is left
        of it, at least 2 s (minimumGracePeriodInSeconds). SIGTERM, then SIGKILL when its
        time is up. grace 0 (a forced deletion): SIGTERM and SIGKILL at once, no order.
        Returns (state, exit status) of what it stopped."""
        running = {
            name: state
            for name, state in self.containers.items()
            if state.process is not None and state.process.poll() is None
        }
        prereqs = termination_prereqs(self._specs(), set(running))
        exited = {name: threading.Event() for name in running}
        codes: dict[str, int] = {}
        start = time.monotonic()

        def stop(name: str) -> None:
            process = running[name].process
            assert process is not None
            try:
                allowed = grace
                if grace > 0 and prereqs[name]:
                    for before in prereqs[name]:
                        exited[before].wait(max(0.0, start + grace - time.monotonic()))
                    # Whole seconds, as the kubelet counts them, and never under 2 s.
                    allowed = max(grace - int(time.monotonic() - start), MIN_GRACE)
                _signal_group(process.pid, signal.SIGTERM)
                try:
                    codes[name] = process.wait(allowed)
                except subprocess.TimeoutExpired:
                    if grace > 0:
                        log.info(
                            "Pod %s container %s ignored SIGTERM for %.0f s: killing",
                            self.key,
                            name,
                            allowed,
                        )
                    _signal_group(process.pid, signal.SIGKILL)
                    codes[name] = process.wait()
                log.info("Pod %s container %s stopped (exit %d)", self.key, name, codes[name])
            finally:
                exited[name].set()

        threads = [
            threading.Thread(target=stop, args=(name,), name=f"stop-{self.key}-{name}")
            for name in running
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [(running[name], codes[name]) for name in running if name in codes]


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


def _stand_in_command(stand_in: Path, spec: Any, env: dict[str, str]) -> list[str]:
    """The host command of a container whose image has a local stand-in: the stand-in
    plus the container's args when it has no command (the image's ENTRYPOINT); else its
    command, with a command[0] named like the stand-in (`/handler`, `handler`) being it."""
    command = [_expand(c, env) for c in list(spec.command or [])]
    args = [_expand(c, env) for c in list(spec.args or [])]
    if not command or Path(command[0]).name == stand_in.name:
        command = [str(stand_in), *command[1:]]
    elif "/" not in command[0]:
        command[0] = shutil.which(command[0], path=env.get("PATH")) or command[0]
    if not os.access(command[0], os.X_OK):
        raise FileNotFoundError(f"{command[0]}: no such executable (image {spec.image})")
    return command + args


def wants_token(pod: Any) -> bool:
    """The pod has a projected service-account token for the API server's audiences (the
    kube-api-access volume the ServiceAccount admission plugin adds unless
    automountServiceAccountToken is false): only then does it get a token and kubeconfig."""
    for volume in pod.spec.volumes or []:
        for source in getattr(volume.projected, "sources", None) or []:
            token = source.service_account_token
            if token is not None and not token.audience:
                return True
    return False


def is_sidecar(spec: Any) -> bool:
    """A native sidecar: an init container with restartPolicy Always."""
    return getattr(spec, "restart_policy", None) == "Always"


def termination_prereqs(specs: list[tuple[str, Any]], running: set[str]) -> dict[str, list[str]]:
    """For each running container, the running ones it must wait for before it is sent
    SIGTERM (the real kubelet's newTerminationOrdering): a sidecar waits for every main
    container and for the next sidecar in the list (which waits for the one after it,
    and so on: sidecars stop in reverse order); everything else waits for nothing.
    specs: (kind, spec) as PodRunner._specs gives them."""
    mains = [spec.name for kind, spec in specs if kind == "main" and spec.name in running]
    prereqs: dict[str, list[str]] = {name: [] for name in running}
    later: str | None = None
    for kind, spec in reversed(specs):
        if kind != "sidecar":
            continue
        if spec.name in running:
            prereqs[spec.name] = mains + ([later] if later in running else [])
        # As in the kubelet, a sidecar that is not running (its channel closed at once)
        # breaks the chain: the one before it waits only for the main containers.
        later = spec.name
    return prereqs


def _completed(state: ContainerState) -> bool:
    """It ran to completion (exit status 0) and is not running again."""
    return (
        state.process is None and state.terminated is not None and state.terminated["exitCode"] == 0
    )


class VolumeError(RuntimeError):
    """A volume cannot be set up (MountVolume.SetUp failed, in kubelet terms)."""


class ConfigError(RuntimeError):
    """A container's env refers to what does not exist (CreateContainerConfigError)."""


def _mounted_paths(spec: Any, volumes: dict[str, Path]) -> list[tuple[str, str]]:
    """(mountPath, materialized path) of the container's materialized volumes, deepest
    mountPath first so that nested mounts win."""
    pairs = []
    for mount in spec.volume_mounts or []:
        if mount.name in volumes:
            target = volumes[mount.name] / (mount.sub_path or "")
            pairs.append((mount.mount_path.rstrip("/") or "/", str(target).rstrip("/")))
    return sorted(pairs, key=lambda pair: len(pair[0]), reverse=True)


def _rewrite_path(value: str, moved: list[tuple[str, str]]) -> str:
    """A path at or under a mountPath, moved to where the volume really is."""
    for mount_path, target in moved:
        if value == mount_path:
            return target
        if value.startswith(mount_path + "/"):
            return target + value[len(mount_path) :]
    return value


def _without_stamps(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """A reported status without lastTransitionTime, to compare with a fresh one."""
    if status is None:
        return None
    conditions = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]
    ]
    return {**status, "conditions": conditions}


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _empty_dir(path: Path) -> Path:
    """An emptyDir volume: writable by any user, as Kubernetes makes it (0777)."""
    path.mkdir(exist_ok=True)
    path.chmod(0o777)
    return path


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for child in path.rglob("*"):
        os.chown(child, uid, gid, follow_symlinks=False)


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    for key, val in env.items():
        value = value.replace(f"$({key})", val)
    return value


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
                env[var.name] = _expand(var.value or "", {**base, **env})
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
                if runner is not None and runner.deleting:
                    return
                if runner is None:
                    runner = PodRunner(self, pod)
                    self.pods[uid] = runner
                runner.deleting = True
                grace = float(pod.metadata.deletion_grace_period_seconds or 0)
                threading.Thread(target=self._delete, args=(runner, grace), daemon=True).start()
                return
            if runner is None and pod.status.phase not in ("Succeeded", "Failed"):
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
        if runner is not None and not runner.deleting:
            # Deleted with grace 0 by someone else: stop its processes now.
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
            grace = float(runner.pod.spec.termination_grace_period_seconds or 30)
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
            def do_GET(self) -> None:
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
