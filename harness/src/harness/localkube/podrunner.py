"""One pod's containers, as the process kubelet (kubelet.py) runs them.

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

A PodRunner is a thread per pod: it prepares the pod's environment and volumes through its
kubelet, starts and supervises the containers, runs their probes, and posts the pod's
status every STATUS_PERIOD; terminate() stops them in order.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

from harness.children import spawn
from harness.localkube import image as image_runtime
from harness.localkube.image import (
    Identity,
    RunAsError,
)
from harness.localkube.podspec import (
    POD_IP,
    ConfigError,
    VolumeError,
    expand,
    is_sidecar,
    mounted_paths,
    now,
    rewrite_path,
    termination_prereqs,
    without_stamps,
)

if TYPE_CHECKING:
    from harness.localkube.kubelet import ProcessKubelet

log = logging.getLogger("localkube.kubelet")

STATUS_PERIOD = 0.5
MAX_BACKOFF = 30.0
# A sidecar's shortest time between SIGTERM and SIGKILL (the kubelet's
# minimumGracePeriodInSeconds).
MIN_GRACE = 2.0


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
            return stand_in_command(stand_in, spec, env)
        command = [expand(c, env) for c in list(spec.command or []) + list(spec.args or [])]
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
        moved = mounted_paths(state.spec, self.volumes or {})
        env = {key: rewrite_path(value, moved) for key, value in env.items()}
        state.env = env
        command = [rewrite_path(arg, moved) for arg in self._command(state.spec, env)]
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
        command = [expand(c, env) for c in image.command(spec)]
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
        if status == without_stamps(self.last_status):
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


def stand_in_command(stand_in: Path, spec: Any, env: dict[str, str]) -> list[str]:
    """The host command of a container whose image has a local stand-in: the stand-in
    plus the container's args when it has no command (the image's ENTRYPOINT); else its
    command, with a command[0] named like the stand-in (`/handler`, `handler`) being it."""
    command = [expand(c, env) for c in list(spec.command or [])]
    args = [expand(c, env) for c in list(spec.args or [])]
    if not command or Path(command[0]).name == stand_in.name:
        command = [str(stand_in), *command[1:]]
    elif "/" not in command[0]:
        command[0] = shutil.which(command[0], path=env.get("PATH")) or command[0]
    if not os.access(command[0], os.X_OK):
        raise FileNotFoundError(f"{command[0]}: no such executable (image {spec.image})")
    return command + args


def _completed(state: ContainerState) -> bool:
    """It ran to completion (exit status 0) and is not running again."""
    return (
        state.process is None and state.terminated is not None and state.terminated["exitCode"] == 0
    )


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
