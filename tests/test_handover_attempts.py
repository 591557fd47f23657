"""Hand-overs use up none of a message's attempts (issue 24, defect 3).

JetStream counts every delivery, and a hand-over gives unstarted messages back with a nak:
a delivery that was no attempt. The member that gives them back notes so in etcd with the
claim's release (Keys.handbacks), and the next owner counts attempts, not deliveries.
Real nats-server, etcd and member processes; the handler counts its real runs in files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.group.config import config_env
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

HANDLER = "harness.handlers:scripted_ledger"
SETTINGS = ("handler", "partitions", "ledger", "max_deliver", "backoff")


async def test_a_message_moved_unstarted_keeps_all_its_attempts(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any, tmp_path: Path
) -> None:
    """maxDeliver 2. A message waits, unstarted, behind its project's running message
    when its member leaves; the next owner gets it on JetStream's second delivery. Its
    first real run fails: it must be retried (one attempt of two made), not
    dead-lettered. Before the fix it was dead-lettered after that single run."""
    config = make_config(handler=HANDLER, partitions=1, max_deliver=2, backoff=(0.2,))
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=1)
    env = {**config_env(config, SETTINGS), "SHOAL_TEST_STATE_DIR": str(tmp_path)}
    fleet.start("m-0", **env)
    await wait_for_status(etcd, config.namespace, config.group, 1, settled({"m-0"}), 30)
    fleet.start("m-1", **env)  # sticky: the one partition stays with m-0
    await wait_for_status(etcd, config.namespace, config.group, 1, settled({"m-0", "m-1"}), 30)
    items = [
        Outgoing("p", b"wait:1500", "p-0", {}),
        Outgoing("p", b"fail-runs:1", "p-1", {}),  # held behind p-0 when m-0 leaves
    ]
    await Producer(js, config.subject_prefix, 1).publish_many(items)

    # m-0 holds both: p-0 running, p-1 queued behind it (same project).
    async def held() -> int:
        return int((await js.consumer_info(config.stream, "p0")).num_ack_pending)

    await eventually_async(held, 10, "m-0 to hold both messages", until=lambda n: n == 2)
    fleet.term("m-0")  # leaves gracefully: p-0 finishes, p-1 is given back unstarted

    async def done() -> set[str]:
        return {r.message_id for r in await read_ledger(js, config.ledger_stream)}

    await eventually_async(done, 30, "both messages processed", until=lambda d: d == {"p-0", "p-1"})
    records = {r.message_id: r for r in await read_ledger(js, config.ledger_stream)}
    assert records["p-0"].member == "m-0"
    assert records["p-1"].member == "m-1"
    # Run twice in all (one failure, one success), on its second and third attempts'
    # deliveries: JetStream delivered it to m-1 once, and the retry was in place.
    assert len((tmp_path / "p-1.runs").read_text().splitlines()) == 2
    letters = int((await js.stream_info(config.dlq_stream)).state.messages)
    assert letters == 0, fleet.members["m-1"].log_text()[-3000:]
    assert records["p-1"].delivery_count == 2  # its second attempt, not its third delivery
    leaver = fleet.members["m-0"].log_text()
    assert "Released" in leaver or "released" in leaver.lower()


async def test_a_hand_over_record_is_not_passed_on_once_its_messages_ran(
    make_fleet: Callable[..., Fleet], etcd: Etcd, js: Any, make_config: Any
) -> None:
    """m-0 hands its partition to m-1 in order, giving back what it had not run (record
    R1); m-1 runs and acks all of it, then crashes: its claim goes with its lease, R1
    stays (its credits would still count for messages given back and not yet run). Then
    m-2, which took over, hands over in order to m-3. Before, m-2 loaded R1's credits,
    waited for those sequences at its start, and wrote them all into its own record R2
    for m-3, and so on at every crash: records that grew, for messages acked long ago."""
    import json

    config = make_config(handler=HANDLER, partitions=1, ack_wait=3.0)
    await ensure_group(js, config)
    fleet = make_fleet(handler=HANDLER, partitions=1)
    env = config_env(config, ("handler", "partitions", "ledger", "ack_wait"))

    async def owner(member: str, members: set[str]) -> None:
        await wait_for_status(
            etcd,
            config.namespace,
            config.group,
            1,
            lambda s: s.claims.get(0) == member and set(s.members) == members,
            30,
        )

    async def record() -> set[int]:
        _, kvs = await etcd.get_prefix(config.keys.handback(0))
        kv = kvs.get(config.keys.handback(0))
        return {int(seq) for seq in json.loads(kv.value)} if kv is not None else set()

    fleet.start("m-0", **env)
    await owner("m-0", {"m-0"})
    fleet.start("m-1", **env)  # sticky: the partition stays with m-0
    await owner("m-0", {"m-0", "m-1"})
    items = [Outgoing("p", b"wait:200", f"p-{i}", {}) for i in range(20)]
    await Producer(js, config.subject_prefix, 1).publish_many(items)

    async def done() -> int:
        return len({r.message_id for r in await read_ledger(js, config.ledger_stream)})

    await eventually_async(done, 20, "m-0 to start", until=lambda n: n >= 2)
    fleet.term("m-0")  # in order: what it has not run goes back, noted in R1
    await owner("m-1", {"m-1"})
    await eventually_async(done, 30, "every message run", until=lambda n: n == 20)
    r1 = await record()
    assert r1, "m-0 gave nothing back: the test needs a record"
    fleet.start("m-2", **env)
    await owner("m-1", {"m-1", "m-2"})
    fleet.kill("m-1")  # R1 stays
    await owner("m-2", {"m-2"})
    fleet.start("m-3", **env)
    await owner("m-2", {"m-2", "m-3"})
    fleet.term("m-2")  # in order, holding nothing: R2 lists nothing
    await owner("m-3", {"m-3"})
    assert not (await record() & r1), fleet.members["m-2"].log_text()[-2000:]
