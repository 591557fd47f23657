"""One pod's containers, as the process kubelet (kubelet.py) runs them.

Init containers and native sidecars, as the real kubelet runs them (pkg/kubelet/
kuberuntime computeInitContainerActions, terminationOrdering; pkg/kubelet/prober; status
generate.go): init containers run one at a time, in order; a regular one runs to
completion (a failure is retried with backoff, or fails the pod under restartPolicy
Never); a sidecar (an init container with restartPolicy Always) is started and the next
container starts once it has started (its startupProbe succeeded; without one, once it
runs), and it is restarted with backoff whenever it exits, whatever the pod's
restartPolicy. The main containers start once every init container is done or started;
regular init containers never run again after that. The pod is Pending and not
Initialized until then (and Pending while a container waits for its first start); it is
Ready when its main containers and its sidecars are; initContainerStatuses are reported.
A startupProbe holds back readiness and liveness probes until it succeeds;
failureThreshold failures in a row of a startup or liveness probe kill the container as
the kubelet does (SIGTERM, then SIGKILL after the probe's terminationGracePeriodSeconds,
else the pod's, at least 2 s; the pod's other work goes on meanwhile), and it then
restarts. Each probe of each container runs in a thread of its own (the kubelet's worker
per container and probe type), so a slow probe delays no other. On deletion every
container is sent SIGTERM at once, except sidecars: each waits (within the grace period)
for the main containers and the next sidecar to exit, so they stop last, in reverse order,
with what is left of the grace period before SIGKILL. As in the kubelet, the pod's grace
period is at least 1 s (a forced deletion too) and each container gets at least 2 s
(minimumGracePeriodInSeconds); a deletion with a shorter grace period than the one under
way (a forced deletion after a graceful one) starts the termination again with it. A
container is a process group (its own session): when its first process exits, whatever it
left in the group is killed (SIGKILL), as a runtime kills its PID namespace. A pod whose
main containers have all exited for good (restartPolicy Never or OnFailure), or whose init
container failed, stops its sidecars the same way and restarts nothing. Not done:
lifecycle hooks (postStart, preStop), container-level restartPolicy rules on regular
containers; a child that calls setsid() leaves the group and is not found.

Crash-loop backoff is deliberately ten times shorter than the kubelet's, so that tests see
restarts within seconds: 1 s, doubling to at most 30 s (the kubelet: 10 s, doubling to
300 s), and back to 1 s after a container ran 60 s without exiting (the kubelet: 10 min).
A container that exits is reported with reason Completed (exit 0) or Error (anything else,
137 after SIGKILL), as containerd reports it. With terminationMessagePolicy
FallbackToLogsOnError a failed exit's message is the end of what that run wrote (its last
80 lines, at most the last 2,048 bytes), as the kubelet reads it from the container's log
(kuberuntime_container.go readLastStringFromContainerLogs); terminationMessagePath files
are not read (a process container has no file of its own there).

A PodRunner is a thread per pod: it prepares the pod's environment and volumes through its
kubelet, starts and supervises the containers, runs their probes, and posts the pod's
status every STATUS_PERIOD when it changed, or when the API server holds something else
(the node lifecycle controller marks a silent node's pods NotReady: the kubelet's status
manager puts its own status back, as observe() sees the pod's updates); terminate() stops
them in order.
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
# Crash-loop backoff (module docstring): 1 s doubling to MAX_BACKOFF, back to 1 s after a
# container ran BACKOFF_RESET without exiting. The kubelet's: 10 s, 300 s and 600 s.
MAX_BACKOFF = 30.0
BACKOFF_RESET = 2 * MAX_BACKOFF
# A container's shortest time between SIGTERM and SIGKILL (the kubelet's
# minimumGracePeriodInSeconds), and a pod's shortest grace period (pod_workers.go's
# calculateEffectiveGracePeriod: "we always supply a grace period of 1").
MIN_GRACE = 2.0
MIN_POD_GRACE = 1.0
# The kubelet's default terminationGracePeriodSeconds.
DEFAULT_GRACE = 30.0
# What FallbackToLogsOnError keeps of a failed run's log (kubecontainer's
# MaxContainerTerminationMessageLogLines and MaxContainerTerminationMessageLogLength).
TERMINATION_LOG_LINES = 80
TERMINATION_LOG_BYTES = 2048


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
    # Where the last start's output begins in log_path (runs append to one file).
    log_offset: int = 0
    # An init container ("init"), a native sidecar (an init container with restartPolicy
    # Always: "sidecar") or one of spec.containers ("main").
    kind: str = "main"
    # Its startupProbe succeeded (or it has none and is running): kubectl's "started".
    started: bool = False
    startup_next: float = 0.0
    startup_failures: int = 0
    # Image runtime: how exec probes enter the running container (sandbox.py's spec).
    enter: dict[str, Any] | None = None
    # Probes running in their threads ("startup", "readiness", "liveness"), and their
    # results, (kind, process probed, success), for the pod's thread to apply.
    probing: set[str] = field(default_factory=set)
    probe_results: list[tuple[str, Any, bool]] = field(default_factory=list)
    # A failed startup or liveness probe is having it killed (SIGTERM, then SIGKILL).
    killing: bool = False
    # Crash-loop backoff: the next delay is 2 ** backoff_step s (at most MAX_BACKOFF);
    # started_mono: when it last started (time.monotonic()).
    backoff_step: int = 0
    started_mono: float = 0.0


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
    # The termination's grace period (seconds, at least MIN_POD_GRACE; None: not
    # terminating) and when it was set (time.monotonic()); it only ever shrinks, and each
    # change starts the termination again (grace_version counts them).
    grace: float | None = None
    grace_since: float = 0.0
    grace_version: int = 0
    grace_lock: threading.Lock = field(default_factory=threading.Lock)
    # terminate() has begun, and has returned.
    terminating: bool = False
    terminated: threading.Event = field(default_factory=threading.Event)
    # What the API server holds of the pod's conditions (type -> status), from the latest
    # update the kubelet's watch saw (observe()), and whether one came since our last post.
    seen: dict[str, str] | None = None
    seen_fresh: bool = False

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
        log.info("Pod %s has finished: stopping its sidecars", self.key)
        self.finished = True
        self.set_grace(pod_grace(self.pod))
        for state, code in self._stop():
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
                state.log_offset = out.tell()
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
        state.started_mono = time.monotonic()
        state.killing = False
        state.probe_results.clear()
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
        """The delay before the next start after an exit: doubling from 1 s up to
        MAX_BACKOFF, from 1 s again when it had run BACKOFF_RESET (module docstring)."""
        if state.started_mono and time.monotonic() - state.started_mono >= BACKOFF_RESET:
            state.backoff_step = 0
        delay = min(MAX_BACKOFF, float(2**state.backoff_step))
        state.backoff_step = min(state.backoff_step + 1, 6)
        return delay

    def _exited(self, state: ContainerState, code: int) -> None:
        assert state.process is not None
        # Its first process is gone: so is the rest of the container, whatever it started
        # (a runtime kills the PID namespace's processes when its init exits).
        _signal_group(state.process.pid, signal.SIGKILL)
        self.kubelet.forget_pid(self.pod, state.spec.name)
        # As containerd reports it: 128 + the signal that killed it, reason Error.
        exit_code = code if code >= 0 else 128 - code
        reason = "Completed" if exit_code == 0 else "Error"
        log.info("Pod %s container %s exited with %d", self.key, state.spec.name, exit_code)
        state.terminated = {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": state.started_at,
            "finishedAt": now(),
        }
        policy = getattr(state.spec, "termination_message_policy", None)
        if exit_code != 0 and policy == "FallbackToLogsOnError":
            message = log_tail(state.log_path, state.log_offset)
            if message:
                state.terminated["message"] = message
        state.process = None
        state.ready = False
        state.killing = False
        state.next_start = time.monotonic() + self._backoff(state)

    # -- probes ----------------------------------------------------------------------------

    def _probe(self, state: ContainerState) -> None:
        """Startup probe first; readiness and liveness only once it has succeeded (as
        the real prober does). Regular init containers have no probes. Each probe runs in
        a thread of its own (_dispatch); its result is applied here, on the pod's thread,
        at the next pass."""
        spec = state.spec
        if state.kind == "init":
            return
        while state.probe_results:  # appended by the probes' threads (atomic, as pop)
            kind, process, ok = state.probe_results.pop(0)
            if process is state.process and not state.killing:
                self._probe_result(state, kind, ok)
        if state.killing or state.process is None:
            return
        t = time.monotonic()
        if not state.started:
            probe = spec.startup_probe
            if t >= state.startup_next and "startup" not in state.probing:
                state.startup_next = t + (probe.period_seconds or 10)
                self._dispatch(state, "startup", probe)
            return
        probe = spec.readiness_probe
        if probe is not None and t >= state.probe_next and "readiness" not in state.probing:
            state.probe_next = t + (probe.period_seconds or 10)
            self._dispatch(state, "readiness", probe)
        live = spec.liveness_probe
        if live is not None and t >= state.liveness_next and "liveness" not in state.probing:
            state.liveness_next = t + (live.period_seconds or 10)
            self._dispatch(state, "liveness", live)

    def _dispatch(self, state: ContainerState, kind: str, probe: Any) -> None:
        """Run a probe in a thread of its own; its result waits in state.probe_results."""
        process = state.process
        inside = None
        if state.enter is not None and process is not None:
            inside = (process.pid, state.enter)
        cwd = self.kubelet.pod_dir(self.pod)
        env = state.env
        state.probing.add(kind)

        def run() -> None:
            ok = False
            try:
                ok = self.kubelet.run_probe(probe, state.spec, env, cwd, inside, self.netns_path())
            finally:
                state.probe_results.append((kind, process, ok))
                state.probing.discard(kind)

        name = f"probe-{self.key}-{state.spec.name}-{kind}"
        threading.Thread(target=run, name=name, daemon=True).start()

    def _probe_result(self, state: ContainerState, kind: str, ok: bool) -> None:
        spec = state.spec
        t = time.monotonic()
        if kind == "startup":
            if state.started:
                return
            probe = spec.startup_probe
            if ok:
                state.started = True
                log.info("Pod %s container %s has started", self.key, spec.name)
                # Readiness and liveness begin now (their initial delay counts from the start).
                state.probe_next = max(state.probe_next, t)
                state.liveness_next = max(state.liveness_next, t)
                return
            state.startup_failures += 1
            if state.startup_failures >= (probe.failure_threshold or 3):
                state.startup_failures = 0
                self._kill(state, "startup", probe)
        elif kind == "readiness":
            probe = spec.readiness_probe
            if ok:
                state.probe_failures = 0
                state.probe_successes += 1
                if state.probe_successes >= (probe.success_threshold or 1):
                    state.ready = True
            else:
                state.probe_successes = 0
                state.probe_failures += 1
                if state.probe_failures >= (probe.failure_threshold or 3):
                    state.ready = False
        elif kind == "liveness":
            probe = spec.liveness_probe
            if ok:
                state.liveness_failures = 0
                return
            state.liveness_failures += 1
            if state.liveness_failures >= (probe.failure_threshold or 3):
                self._kill(state, "liveness", probe)

    def _kill(self, state: ContainerState, kind: str, probe: Any) -> None:
        """A container that failed its startup or liveness probe: SIGTERM, then SIGKILL
        after the probe's terminationGracePeriodSeconds, else the pod's, at least 2 s
        (setTerminationGracePeriod, killContainer), from a thread of its own. It then
        exits like any container, and restarts."""
        process = state.process
        assert process is not None
        grace = getattr(probe, "termination_grace_period_seconds", None)
        if grace is None:
            grace = pod_grace(self.pod)
        allowed = max(float(grace), MIN_GRACE)
        log.info(
            "Pod %s container %s failed its %s probe: stopping it (grace %.0f s) to restart it",
            self.key,
            state.spec.name,
            kind,
            allowed,
        )
        state.killing = True
        state.ready = False

        def kill() -> None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(allowed)
            except subprocess.TimeoutExpired:
                log.info(
                    "Pod %s container %s ignored SIGTERM for %.0f s: killing",
                    self.key,
                    state.spec.name,
                    allowed,
                )
                _signal_group(process.pid, signal.SIGKILL)

        name = f"kill-{self.key}-{state.spec.name}"
        threading.Thread(target=kill, name=name, daemon=True).start()

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
            if state.terminated is not None:  # it ran before (getPhase counts it stopped)
                status["lastState"] = {"terminated": state.terminated}
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

    def _phase(self, statuses: list[dict[str, Any]], sidecars: list[dict[str, Any]]) -> str:
        """statuses: the main containers', sidecars: the sidecars'. Pending until
        initialized (kubelet's getPhase), Failed when an init container failed under
        restartPolicy Never, Pending while a container waits to run for the first time
        (waiting, with no previous exit)."""
        if self.init_failed:
            return "Failed"
        if not self.initialized:
            return "Pending"
        if any("waiting" in s["state"] and "lastState" not in s for s in statuses + sidecars):
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
        phase = self._phase(statuses, sidecars)
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
        # Unchanged, and what the API server holds agrees (or it has not changed since we
        # posted): nothing to post. Else post it again (the kubelet's status manager's
        # needsReconcile): the node lifecycle controller may have marked it NotReady.
        disagrees = (
            self.seen_fresh
            and self.seen is not None
            and any(
                self.seen.get(c["type"], c["status"]) != c["status"] for c in status["conditions"]
            )
        )
        if status == without_stamps(self.last_status) and not disagrees:
            return
        if disagrees and status == without_stamps(self.last_status):
            log.info("Pod %s: the API server holds another status: posting ours again", self.key)
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
            self.seen_fresh = False
            self.kubelet.core.patch_namespaced_pod_status(
                self.pod.metadata.name, self.pod.metadata.namespace, {"status": status}
            )
            self.last_status = status
        except ApiException as exc:
            if exc.status != 404:
                log.warning("Pod %s: status update failed: %s", self.key, exc.reason)

    def observe(self, pod: Any) -> None:
        """An update of the pod the kubelet's watch saw: what the API server holds of its
        status, for report() to compare with ours."""
        conditions = (pod.status.conditions if pod.status else None) or []
        self.seen = {c.type: c.status for c in conditions}
        self.seen_fresh = True

    # -- stop ------------------------------------------------------------------------------

    def set_grace(self, grace: float) -> bool:
        """The termination's grace period, at least MIN_POD_GRACE; only a shorter one than
        the current is taken, and restarts the termination (_stop's waits) with it. True
        if taken."""
        grace = max(float(grace), MIN_POD_GRACE)
        with self.grace_lock:
            if self.terminated.is_set() or (self.grace is not None and grace >= self.grace):
                return False
            if self.grace is not None:
                log.info("Pod %s: grace period shortened to %.0f s", self.key, grace)
            self.grace = grace
            self.grace_since = time.monotonic()
            self.grace_version += 1
            return True

    def _grace_now(self) -> tuple[float, float, int]:
        with self.grace_lock:
            assert self.grace is not None
            return self.grace, self.grace_since, self.grace_version

    def terminate(self, grace: float) -> None:
        """Stop every container (_stop: sidecars after the main containers, in reverse
        order); returns when all are gone. A later call with a shorter grace period, while
        this one runs, shortens it (set_grace) and returns once it is done."""
        self.set_grace(grace)
        with self.grace_lock:
            under_way, self.terminating = self.terminating, True
        if under_way:
            self.terminated.wait()
            return
        try:
            self._terminate()
        finally:
            self.terminated.set()

    def _terminate(self) -> None:
        self.deleting = True
        self.done.wait(5)
        self._stop()
        for name, state in self.containers.items():
            self.kubelet.forget_pid(self.pod, name)
            if state.process is not None:
                # Whatever its first process left behind in its group.
                _signal_group(state.process.pid, signal.SIGKILL)
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

    def _stop(self) -> list[tuple[ContainerState, int]]:
        """Stop the running containers as the real kubelet does (killContainersWith-
        SyncResult and terminationOrdering), within the grace period set_grace set: every
        container at once, except that a sidecar first waits, within the pod's grace
        period, for every main container and every later sidecar to exit, and then gets
        what is left of it. SIGTERM, then SIGKILL when its time is up, at least MIN_GRACE
        after the SIGTERM. A shorter grace period set meanwhile starts it again: SIGTERM
        again, and the new period from then. Returns (state, exit status) of what it
        stopped; whatever else is in a container's process group is killed after it."""
        running = {
            name: state
            for name, state in self.containers.items()
            if state.process is not None and state.process.poll() is None
        }
        prereqs = termination_prereqs(self._specs(), set(running))
        exited = {name: threading.Event() for name in running}
        codes: dict[str, int] = {}

        def stop(name: str) -> None:
            process = running[name].process
            assert process is not None
            try:
                version = -1  # the grace period SIGTERM was sent under
                deadline = allowed = 0.0
                while True:
                    grace, since, current = self._grace_now()
                    t = time.monotonic()
                    if current != version:
                        waiting = [b for b in prereqs[name] if not exited[b].is_set()]
                        if waiting and t < since + grace:
                            exited[waiting[0]].wait(min(0.1, since + grace - t))
                            continue
                        # Whole seconds, as the kubelet counts them, and never under 2 s.
                        allowed = max(grace - int(t - since), MIN_GRACE)
                        _signal_group(process.pid, signal.SIGTERM)
                        version, deadline = current, t + allowed
                    try:
                        codes[name] = process.wait(max(0.0, min(0.1, deadline - t)))
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    if time.monotonic() >= deadline and self._grace_now()[2] == version:
                        log.info(
                            "Pod %s container %s ignored SIGTERM for %.0f s: killing",
                            self.key,
                            name,
                            allowed,
                        )
                        _signal_group(process.pid, signal.SIGKILL)
                        codes[name] = process.wait()
                        break
                _signal_group(process.pid, signal.SIGKILL)  # what it left in its group
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


def pod_grace(pod: Any) -> float:
    """The pod's terminationGracePeriodSeconds (30 when unset; 0 stays 0, for the
    minimums to apply)."""
    grace = pod.spec.termination_grace_period_seconds
    return DEFAULT_GRACE if grace is None else float(grace)


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


def log_tail(path: Path, offset: int) -> str:
    """The end of what a run wrote to its log from `offset`: its last TERMINATION_LOG_LINES
    lines, at most TERMINATION_LOG_BYTES bytes (a termination message under
    FallbackToLogsOnError)."""
    try:
        with path.open("rb") as log_file:
            size = log_file.seek(0, os.SEEK_END)
            start = max(offset, size - TERMINATION_LOG_BYTES)
            log_file.seek(start)
            data = log_file.read(TERMINATION_LOG_BYTES)
    except OSError:
        return ""
    lines = data.splitlines(keepends=True)[-TERMINATION_LOG_LINES:]
    return b"".join(lines).decode("utf-8", errors="replace")
