"""Leader election on a coordination.k8s.io/v1 Lease: one operator replica acts at a time.

`shoal-operator --leader-elect` (several replicas) takes a Lease before it runs kopf, as
controller-runtime's operators do. A standby polls the Lease and takes it once it has
expired; the holder renews it and exits the process if it cannot (Kubernetes restarts it
as a standby). Without the option nothing here runs: one replica acts as it always did.

Expiry is judged as client-go judges it: a standby counts the lease duration, on its own
monotonic clock, from the moment it *saw* the Lease change (its resourceVersion), never
from the renewTime the holder wrote. Two nodes' wall clocks may disagree; a standby's
own clock only has to run at the holder's rate. The holder stops acting (exits) once
RENEW_DEADLINE has passed since the last renewal it *sent* that succeeded, which is
before any standby, counting LEASE_DURATION from after that write, may take the Lease.
Taking is a replace carrying the resourceVersion that was read (optimistic concurrency),
so of two standbys racing for one expired Lease, only one write succeeds.

The decisions (`observe`, `may_take`, `must_step_down`) are pure functions of the Lease
record and the time, unit-tested in tests/test_leadership.py; `LeaseElector` is the I/O.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)

# Seconds. A standby takes an abandoned Lease LEASE_DURATION after it last saw it change
# (plus at most RETRY_INTERVAL), which keeps a takeover under 15 s after the holder dies.
LEASE_DURATION = 10
RENEW_INTERVAL = 2.0
# The holder gives up (exits) this long after its last successful renewal: shorter than
# LEASE_DURATION, so it has stopped before a standby may take over, even if its renewal
# requests stall rather than fail.
RENEW_DEADLINE = 8.0
RETRY_INTERVAL = 1.0
# Each API call gives up after this long, so that a standby's poll or a holder's renewal
# stuck on a silent connection is retried rather than waited on forever.
REQUEST_TIMEOUT = 2.0
# How often the holder's watchdog checks the renew deadline: apart from the renewals, so a
# renewal that hangs cannot keep the holder acting past the deadline.
WATCHDOG_INTERVAL = 0.1

DEFAULT_LEASE_NAME = "shoal-operator"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class LeaseRecord:
    """What the decisions read of a Lease."""

    holder: str  # "" when nobody holds it (never taken, or released)
    duration: float  # spec.leaseDurationSeconds
    version: str  # metadata.resourceVersion: changes with every write, renewals included
    transitions: int  # spec.leaseTransitions


@dataclass(frozen=True)
class Observation:
    """A Lease record and when (local monotonic seconds) this version was first seen."""

    record: LeaseRecord
    seen_at: float


def observe(previous: Observation | None, record: LeaseRecord, now: float) -> Observation:
    """The same version as before keeps the time it was first seen; a new one starts now."""
    if previous is not None and previous.record.version == record.version:
        return previous
    return Observation(record, now)


def may_take(observation: Observation, identity: str, now: float) -> bool:
    """May `identity` write itself into this Lease as holder now?

    Yes if nobody holds it, if it is already ours (a restart under the same name), or if
    it has not changed for its whole duration since we first saw it (its holder stopped
    renewing).
    """
    holder = observation.record.holder
    if not holder or holder == identity:
        return True
    return now - observation.seen_at >= observation.record.duration


def must_step_down(last_renewed: float, now: float, deadline: float = RENEW_DEADLINE) -> bool:
    """Must the holder stop acting? Yes once `deadline` has passed since the last renewal
    that succeeded (`last_renewed`: when that request was sent, local monotonic)."""
    return now - last_renewed >= deadline


def record_of(lease: dict[str, Any]) -> LeaseRecord:
    """A Lease as API JSON (camelCase) to its record."""
    spec = lease.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration=float(spec.get("leaseDurationSeconds") or LEASE_DURATION),
        version=str(lease["metadata"]["resourceVersion"]),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def micro_time(t: float | None = None) -> str:
    """A MicroTime as the API server parses it: always six fractional digits (Python's
    isoformat drops them when the microseconds are 0)."""
    when = datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_namespace(explicit: str | None) -> str:
    """The Lease's namespace: the option, else POD_NAMESPACE, else the pod's own (its
    service account's namespace file)."""
    if explicit:
        return explicit
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        raise SystemExit(
            "--leader-elect needs the Lease's namespace: --leader-elect-namespace, "
            "POD_NAMESPACE, or running in a pod"
        ) from None


class LostLease(Exception):
    """Someone else holds the Lease we thought ours."""


class LeaseElector:
    """One replica's side of the election, on the official (synchronous) client.

    `acquire` blocks until this replica holds the Lease; `keep` renews it from a daemon
    thread and calls `on_lost` (which must stop the process) when it may no longer act.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        identity: str,
        *,
        duration: int = LEASE_DURATION,
        renew_interval: float = RENEW_INTERVAL,
        renew_deadline: float = RENEW_DEADLINE,
        retry_interval: float = RETRY_INTERVAL,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self.api = api
        self.leases = client.CoordinationV1Api(api)
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration = duration
        self.renew_interval = renew_interval
        self.renew_deadline = renew_deadline
        self.retry_interval = retry_interval
        self.request_timeout = request_timeout
        self.observation: Observation | None = None
        self.held: dict[str, Any] | None = None  # the Lease as we last wrote it
        # When the request behind our last successful write (taking or renewing) was sent,
        # local monotonic: the renew deadline counts from there.
        self.last_renewed = 0.0
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lost = threading.Lock()

    # -- I/O -------------------------------------------------------------------------

    def _read(self) -> dict[str, Any] | None:
        try:
            lease = self.leases.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self.request_timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        found: dict[str, Any] = self.api.sanitize_for_serialization(lease)
        return found

    def _body(self, base: dict[str, Any] | None, transitions: int) -> dict[str, Any]:
        now = micro_time()
        spec = dict((base or {}).get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = now
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=self.duration,
            renewTime=now,
            leaseTransitions=transitions,
        )
        metadata = (base or {}).get("metadata") or {"name": self.name}
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }

    def _write(self, body: dict[str, Any], create: bool) -> dict[str, Any]:
        if create:
            written = self.leases.create_namespaced_lease(
                self.namespace, body, _request_timeout=self.request_timeout
            )
        else:
            # metadata.resourceVersion is in the body: a 409 if anyone wrote in between.
            written = self.leases.replace_namespaced_lease(
                self.name, self.namespace, body, _request_timeout=self.request_timeout
            )
        result: dict[str, Any] = self.api.sanitize_for_serialization(written)
        return result

    def try_acquire(self) -> bool:
        """One attempt: read the Lease, take it if the decision allows; True if ours."""
        return self.take(self._read())

    def take(self, lease: dict[str, Any] | None) -> bool:
        """Take `lease` (as read; None: there is none) if the decision allows; True if ours
        now. The write carries the resourceVersion read: if anyone wrote the Lease since,
        the API server refuses it (409) and this returns False."""
        sent = time.monotonic()
        if lease is None:
            try:
                self.held = self._write(self._body(None, 0), create=True)
            except ApiException as exc:
                if exc.status == 409:  # another replica created it first
                    return False
                raise
            self.last_renewed = sent
            return True
        record = record_of(lease)
        self.observation = observe(self.observation, record, time.monotonic())
        if not may_take(self.observation, self.identity, time.monotonic()):
            return False
        taken_over = record.holder != self.identity
        transitions = record.transitions + (1 if taken_over and record.holder else 0)
        try:
            self.held = self._write(self._body(lease, transitions), create=False)
        except ApiException as exc:
            if exc.status == 409:  # someone wrote it since we read it: look again
                return False
            raise
        self.last_renewed = sent
        return True

    def acquire(self) -> None:
        """Block until this replica holds the Lease, saying once who holds it meanwhile."""
        told: str | None = None
        while True:
            try:
                if self.try_acquire():
                    log.info(
                        "leader election: %s holds Lease %s/%s",
                        self.identity,
                        self.namespace,
                        self.name,
                    )
                    return
                holder = self.observation.record.holder if self.observation else ""
                if holder != told:
                    log.info(
                        "leader election: standing by, Lease %s/%s held by %s",
                        self.namespace,
                        self.name,
                        holder,
                    )
                    told = holder
            except Exception as exc:  # the API server unreachable, RBAC: say so, retry
                log.warning("leader election: cannot read or take the Lease: %s", exc)
            time.sleep(self.retry_interval)

    def renew(self) -> None:
        """Write a new renewTime; LostLease if another replica holds the Lease."""
        assert self.held is not None
        try:
            self.held = self._write(self._body(self.held, self._transitions()), create=False)
            return
        except ApiException as exc:
            if exc.status == 404:  # deleted: anyone may create it anew, so it is not ours
                raise LostLease("nobody (it was deleted)") from exc
            if exc.status != 409:
                raise
        # Someone else wrote it: still ours (a label, say), renew on that version; not
        # ours, stop at once.
        lease = self._read()
        if lease is None or record_of(lease).holder != self.identity:
            raise LostLease(record_of(lease).holder if lease else "(deleted)")
        self.held = lease
        self.held = self._write(self._body(lease, self._transitions()), create=False)

    def _transitions(self) -> int:
        assert self.held is not None
        return int((self.held.get("spec") or {}).get("leaseTransitions") or 0)

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew every renew_interval from a daemon thread, and call `on_lost(why)` once
        when the Lease is another's or no renewal has succeeded for renew_deadline (a
        watchdog thread of its own checks that, so a hanging renewal cannot delay it)."""

        def lose(why: str) -> None:
            if self._lost.acquire(blocking=False):  # only the first of the two threads
                self.stopping.set()
                on_lost(why)

        def renewing() -> None:
            while not self.stopping.wait(self.renew_interval):
                sent = time.monotonic()
                try:
                    self.renew()
                except LostLease as exc:
                    lose(f"Lease {self.namespace}/{self.name} now held by {exc}")
                    return
                except Exception as exc:  # the watchdog decides when this is too long
                    log.warning("leader election: renewal failed: %s", exc)
                else:
                    self.last_renewed = sent

        def watching() -> None:
            while not self.stopping.wait(WATCHDOG_INTERVAL):
                if must_step_down(self.last_renewed, time.monotonic(), self.renew_deadline):
                    lose(
                        f"no renewal of Lease {self.namespace}/{self.name} succeeded "
                        f"for {self.renew_deadline:g} s"
                    )
                    return

        for target, name in ((renewing, "lease-renewal"), (watching, "lease-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def release(self) -> None:
        """After a graceful stop (kopf has returned): hand the Lease back, so a standby
        takes it on its next poll instead of after the whole duration."""
        self.stopping.set()
        # No renewal may land after the release (it would find the Lease not ours).
        for thread in self._threads:
            thread.join(self.request_timeout * 2)
        if self.held is None:
            return
        try:
            body = self._body(self.held, self._transitions())
            body["spec"]["holderIdentity"] = None
            body["spec"]["leaseDurationSeconds"] = 1
            self._write(body, create=False)
            log.info("leader election: released Lease %s/%s", self.namespace, self.name)
        except Exception as exc:  # it will expire anyway
            log.warning("leader election: could not release the Lease: %s", exc)
