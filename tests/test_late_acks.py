"""A redelivered message the member had settled already is acked again, not handled
again (shoal.consumer.settled).

Real nats-server, etcd and a member process (harness.handlers:stamped, which notes each
run of the handler in a file; the ledger handler would publish through the slow
connection and still be running when the redelivery comes), whose NATS connection goes
through a proxy that delays every byte by 0.4 s each way, with ack_wait at 0.5 s: each
ack reaches the server 0.8 s after the delivery, after the server has redelivered the
message. That is what a member meets when
nats-server applies acks late (a work-queue stream in file storage, a member starting on
a large backlog: bench/ramp.py) or loses them with a connection. Before the ring, every
such message ran its handler again (the ledger showed each of them twice or more).
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.handlers import read_stamps
from harness.proxy import TcpProxy
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.producer import Producer
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PARTITIONS = 4
MESSAGES = 20


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        return str(page.read().decode())


def counter(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


async def test_a_redelivery_of_a_settled_message_is_acked_again_not_handled_again(
    tmp_path: Path,
    make_fleet: Callable[..., Fleet],
    make_config: Callable[..., GroupConfig],
    etcd: Etcd,
    js: Any,
    nats_url: str,
) -> None:
    config = make_config(partitions=PARTITIONS, ack_wait=0.5, ledger=False)
    stamps = tmp_path / "m-0.stamps"
    await ensure_group(js, config)
    metrics_port = free_port()
    with TcpProxy(nats_url.removeprefix("nats://"), name="nats") as proxy:
        fleet = make_fleet(
            partitions=PARTITIONS,
            handler="harness.handlers:stamped",
            ledger=False,
            env={"SHOAL_ACK_WAIT": "0.5", "SHOAL_STAMPS_FILE": str(stamps)},
        )
        fleet.start("m-0", NATS_URL=f"nats://{proxy.address}", SHOAL_METRICS_PORT=str(metrics_port))
        await wait_for_status(
            etcd, config.namespace, config.group, PARTITIONS, settled({"m-0"}), 60
        )
        proxy.delay(0.4)
        producer = Producer(js, config.subject_prefix, PARTITIONS)
        # One message at a time, each of its own project: handled as it arrives, so it is
        # settled (not still held) when its redelivery comes.
        for i in range(MESSAGES):
            await producer.publish(f"project-{i}", b"x", message_id=f"late-{i}")
            await asyncio.sleep(0.05)

        async def unsettled() -> int:
            total = 0
            for p in range(PARTITIONS):
                info = await js.consumer_info(config.stream, f"p{p}")
                total += info.num_pending + info.num_ack_pending
            return total

        await eventually_async(unsettled, 60, "every message acked", until=lambda n: n == 0)
        proxy.delay(0)
        page = await asyncio.to_thread(scrape, metrics_port)
        fleet.term("m-0")  # it writes its stamps as it exits
        assert fleet.wait_exit("m-0", 30) == 0

    assert len(read_stamps(stamps)) == MESSAGES, "handlers ran again on redeliveries"
    redelivered = 0
    for p in range(PARTITIONS):
        redelivered += (await js.consumer_info(config.stream, f"p{p}")).delivered.consumer_seq
    # The server did redeliver (else the test proved nothing), and the member said so.
    assert redelivered > MESSAGES
    assert counter(page, "shoal_redeliveries_resettled_total") >= redelivered - MESSAGES
    assert "acked again, not handled again" in fleet.logs()
