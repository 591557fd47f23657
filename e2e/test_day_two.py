"""Day two on the local plane (issue 27): pause, resume and a rate limit, each set the
Kubernetes way, with `kubectl patch` on the ConsumerGroup, while messages wait.

One group of two member pods (the ledger handler, 8 partitions) under a real operator:

1. a first batch is consumed;
2. `kubectl patch cg ... {"spec":{"paused":true}}`: STATUS says Paused, the Paused
   condition and Event name who paused it (kubectl's field manager), and a second batch
   published while paused stays in the stream, untouched, for as long as we watch;
3. `{"spec":{"paused":false}}`: the second batch is consumed; a Resumed Event;
4. `{"spec":{"nats":{"consumer":{"maxMessagesPerSecond":40}}}}`: the members roll with
   the limit; a third batch drains at no more than 40 messages a second;
5. the ledger of all three batches audits clean: 0 lost, 0 duplicates, per-project order,
   no two members on one partition at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from harness.kubetest import condition, create_namespace, get_json, operator_process, wait_until
from harness.localkube.plane import LocalKube
from harness.waiting import eventually_async
from shoal.consumer.ledger import LedgerRecord, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER, default_stream_name, ledger_stream_name

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent
NS = "day-two"
NAME = "chores"
PARTITIONS = 8
PROJECTS = 40
BATCH = 400
LIMIT = 40  # messages a second, the whole group
STREAM = default_stream_name(NS, NAME)


@pytest.fixture(scope="module")
def operator(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    with operator_process(localkube, (NS,), log_path):
        create_namespace(localkube, NS)
        yield log_path


def manifest() -> str:
    group = yaml.safe_load((ROOT / "examples" / "consumergroup.yaml").read_text())
    group["metadata"].update({"name": NAME, "namespace": NS})
    group["spec"].update(
        {"replicas": 2, "maxReplicas": 2, "partitions": PARTITIONS, "deletionPolicy": "Delete"}
    )
    return json.dumps(group)


def batch(number: int) -> list[Outgoing]:
    """BATCH messages over PROJECTS projects; each project's Shoal-Seq counts on from the
    batch before, so the audit checks order across the three batches."""
    return [
        Outgoing(
            f"project-{i % PROJECTS}",
            b"x",
            f"{NAME}-{number}-{i}",
            {SEQ_HEADER: str(number * BATCH + i // PROJECTS)},
        )
        for i in range(BATCH)
    ]


def patch(plane: LocalKube, spec: dict[str, Any]) -> None:
    plane.kubectl("patch", "cg", NAME, "-n", NS, "--type=merge", "-p", json.dumps({"spec": spec}))


def events(plane: LocalKube, reason: str) -> list[dict[str, Any]]:
    listed = get_json(plane, "events", "-n", NS, f"--field-selector=reason={reason}")
    return [e for e in listed["items"] if e["involvedObject"]["name"] == NAME]


def status_column(plane: LocalKube) -> str:
    table = plane.kubectl("get", "cg", NAME, "-n", NS).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    return row[header.index("STATUS")]


async def publish(plane: LocalKube, items: list[Outgoing]) -> None:
    nc = await nats.connect(plane.state.nats_url)
    try:
        await Producer(nc.jetstream(), f"shoal.{NS}.{NAME}", PARTITIONS).publish_many(items)
    finally:
        await nc.close()


async def left(plane: LocalKube) -> int:
    nc = await nats.connect(plane.state.nats_url)
    try:
        return int((await nc.jetstream().stream_info(STREAM)).state.messages)
    finally:
        await nc.close()


async def drained(plane: LocalKube, timeout: float) -> None:
    async def count() -> int:
        return await left(plane)

    await eventually_async(count, timeout, f"{STREAM} to drain", until=lambda n: n == 0)


async def ledger(plane: LocalKube) -> list[LedgerRecord]:
    nc = await nats.connect(plane.state.nats_url)
    try:
        return await read_ledger(nc.jetstream(), ledger_stream_name(STREAM))
    finally:
        await nc.close()


def test_pause_resume_and_a_rate_limit_by_kubectl_patch(
    localkube: LocalKube, operator: Path
) -> None:
    plane = localkube
    plane.kubectl("apply", "-f", "-", input_text=manifest())
    try:
        wait_until(
            lambda: (
                condition(get_json(plane, "cg", NAME, "-n", NS), "Ready").get("status") == "True"
            ),
            90,
            "the group to become Ready",
        )
        batches = [batch(n) for n in range(3)]
        asyncio.run(publish(plane, batches[0]))
        asyncio.run(drained(plane, 60))

        # Pause: the members stop pulling; what is published meanwhile waits.
        t0 = time.monotonic()
        patch(plane, {"paused": True})
        paused = wait_until(
            lambda: (
                (c := get_json(plane, "cg", NAME, "-n", NS))
                and condition(c, "Paused").get("status") == "True"
                and c
            ),
            30,
            "the Paused condition",
        )
        paused_s = time.monotonic() - t0
        assert "kubectl" in condition(paused, "Paused")["message"], paused
        assert wait_until(lambda: status_column(plane) == "Paused", 30, "STATUS Paused")
        (told,) = wait_until(lambda: events(plane, "Paused"), 30, "the Paused Event")
        assert "kubectl" in told["message"], told
        asyncio.run(publish(plane, batches[1]))
        time.sleep(8)  # long enough for members that still pulled to take some
        assert asyncio.run(left(plane)) == BATCH, "a paused group consumed messages"

        # Resume: the second batch is consumed.
        t1 = time.monotonic()
        patch(plane, {"paused": False})
        asyncio.run(drained(plane, 60))
        resumed_s = time.monotonic() - t1
        assert wait_until(lambda: events(plane, "Resumed"), 30, "the Resumed Event")
        wait_until(
            lambda: (
                condition(get_json(plane, "cg", NAME, "-n", NS), "Paused").get("status") == "False"
            ),
            30,
            "the Paused condition to clear",
        )

        # A rate limit: the members roll with it (it is in their environment), then the
        # third batch drains at the limit at most.
        patch(plane, {"nats": {"consumer": {"maxMessagesPerSecond": LIMIT}}})
        wait_until(
            lambda: (
                all(
                    {"name": "SHOAL_MAX_MESSAGES_PER_SECOND", "value": str(LIMIT)}
                    in next(c for c in p["spec"]["containers"] if c["name"] == "consumer")["env"]
                    for p in get_json(plane, "pods", "-n", NS)["items"]
                    if not p["metadata"].get("deletionTimestamp")
                )
                and len(get_json(plane, "pods", "-n", NS)["items"]) == 2
            ),
            120,
            "the members to roll with the limit",
        )
        wait_until(
            lambda: (
                condition(get_json(plane, "cg", NAME, "-n", NS), "Ready").get("status") == "True"
            ),
            90,
            "the group to be Ready again",
        )
        asyncio.run(publish(plane, batches[2]))
        asyncio.run(drained(plane, 120))

        records = asyncio.run(ledger(plane))
        result = audit(records, [i.message_id or "" for b in batches for i in b])
        summary = result.summary()
        limited = [r for r in records if r.message_id.startswith(f"{NAME}-2-")]
        span = max(r.finished for r in limited) - min(r.started for r in limited)
        rate = (len(limited) - 1) / span
        print(
            f"\npaused in {paused_s:.1f} s (condition), resumed and drained {BATCH} in "
            f"{resumed_s:.1f} s; limited to {LIMIT}/s: {len(limited)} in {span:.1f} s, "
            f"{rate:.1f} msg/s; ledger {summary}"
        )
        assert summary == {
            "expected": 3 * BATCH,
            "processed": 3 * BATCH,
            "lost": 0,
            "duplicates": 0,
            "out_of_order": 0,
            "overlaps": 0,
        }
        # The limit is a ceiling (a small burst of a member's share at its start is
        # allowed); an unlimited group drains 400 messages in well under a second.
        assert rate <= LIMIT * 1.1, rate
        assert span >= BATCH / LIMIT * 0.85, span
    finally:
        plane.kubectl("delete", "cg", NAME, "-n", NS, "--timeout=120s", check=False)
