"""Several groups under one operator at once (issue 29's "Groups", small enough for CI;
bench/groups.py runs 50).

The other operator suites each run one group at a time. Here five groups are applied in
one `kubectl apply`, so the operator reconciles and observes them concurrently, sharing
its NATS and etcd connections (the memo) while each keeps its own per-group state: each
must become Ready with its own member as leader and its own durables, and deleting four
of them at once must clear exactly their etcd keys and pods while the fifth stays Ready
with its keys intact.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from harness.kubetest import (
    apiserver_requests,
    get_json,
    group_ready,
    operator_watching,
    wait_until,
)
from harness.localkube.plane import LocalKube
from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys, default_stream_name

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NS = "op-groups"
GROUPS = [f"grp-{i}" for i in range(5)]
PARTITIONS = 16


@pytest.fixture(scope="module")
def operator(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("operator-groups") / "operator.log"
    with operator_watching(localkube, [NS], log_path) as path:
        yield path


def group_list() -> str:
    """One List of every group: a single apply hands them to the operator together."""
    items = [
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "handler": "shoal.consumer.handlers:noop",
                "partitions": PARTITIONS,
                "replicas": 1,
            },
        }
        for name in GROUPS
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def test_five_groups_become_ready_together_and_delete_apart(
    localkube: LocalKube, operator: Path
) -> None:
    plane = localkube
    plane.kubectl("apply", "-f", "-", input_text=group_list())
    for name in GROUPS:
        cg = wait_until(functools.partial(group_ready, plane, NS, name), 120, f"{name} Ready")
        status = cg["status"]
        # Each group's status is its own: its member leads it and holds every partition.
        assert status["leader"].startswith(f"{name}-consumer-"), status
        assert status["members"] == 1 and status["partitionsPerMember"]["max"] == PARTITIONS
    assert asyncio.run(_durables(plane.state.nats_url)) == {n: PARTITIONS for n in GROUPS}
    # The status timer runs every 5 s per group; the Deployments' counts come from a
    # watch (operator/deployments.py), not a GET each time (15 GETs in these 15 s).
    before = apiserver_requests(plane)
    time.sleep(15)
    after = apiserver_requests(plane)
    gets = {
        key: after[key] - before.get(key, 0.0) for key in after if key.startswith("GET deployments")
    }
    assert not any(gets.values()), gets

    survivor, doomed = GROUPS[-1], GROUPS[:-1]
    plane.kubectl("delete", "cg", *doomed, "-n", NS, "--timeout=120s")

    def doomed_pods() -> list[str]:
        pods = get_json(plane, "pods", "-n", NS)["items"]
        names = [p["metadata"]["name"] for p in pods]
        return [n for n in names if not n.startswith(f"{survivor}-consumer-")]

    wait_until(lambda: not doomed_pods(), 90, "the deleted groups' pods to go")
    keys = asyncio.run(_etcd_key_counts(plane.state.etcd_endpoint))
    assert all(keys[n] == 0 for n in doomed), keys
    assert keys[survivor] > 0, keys
    assert group_ready(plane, NS, survivor), "deleting the others disturbed the survivor"


async def _durables(url: str) -> dict[str, int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        counts = {}
        for name in GROUPS:
            info = await js.stream_info(default_stream_name(NS, name))
            counts[name] = int(info.state.consumer_count)
        return counts
    finally:
        await nc.close()


async def _etcd_key_counts(endpoint: str) -> dict[str, int]:
    etcd = Etcd(endpoint)
    await etcd.connect(attempts=5)
    try:
        counts = {}
        for name in GROUPS:
            _, kvs = await etcd.get_prefix(Keys(NS, name).prefix)
            counts[name] = len(kvs)
        return counts
    finally:
        etcd.close()
