"""The process kubelet's stop order for native sidecars (harness.localkube.kubelet
.termination_prereqs), against the real kubelet's newTerminationOrdering, without a plane.
e2e/test_localkube_sidecars.py shows the order on real processes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from harness.localkube.podspec import is_sidecar, termination_prereqs


def specs(*items: str) -> list[tuple[str, Any]]:
    """Each "kind:name" as (kind, spec)."""
    out = []
    for item in items:
        kind, name = item.split(":")
        out.append((kind, SimpleNamespace(name=name)))
    return out


POD = specs("init:setup", "sidecar:a", "sidecar:b", "sidecar:c", "main:m1", "main:m2")


def test_sidecars_wait_for_the_mains_and_the_next_sidecar() -> None:
    running = {"a", "b", "c", "m1", "m2"}
    assert termination_prereqs(POD, running) == {
        "m1": [],
        "m2": [],
        "c": ["m1", "m2"],
        "b": ["m1", "m2", "c"],
        "a": ["m1", "m2", "b"],
    }


def test_only_running_containers_are_waited_for() -> None:
    # m2 has exited: nobody waits for it.
    assert termination_prereqs(POD, {"a", "b", "c", "m1"})["c"] == ["m1"]
    # b is not running: a waits only for the mains, as in the kubelet, where b's
    # channel is closed from the start (the chain is not bridged to c).
    assert termination_prereqs(POD, {"a", "c", "m1", "m2"}) == {
        "a": ["m1", "m2"],
        "c": ["m1", "m2"],
        "m1": [],
        "m2": [],
    }
    # No main running (a pod still initializing): sidecars in reverse order only.
    assert termination_prereqs(POD, {"a", "b"}) == {"a": ["b"], "b": []}


def test_regular_init_containers_and_pods_without_sidecars_wait_for_nothing() -> None:
    assert termination_prereqs(POD, {"setup", "a"}) == {"setup": [], "a": []}
    plain = specs("init:setup", "main:m1", "main:m2")
    assert termination_prereqs(plain, {"m1", "m2"}) == {"m1": [], "m2": []}


def test_a_sidecar_is_an_init_container_with_restart_policy_always() -> None:
    assert is_sidecar(SimpleNamespace(restart_policy="Always"))
    assert not is_sidecar(SimpleNamespace(restart_policy=None))
    assert not is_sidecar(SimpleNamespace(restart_policy="Never"))
    assert not is_sidecar(SimpleNamespace())
