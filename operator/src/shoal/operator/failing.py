"""Member pods whose containers crash-loop or cannot start: from the group's pods to what
the ConsumerGroup says about them (pure: the reconciler reads the pods, the same list
shoal.operator.scheduling reads, and shoal.operator.observe writes the conditions).

Without this a group whose members crash-loop (a port taken, a handler sidecar that
exits, an image that cannot be pulled, a Secret key missing) would only say "0 of 3
members ready", Degraded False, Status Reconciling: the reason would be on pods the user
may not think of looking at.

What counts, for every container of the pod (init containers and native sidecars too):
- waiting with CrashLoopBackOff after it was restarted at least once (restartCount >= 1:
  the kubelet restarts a container at once after its first exit, so a real
  CrashLoopBackOff always has; a stand-in kubelet that backs off from the first exit
  shows it after one exit, and one exit is no loop);
- terminated with a non-zero exit after such a restart (the moment between an exit and
  the back-off);
- running but not ready, restarted twice or more, last exit non-zero, for less than
  RUN_WINDOW seconds: a crash loop between two crashes, so that the episode does not end
  (and its Warning come again) each time the container runs for a moment;
- waiting with a reason that says it cannot start (CANNOT_START: an image that cannot be
  pulled, a missing Secret or ConfigMap key, a command that does not exist).
Not: waiting ContainerCreating or PodInitializing (starting), a container that exited
once, a pod being deleted.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The Degraded (and Ready, Progressing) reasons, and the Warning Event's at an episode's
#: start: containers that ran and exit, and containers that cannot be started.
CRASH_LOOPING = "MembersCrashLooping"
CANNOT_START = "MembersCannotStart"
REASONS = (CRASH_LOOPING, CANNOT_START)

#: Waiting reasons of a container that cannot be started (the kubelet's words).
CANNOT_START_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)

#: A container running (not ready) for less than this since its last non-zero exit, after
#: two restarts or more, is between two crashes of its loop.
RUN_WINDOW = 60.0

#: The words quoted from a termination or waiting message, at most.
MAX_DETAIL = 240
#: Kinds of failure named in the message, at most (the rest are counted).
MAX_LISTED = 3
#: Pod names named per kind of failure, at most (the rest are counted).
MAX_PODS = 3


@dataclass(frozen=True)
class Failure:
    """One container of one pod that crash-loops or cannot start."""

    pod: str
    container: str
    reason: str  # CrashLoopBackOff, ImagePullBackOff, Error, ...
    detail: str  # "last exit 1: ...", the kubelet's message, or ""
    crash: bool  # it ran and exits (not: it cannot be started)


@dataclass(frozen=True)
class Failing:
    """Some of the group's member pods crash-loop or cannot start."""

    failures: tuple[Failure, ...]  # sorted by pod, then container
    of: int  # member pods not being deleted

    @property
    def pods(self) -> int:
        return len({f.pod for f in self.failures})

    @property
    def reason(self) -> str:
        """MembersCrashLooping when some container crash-loops, else MembersCannotStart."""
        return CRASH_LOOPING if any(f.crash for f in self.failures) else CANNOT_START

    def message(self) -> str:
        """The Degraded condition's, the Event's and (after the member count) Ready's:
        "2 of 3 member pods crash-looping: orders-abc, orders-def container consumer:
        CrashLoopBackOff (last exit 1: cannot serve the health probes on *:8081: Address
        already in use)". Pods failing alike (container, reason, exit) are named together,
        with the first one's words."""
        crash = {f.crash for f in self.failures}
        what = "crash-looping" if crash == {True} else "cannot start" if crash == {False} else ""
        if not what:
            what = "crash-looping or cannot start"
        noun = "pod" if self.pods == 1 else "pods"
        groups: dict[tuple[str, str, str], list[Failure]] = {}
        for f in self.failures:
            exit_code = f.detail.split(":", 1)[0] if f.detail.startswith("last exit") else ""
            groups.setdefault((f.container, f.reason, exit_code), []).append(f)
        parts = []
        for (container, reason, _), found in list(groups.items())[:MAX_LISTED]:
            names = list(dict.fromkeys(f.pod for f in found))
            named = ", ".join(names[:MAX_PODS])
            if len(names) > MAX_PODS:
                named += f" and {len(names) - MAX_PODS} more"
            detail = f" ({found[0].detail})" if found[0].detail else ""
            parts.append(f"{named} container {container}: {reason}{detail}")
        more = ""
        if len(groups) > MAX_LISTED:
            rest = len(groups) - MAX_LISTED
            more = f" (and {rest} other {'failure' if rest == 1 else 'failures'}: "
            more += "kubectl describe pod)"
        return f"{self.pods} of {self.of} member {noun} {what}: {'; '.join(parts)}{more}"


def _deleting(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata")
    return isinstance(meta, Mapping) and bool(meta.get("deletionTimestamp"))


def _name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata")
    return str(meta.get("name", "")) if isinstance(meta, Mapping) else ""


def _words(text: object) -> str:
    """A message in one line, at most MAX_DETAIL characters. A log tail (a termination
    message the kubelet took from the log: FallbackToLogsOnError) says why in its last
    line: that one is kept."""
    lines = [" ".join(line.split()) for line in str(text or "").splitlines()]
    lines = [line for line in lines if line]
    found = lines[-1] if lines else ""
    return found if len(found) <= MAX_DETAIL else found[: MAX_DETAIL - 3] + "..."


def _exit(terminated: Mapping[str, Any]) -> str:
    """ "last exit 1: why" (the termination message, else the reason unless it is the
    plain Error): what the container said when it stopped."""
    code = terminated.get("exitCode")
    why = _words(terminated.get("message"))
    reason = terminated.get("reason")
    if not why and isinstance(reason, str) and reason not in ("Error", ""):
        why = reason  # OOMKilled, ContainerCannotRun, ...
    return f"last exit {code}: {why}" if why else f"last exit {code}"


def _time(value: object) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(value[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def container_failure(pod: str, status: Mapping[str, Any], now: float) -> Failure | None:
    """What one container status (an entry of containerStatuses or
    initContainerStatuses) says, if it crash-loops or cannot start (module docstring)."""
    name = str(status.get("name", ""))
    restarts = _int(status.get("restartCount"))
    state = status.get("state")
    state = state if isinstance(state, Mapping) else {}
    last = status.get("lastState")
    last = last if isinstance(last, Mapping) else {}
    last_terminated = last.get("terminated")
    last_terminated = last_terminated if isinstance(last_terminated, Mapping) else None
    waiting = state.get("waiting")
    if isinstance(waiting, Mapping):
        reason = str(waiting.get("reason") or "")
        if reason in CANNOT_START_REASONS:
            return Failure(pod, name, reason, _words(waiting.get("message")), crash=False)
        if reason == "CrashLoopBackOff" and restarts >= 1:
            detail = _exit(last_terminated) if last_terminated is not None else ""
            return Failure(pod, name, reason, detail, crash=True)
        return None
    terminated = state.get("terminated")
    if isinstance(terminated, Mapping):
        if _int(terminated.get("exitCode")) != 0 and restarts >= 1:
            reason = str(terminated.get("reason") or "Error")
            return Failure(pod, name, reason, _exit(terminated), crash=True)
        return None
    running = state.get("running")
    if (
        isinstance(running, Mapping)
        and not status.get("ready")
        and restarts >= 2
        and last_terminated is not None
        and _int(last_terminated.get("exitCode")) != 0
    ):
        since = _time(running.get("startedAt"))
        if since is not None and now - since < RUN_WINDOW:
            return Failure(pod, name, "CrashLoopBackOff", _exit(last_terminated), crash=True)
    return None


def pod_failures(pod: Mapping[str, Any], now: float) -> list[Failure]:
    """The failing containers of one pod: init containers (native sidecars among them)
    first, in the pod's order."""
    status = pod.get("status")
    if not isinstance(status, Mapping) or _deleting(pod):
        return []
    found = []
    for key in ("initContainerStatuses", "containerStatuses"):
        listed = status.get(key)
        for entry in listed if isinstance(listed, list) else ():
            if isinstance(entry, Mapping):
                failure = container_failure(_name(pod), entry, now)
                if failure is not None:
                    found.append(failure)
    return found


def failing(pods: Iterable[Mapping[str, Any]], now: float | None = None) -> Failing | None:
    """What the group's pods (API objects, as `kubectl get -o json` gives them) say: None
    when no container of theirs crash-loops or cannot start. Pods being deleted count in
    neither number (as in shoal.operator.scheduling)."""
    when = time.time() if now is None else now
    live = sorted((p for p in pods if not _deleting(p)), key=_name)
    failures = tuple(f for p in live for f in pod_failures(p, when))
    return Failing(failures=failures, of=len(live)) if failures else None


def failing_in_status(status: Mapping[str, Any] | None) -> bool:
    """Whether an earlier operator process said member pods crash-loop or cannot start
    (a condition it wrote has one of REASONS): then it has posted the episode's Warning,
    and a restarted operator does not post it again. (While a problem of the group's own
    outranks it in every condition, nothing says so: a restart then posts it again.)"""
    raw = (status or {}).get("conditions")
    return any(
        isinstance(c, Mapping) and c.get("reason") in REASONS
        for c in (raw if isinstance(raw, list) else ())
    )
