"""Two operator replicas with --leader-elect on the local plane: one acts, the other takes
over within 15 s of the first being SIGKILLed, and a `kubectl scale cg` issued meanwhile
is applied (issue 25).

Both replicas run as local processes (harness.kubetest.operator_process) against the
plane's API server, each with its own identity (POD_NAME), contending for one Lease in
the test's namespace.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config
from kubernetes.client.rest import ApiException

from harness.kubetest import create_namespace, namespace_pods, operator_process, wait_until
from harness.localkube.plane import LocalKube
from harness.waiting import eventually
from shoal.operator.leadership import LeaseElector, may_take

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
NS = "op-ha"
LEASE = "shoal-operator"
GROUP = "orders"
DEPLOYMENT = f"{GROUP}-consumer"
# What kopf logs after each reconcile of the group (this file's only group): only the
# acting replica's log may have it.
RECONCILED = "Handler 'reconcile' succeeded"


def lease_holder(plane: LocalKube, namespace: str = NS, name: str = LEASE) -> str:
    found = plane.kubectl("get", "lease", name, "-n", namespace, "-o", "json", check=False)
    if found.returncode != 0:
        return ""
    return str(json.loads(found.stdout)["spec"].get("holderIdentity") or "")


def deployment_replicas(plane: LocalKube) -> int | None:
    found = plane.kubectl("get", "deployment", DEPLOYMENT, "-n", NS, "-o", "json", check=False)
    if found.returncode != 0:
        return None
    return int(json.loads(found.stdout)["spec"]["replicas"])


def group(replicas: int) -> str:
    manifest: dict[str, Any] = yaml.safe_load(
        (ROOT / "examples" / "consumergroup.yaml").read_text()
    )
    manifest["metadata"]["namespace"] = NS
    manifest["spec"]["replicas"] = replicas
    return json.dumps(manifest)


@contextlib.contextmanager
def replica(plane: LocalKube, name: str, log: Path) -> Iterator[Any]:
    """One operator replica, `name` its identity in the Lease; stopped on the way out."""
    with operator_process(
        plane,
        [NS],
        log,
        # POD_ID too: kopf's and the Lease's identity, which set_identity() takes from
        # POD_NAME only when POD_ID is not set already (in the test's environment, say).
        extra_env={"POD_NAME": name, "POD_ID": name},
        extra_args=["--leader-elect", "--leader-elect-namespace", NS],
    ) as process:
        yield process


def test_the_standby_takes_over_within_15_s_and_applies_a_scale(
    localkube: LocalKube, tmp_path: Path
) -> None:
    plane = localkube
    log_a, log_b = tmp_path / "op-a.log", tmp_path / "op-b.log"
    create_namespace(plane, NS)
    with contextlib.ExitStack() as stack:
        # Last in, first out: the group and namespace go while an operator still runs
        # (the group's finalizer needs one), then the replicas stop; the namespace goes
        # even if the test fails before there is a group.
        stack.callback(plane.kubectl, "delete", "namespace", NS, "--wait=false", check=False)
        a = stack.enter_context(replica(plane, "op-a", log_a))
        wait_until(lambda: lease_holder(plane) == "op-a", 30, "op-a to take the Lease")
        stack.enter_context(replica(plane, "op-b", log_b))
        stack.callback(cleanup, plane)
        wait_until(
            lambda: "standing by, Lease op-ha/shoal-operator held by op-a" in log_b.read_text(),
            30,
            "op-b to stand by",
        )

        plane.kubectl("apply", "-f", "-", input_text=group(2))
        wait_until(lambda: deployment_replicas(plane) == 2, 60, "the group's Deployment")
        wait_until(lambda: RECONCILED in log_a.read_text(), 30, "op-a's reconcile")
        # One acts: the standby has not touched the group, nor run kopf at all.
        standby_log = log_b.read_text()
        assert "kopf" not in standby_log and NS + "_" + GROUP not in standby_log, standby_log
        assert lease_holder(plane) == "op-a"

        # SIGKILL the active replica (its whole process group) and scale at once.
        os.killpg(a.pid, signal.SIGKILL)
        killed = time.monotonic()
        plane.kubectl("scale", "cg", GROUP, "-n", NS, "--replicas=3")
        wait_until(lambda: lease_holder(plane) == "op-b", 20, "op-b to take the Lease")
        takeover = time.monotonic() - killed
        wait_until(lambda: deployment_replicas(plane) == 3, 30, "the scale to be applied")
        applied = time.monotonic() - killed
        print(
            f"\nLease taken over {takeover:.1f} s after SIGKILL of the active replica; "
            f"scale 2 -> 3 applied to the Deployment {applied:.1f} s after it"
        )
        assert a.poll() == -signal.SIGKILL
        assert takeover < 15, f"the standby took over only after {takeover:.1f} s"
        assert RECONCILED in log_b.read_text()


def cleanup(plane: LocalKube) -> None:
    """The group (while op-b runs, for its finalizer), the namespace, and its pods."""
    plane.kubectl("delete", "cg", "--all", "-n", NS, "--timeout=90s", check=False)
    plane.kubectl("delete", "namespace", NS, "--wait=false", check=False)
    wait_until(lambda: not namespace_pods(plane, NS), 90, "the test's pods to be gone")


# -- the Lease I/O against the real API server, with short timings ------------------------

RACE_NS = "op-ha-lease"


def elector(api: Any, name: str, identity: str) -> LeaseElector:
    return LeaseElector(
        api,
        RACE_NS,
        name,
        identity,
        duration=2,
        renew_interval=0.2,
        renew_deadline=1.5,
        retry_interval=0.2,
    )


def test_one_of_two_racing_standbys_wins_and_a_robbed_or_hung_holder_gives_up(
    localkube: LocalKube,
) -> None:
    plane = localkube
    create_namespace(plane, RACE_NS)
    api = config.new_client_from_config(config_file=str(plane.kubeconfig_path))
    try:
        a, b, c = (elector(api, "race", who) for who in ("op-a", "op-b", "op-c"))
        assert a.try_acquire()
        # b and c see op-a's Lease and may not take it while it is fresh.
        assert not b.try_acquire() and not c.try_acquire()
        # op-a never renews (as if killed right after taking it); once b and c have seen
        # the same version for the lease's duration, both read it and both may take it...
        eventually(
            lambda: (
                b.observation is not None
                and may_take(b.observation, "op-b", time.monotonic())
                and c.observation is not None
                and may_take(c.observation, "op-c", time.monotonic())
            ),
            10,
            "op-a's Lease to expire for b and c",
        )
        read_b, read_c = b._read(), c._read()
        assert read_b is not None and read_c is not None
        assert read_b["metadata"]["resourceVersion"] == read_c["metadata"]["resourceVersion"]
        # ...but the API server accepts only the first write of that version.
        assert b.take(read_b)
        assert not c.take(read_c)
        assert lease_holder(plane, RACE_NS, "race") == "op-b"
        assert (b.held or {})["spec"]["leaseTransitions"] == 1

        # op-b renews; someone else writing itself in (here c, ignoring the rules) makes
        # op-b give up at its next renewal.
        robbed: queue.Queue[str] = queue.Queue()
        b.keep(robbed.put)

        def steal() -> bool:
            lease = c._read()
            assert lease is not None
            lease["spec"]["holderIdentity"] = "op-c"
            c._write(lease, create=False)  # a 409 if op-b renewed since the read: again
            return True

        eventually(steal, 5, "c to write itself in", retry_on=(ApiException,))
        assert "held by op-c" in robbed.get(timeout=5)

        # A holder whose renewals hang (its API server's address accepts connections and
        # never answers: a socket that listens and never accepts) gives up once
        # renew_deadline has passed since its last successful write, although each hung
        # request would only time out later (request_timeout 2 s > renew_deadline 1.5 s):
        # the watchdog, not the renewal, decides.
        d = elector(api, "deadline", "op-d")
        assert d.try_acquire()
        acquired = d.last_renewed
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(16)
            unreachable = copy.deepcopy(api.configuration)
            unreachable.host = f"https://127.0.0.1:{silent.getsockname()[1]}"
            d.leases = k8s.CoordinationV1Api(k8s.ApiClient(unreachable))
            gave_up: queue.Queue[str] = queue.Queue()
            d.keep(gave_up.put)
            assert "no renewal" in gave_up.get(timeout=10)
            after = time.monotonic() - acquired
        print(f"\na holder with hanging renewals gave up {after:.2f} s after its last write")
        assert 1.5 <= after < 2.0
    finally:
        plane.kubectl("delete", "namespace", RACE_NS, "--wait=false", check=False)
