"""What the operator made and someone removed comes back (real kube-apiserver and kubectl,
a real operator process, the plane's nats-server and etcd, member pods on the process
kubelet).

The reconcile handlers run on changes of the ConsumerGroup only; a JetStream stream
deleted (`nats stream rm`, or lost with a `storage: memory` server's restart) or a
Deployment deleted by hand changes nothing the handlers see. The status timer notices
and puts them back.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import NotFoundError

from harness.kubetest import condition, create_namespace, get_json, operator_process, wait_until
from harness.localkube.plane import LocalKube
from harness.waiting import eventually_async
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, default_stream_name, dlq_stream_name

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

NS = "op-drift"
PARTITIONS = 4


@pytest.fixture(scope="module")
def operator(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("operator-drift") / "operator.log"
    with operator_process(localkube, (NS,), log_path):
        create_namespace(localkube, NS)
        yield log_path


def manifest(name: str, replicas: int = 1) -> str:
    return json.dumps(
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "handler": "shoal.consumer.handlers:noop",
                "replicas": replicas,
                "partitions": PARTITIONS,
                "maxReplicas": PARTITIONS,
                "deletionPolicy": "Delete",
                "nats": {"stream": {"storage": "memory"}},
            },
        }
    )


def ready(plane: LocalKube, name: str) -> dict[str, Any]:
    cg = get_json(plane, "cg", name, "-n", NS)
    return cg if condition(cg, "Ready").get("status") == "True" else {}


def warnings(plane: LocalKube, name: str, reason: str) -> list[dict[str, Any]]:
    found = get_json(plane, "events", "-n", NS, "--field-selector", f"reason={reason}")["items"]
    return [e for e in found if e["involvedObject"]["name"] == name and e["type"] == "Warning"]


async def _stream_names(plane: LocalKube, prefix: str) -> set[str]:
    nc = await nats.connect(plane.state.nats_url)
    try:
        return {
            str(s.config.name)
            for s in await nc.jetstream().streams_info()
            if str(s.config.name).startswith(prefix)
        }
    finally:
        await nc.close()


async def _delete_streams(plane: LocalKube, streams: list[str]) -> None:
    """What `nats stream rm` does."""
    nc = await nats.connect(plane.state.nats_url)
    try:
        for stream in streams:
            await nc.jetstream().delete_stream(stream)
    finally:
        await nc.close()


async def _durables(plane: LocalKube, stream: str) -> int:
    nc = await nats.connect(plane.state.nats_url)
    try:
        return len(await nc.jetstream().consumers_info(stream))
    except NotFoundError:
        return 0
    finally:
        await nc.close()


async def _consumed_after(plane: LocalKube, stream: str, subject_prefix: str) -> None:
    """Messages published to the recreated stream are consumed: the work-queue stream
    drains (a group whose stream or durables are missing would leave them there)."""
    nc = await nats.connect(plane.state.nats_url)
    try:
        js = nc.jetstream()
        items = [Outgoing(f"project-{i}", b"x", f"after-{i}", {SEQ_HEADER: "0"}) for i in range(40)]
        await Producer(js, subject_prefix, PARTITIONS).publish_many(items)

        async def left() -> int:
            return int((await js.stream_info(stream)).state.messages)

        await eventually_async(left, 90, f"{stream} to drain", until=lambda n: n == 0)
    finally:
        await nc.close()


def test_a_deleted_stream_is_recreated_and_consumed_again(
    localkube: LocalKube, operator: Path
) -> None:
    plane, name = localkube, "lost-stream"
    stream = default_stream_name(NS, name)
    plane.kubectl("apply", "-f", "-", input_text=manifest(name))
    try:
        wait_until(lambda: ready(plane, name), 120, "the group to become Ready")
        before = asyncio.run(_stream_names(plane, stream))
        assert {stream, dlq_stream_name(stream)} <= before, before

        # The partition stream and the dead-letter stream, as `nats stream rm` would.
        asyncio.run(_delete_streams(plane, [stream, dlq_stream_name(stream)]))
        deleted = time.monotonic()
        wait_until(
            lambda: asyncio.run(_stream_names(plane, stream)) == before,
            60,
            "the operator to recreate the deleted streams",
            interval=1,
        )
        recreated_after = time.monotonic() - deleted
        wait_until(
            lambda: asyncio.run(_durables(plane, stream)) == PARTITIONS,
            30,
            "the durables on the recreated stream",
            interval=1,
        )
        (event,) = wait_until(
            lambda: warnings(plane, name, "StreamRecreated"), 30, "a StreamRecreated Warning"
        )
        assert stream in event["message"] and "gone" in event["message"], event
        asyncio.run(_consumed_after(plane, stream, f"shoal.{NS}.{name}"))
        # Healthy again, and nothing left over in status from the missing stream.
        cg = wait_until(lambda: ready(plane, name), 60, "the group to be Ready again")
        degraded = condition(cg, "Degraded")
        assert degraded.get("status") == "False", degraded
        print(f"streams recreated {recreated_after:.1f} s after their deletion")
    finally:
        plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s", check=False)


def test_a_deleted_deployment_is_applied_again(localkube: LocalKube, operator: Path) -> None:
    plane, name = localkube, "lost-deploy"
    deployment = f"{name}-consumer"
    plane.kubectl("apply", "-f", "-", input_text=manifest(name))
    try:
        cg = wait_until(lambda: ready(plane, name), 120, "the group to become Ready")
        uid = cg["metadata"]["uid"]
        old_uid = get_json(plane, "deployment", deployment, "-n", NS)["metadata"]["uid"]

        plane.kubectl("delete", "deployment", deployment, "-n", NS, "--wait=true")
        deleted = time.monotonic()

        def applied_again() -> dict[str, Any]:
            found = plane.kubectl(
                "get", "deployment", deployment, "-n", NS, "-o", "json", check=False
            )
            if found.returncode != 0:
                return {}
            dep: dict[str, Any] = json.loads(found.stdout)
            return dep if dep["metadata"]["uid"] != old_uid else {}

        dep = wait_until(applied_again, 60, "the Deployment to be applied again", interval=1)
        reapplied_after = time.monotonic() - deleted
        # Adopted again, so deleting the group still deletes it.
        assert [o["uid"] for o in dep["metadata"]["ownerReferences"]] == [uid]
        (event,) = wait_until(
            lambda: warnings(plane, name, "DeploymentRecreated"),
            30,
            "a DeploymentRecreated Warning",
        )
        assert deployment in event["message"], event
        wait_until(lambda: ready(plane, name), 120, "the group to be Ready again")
        print(f"Deployment applied again {reapplied_after:.1f} s after its deletion")
    finally:
        plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s", check=False)


def test_deleted_rbac_and_pdb_are_applied_again(localkube: LocalKube, operator: Path) -> None:
    """Before, only a deleted Deployment was noticed: a Role deleted by hand left the
    leader's autoscaler refused on every call, a PDB deleted left drains free to evict
    every member at once, and nothing said so."""
    plane, name = localkube, "lost-rbac"
    child = f"{name}-consumer"
    kinds = {
        "role": "Role",
        "rolebinding": "RoleBinding",
        "serviceaccount": "ServiceAccount",
        "poddisruptionbudget": "PodDisruptionBudget",
    }
    plane.kubectl("apply", "-f", "-", input_text=manifest(name))
    try:
        cg = wait_until(lambda: ready(plane, name), 120, "the group to become Ready")
        uid = cg["metadata"]["uid"]
        old = {kind: get_json(plane, kind, child, "-n", NS)["metadata"]["uid"] for kind in kinds}
        for kind in kinds:
            plane.kubectl("delete", kind, child, "-n", NS, "--wait=true")
        deleted = time.monotonic()

        def applied_again() -> dict[str, Any]:
            found: dict[str, Any] = {}
            for kind in kinds:
                got = plane.kubectl("get", kind, child, "-n", NS, "-o", "json", check=False)
                if got.returncode != 0:
                    return {}
                obj = json.loads(got.stdout)
                if obj["metadata"]["uid"] == old[kind]:
                    return {}
                found[kind] = obj
            return found

        objs = wait_until(applied_again, 60, "the four to be applied again", interval=1)
        reapplied_after = time.monotonic() - deleted
        for obj in objs.values():
            assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [uid], obj
        for kind in kinds.values():
            reason = f"{kind}Recreated"
            (event,) = wait_until(
                functools.partial(warnings, plane, name, reason), 30, f"a {reason} Warning"
            )
            assert child in event["message"], event
        assert not warnings(plane, name, "DeploymentRecreated")
        print(f"RBAC and PDB applied again {reapplied_after:.1f} s after their deletion")
    finally:
        plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s", check=False)


def _patch(plane: LocalKube, name: str, spec: dict[str, Any]) -> None:
    plane.kubectl("patch", "cg", name, "-n", NS, "--type=merge", "-p", json.dumps({"spec": spec}))


def _degraded(plane: LocalKube, name: str) -> dict[str, Any]:
    cg = get_json(plane, "cg", name, "-n", NS)
    found = condition(cg, "Degraded")
    return cg if found.get("status") == "True" else {}


def test_a_spec_the_api_server_will_not_apply_is_degraded_and_not_observed(
    localkube: LocalKube, operator: Path
) -> None:
    """The CRD takes any `env` list, but a Deployment with two entries of one name is
    refused by the API server (its server-side apply answers 500, "duplicate entries").
    Before, the failure was kopf's to retry and nobody else's: Degraded stayed False and
    the status timer stamped observedGeneration with the spec never applied."""
    plane, name = localkube, "unappliable"
    plane.kubectl("apply", "-f", "-", input_text=manifest(name, replicas=0))
    try:
        wait_until(
            lambda: (
                (c := get_json(plane, "cg", name, "-n", NS))
                .get("status", {})
                .get("observedGeneration")
                == c["metadata"]["generation"]
                and condition(c, "Degraded").get("status") == "False"
            ),
            60,
            "the group to be reconciled",
        )
        _patch(plane, name, {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]})
        cg = wait_until(lambda: _degraded(plane, name), 60, "Degraded")
        degraded = condition(cg, "Degraded")
        print(f"Degraded: {degraded['reason']}: {degraded['message']}")
        assert degraded["reason"] == "ApplyFailed", degraded
        assert f"Deployment {name}-consumer not applied" in degraded["message"], degraded
        assert 'duplicate entries for key [name="A"]' in degraded["message"], degraded
        refused_generation = cg["metadata"]["generation"]
        time.sleep(12)  # two status timer runs at least: they keep both as they are
        cg = get_json(plane, "cg", name, "-n", NS)
        assert cg["metadata"]["generation"] == refused_generation
        assert cg["status"]["observedGeneration"] == refused_generation - 1, cg["status"]
        assert condition(cg, "Degraded")["reason"] == "ApplyFailed", cg["status"]
        assert warnings(plane, name, "ApplyFailed")

        # Fixed: applied, observed, no longer Degraded.
        _patch(plane, name, {"env": [{"name": "A", "value": "1"}]})
        wait_until(
            lambda: (
                (c := get_json(plane, "cg", name, "-n", NS))
                .get("status", {})
                .get("observedGeneration")
                == c["metadata"]["generation"]
                and condition(c, "Degraded").get("status") == "False"
            ),
            60,
            "the fixed spec to be applied",
        )
        env = get_json(plane, "deployment", f"{name}-consumer", "-n", NS)["spec"]["template"][
            "spec"
        ]["containers"][0]["env"]
        assert {"name": "A", "value": "1"} in env
    finally:
        plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=120s", check=False)
