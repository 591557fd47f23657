"""Pause and resume on real servers: member processes, nats-server and etcd, under load.

The group's `paused` key (written here as the operator and `shoal-consumer pause` write
it) stops processing within a bound, keeps every lease and claim (nothing moves), holds
through a member's restart and the leader's death, and its deletion resumes processing
at once; the ledger shows nothing lost, duplicated or reordered, and no overlap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.audit import message_ids
from harness.fleet import Fleet, settled, wait_for_status
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import SEQ_HEADER
from shoal.contracts.values import PauseRecord
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.group.pause import pause_group, read_pause, resume_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TTL = 5
ACK_WAIT = 2.0
STALL_AFTER = 5
ENV = {
    "SHOAL_LEASE_TTL": str(TTL),
    "SHOAL_KEEPALIVE_INTERVAL": "1",
    "SHOAL_ACK_WAIT": str(ACK_WAIT),
    # Paused longer than this with messages waiting: no partition may be reported stalled.
    "SHOAL_STALL_AFTER": str(STALL_AFTER),
    "SHOAL_STATS_INTERVAL": "1",
    "SHOAL_HANDLER_DELAY_MS": "2",  # handlers in flight when the pause comes
}
# The pause reaches every member through its etcd watch within milliseconds; handlers
# run 2 ms. What the bound allows for is a loaded 2-core machine.
PAUSE_BOUND = 2.0
RESUME_BOUND = 2.0


@pytest.fixture
def config(group: str, namespace: str, nats_url: str, etcd_endpoint: str) -> GroupConfig:
    return GroupConfig(
        group=group,
        namespace=namespace,
        nats_url=nats_url,
        etcd_endpoints=etcd_endpoint,
        handler="shoal.consumer.handlers:ledger",
        ledger=True,
        ack_wait=ACK_WAIT,
    )


@pytest.fixture
def fleet(tmp_path: Path, config: GroupConfig) -> Iterator[Fleet]:
    with Fleet.for_config(tmp_path / "members", config, env=ENV) as f:
        yield f


def traffic(count: int, projects: int) -> list[Outgoing]:
    return [
        Outgoing(f"project-{i % projects}", b"x", f"pz-{i}", {SEQ_HEADER: str(i // projects)})
        for i in range(count)
    ]


async def produce_until(producer: Producer, items: list[Outgoing], stop: asyncio.Event) -> int:
    """Publish the items in chunks of 10 every 10 ms (a steady flow, so that the
    latencies measure the pause, not a gap between bursts), until all are out or `stop`
    is set; how many went out."""
    sent = 0
    while sent < len(items) and not stop.is_set():
        chunk = items[sent : sent + 10]
        await producer.publish_many(chunk)
        sent += len(chunk)
        await asyncio.sleep(0.01)
    return sent


async def ledger_count(js: Any, config: GroupConfig) -> int:
    return int((await js.stream_info(config.ledger_stream)).state.messages)


async def claims_and_leases(etcd: Etcd, config: GroupConfig) -> dict[str, tuple[int, int]]:
    """Every claim and member key: (create_revision, lease)."""
    _, kvs = await etcd.get_prefix(config.keys.prefix)
    return {
        key: (kv.create_revision, kv.lease)
        for key, kv in kvs.items()
        if key.startswith((config.keys.claims, config.keys.members))
    }


async def still(js: Any, config: GroupConfig, seconds: float) -> int:
    """The ledger does not grow for `seconds`: nothing is processed. Its count."""
    before = await ledger_count(js, config)
    await asyncio.sleep(seconds)
    after = await ledger_count(js, config)
    assert after == before, f"{after - before} messages processed while paused"
    return after


async def test_pause_and_resume_under_load(
    fleet: Fleet, etcd: Etcd, js: Any, config: GroupConfig
) -> None:
    P, ns, g = config.partitions, config.namespace, config.group
    await ensure_group(js, config)
    members = {"c-0", "c-1", "c-2"}
    for member in sorted(members):
        fleet.start(member)
    before = await wait_for_status(etcd, ns, g, P, settled(members), 30)

    items = traffic(40_000, 400)
    producer = Producer(js, config.subject_prefix, P)
    stop = asyncio.Event()
    production = asyncio.create_task(produce_until(producer, items, stop))
    await asyncio.sleep(3)
    assert await ledger_count(js, config) > 0, fleet.logs()

    # -- pause ------------------------------------------------------------------------
    keys_before = await claims_and_leases(etcd, config)
    paused_at = time.time()  # (before the write: the latencies are upper bounds)
    record = PauseRecord(by="test", time=paused_at, source="test", reason="maintenance")
    assert await pause_group(etcd, config.keys, record) is None
    await asyncio.sleep(PAUSE_BOUND)
    await still(js, config, 3.0)
    # Nothing moved: the same claims (same create revisions) on the same leases.
    assert await claims_and_leases(etcd, config) == keys_before
    status = await wait_for_status(etcd, ns, g, P, lambda s: True, 5)
    assert status.owners == before.owners and status.paused == record
    # Paused longer than stallAfter with messages waiting: not a stall.
    await asyncio.sleep(max(0.0, paused_at + STALL_AFTER + 2 - time.time()))
    status = await wait_for_status(etcd, ns, g, P, lambda s: True, 5)
    assert not status.stalled, status.stalled
    for member in members:
        assert "Group paused by test" in fleet.members[member].log_text()

    # -- a member restarted while paused joins paused -----------------------------------
    fleet.term("c-1")
    assert fleet.wait_exit("c-1", 30) == 0
    fleet.start("c-1")
    await wait_for_status(etcd, ns, g, P, settled(members), 30)
    await still(js, config, 2.0)

    # -- the leader killed while paused: still paused -----------------------------------
    leader = (await wait_for_status(etcd, ns, g, P, lambda s: s.leader is not None, 5)).leader
    assert leader is not None
    fleet.kill(leader)
    survivors = members - {leader}
    await wait_for_status(
        etcd, ns, g, P, lambda s: settled(survivors)(s) and s.leader in survivors, TTL + 15
    )
    count = await still(js, config, 2.0)
    assert await read_pause(etcd, config.keys) == record

    # -- resume -------------------------------------------------------------------------
    resumed_at = time.time()
    assert await resume_group(etcd, config.keys) == record
    await eventually_async(
        lambda: ledger_count(js, config),
        RESUME_BOUND + 3,
        "processing to go on after the resume",
        until=lambda n: n > count,
        interval=0.05,
    )
    await asyncio.sleep(2)
    stop.set()
    sent = await production
    assert sent > 0
    await eventually_async(
        lambda: js.stream_info(config.stream),
        60,
        "the group to drain",
        until=lambda info: info.state.messages == 0,
        interval=0.2,
    )
    await eventually_async(
        lambda: ledger_count(js, config),
        30,
        "every message recorded",
        until=lambda n: n >= sent,
        interval=0.2,
    )
    records = await read_ledger(js, config.ledger_stream)
    result = audit(records, message_ids(items[:sent]))
    assert result.summary() == {
        "expected": sent,
        "processed": sent,
        "lost": 0,
        "duplicates": 0,
        "out_of_order": 0,
        "overlaps": 0,
    }, fleet.logs()

    last_before = max(r.finished for r in records if r.started < resumed_at)
    first_after = min(r.started for r in records if r.started >= resumed_at)
    pause_latency = last_before - paused_at
    resume_latency = first_after - resumed_at
    print(f"pause latency {1000 * pause_latency:.0f} ms")
    print(f"resume latency {1000 * resume_latency:.0f} ms")
    assert pause_latency < PAUSE_BOUND, pause_latency
    assert resume_latency < RESUME_BOUND, resume_latency


# -- the operator's side: spec.paused -> the key, with Events -------------------------------


async def test_the_operator_follows_spec_paused_with_events(
    etcd: Etcd, config: GroupConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf

    from shoal.contracts.spec import parse_spec
    from shoal.operator import reconciler

    events: list[tuple[str, str]] = []

    def info(body: Any, *, reason: str, message: str = "") -> None:
        events.append((reason, message))

    async def real_etcd(*_: Any, **__: Any) -> Etcd:
        return etcd

    monkeypatch.setattr(kopf, "info", info)
    monkeypatch.setattr(reconciler, "_etcd", real_etcd)
    memo: Any = None
    body: Any = {}

    def meta(manager: str, when: str) -> dict[str, Any]:
        entry = {"manager": manager, "time": when, "fieldsV1": {"f:spec": {"f:paused": {}}}}
        return {"managedFields": [entry]}

    paused = parse_spec({"handler": "a.b:c", "paused": True})
    running = parse_spec({"handler": "a.b:c"})
    record = await reconciler.follow_pause(
        memo, config, paused, meta("kubectl-patch", "2026-01-01T00:00:00Z"), body
    )
    assert record is not None and record.by == "kubectl-patch" and record.source == "spec.paused"
    assert await read_pause(etcd, config.keys) == record
    assert [reason for reason, _ in events] == ["Paused"]
    assert "Paused by kubectl-patch at 2026-01-01T00:00:00Z" in events[0][1]
    # Again (the status timer, another reconcile): nothing written, no second Event.
    again = await reconciler.follow_pause(
        memo, config, paused, meta("x", "2026-01-02T00:00:00Z"), body
    )
    assert again == record and len(events) == 1
    assert await reconciler.follow_pause(memo, config, paused, {}, body, record) == record
    # spec.paused: false resumes, and says who.
    resumed = await reconciler.follow_pause(
        memo, config, running, meta("kubectl-patch", "2026-01-01T00:02:00Z"), body, record
    )
    assert resumed is None and await read_pause(etcd, config.keys) is None
    assert events[-1][0] == "Resumed" and events[-1][1].startswith("Resumed by kubectl-patch")
    # Running and no key: nothing to do, no Event.
    assert await reconciler.follow_pause(memo, config, running, {}, body, None) is None
    assert await reconciler.follow_pause(memo, config, running, {}, body) is None
    assert len(events) == 2
    # A reset's pause (shoal-consumer reset recreating the durables) is the reset's to
    # remove: resumed in the middle, members would recreate durables at the old position.
    resetting = PauseRecord(by="ops@host", time=1.0, source="reset", reason="reset to x")
    assert await pause_group(etcd, config.keys, resetting) is None
    assert await reconciler.follow_pause(memo, config, running, {}, body) == resetting
    assert await reconciler.follow_pause(memo, config, running, {}, body, resetting) == resetting
    assert await read_pause(etcd, config.keys) == resetting and len(events) == 2


def test_the_cli_pauses_and_resumes(config: GroupConfig) -> None:
    from click.testing import CliRunner

    from shoal.consumer.cli import main

    args = ["--group", config.group, "--namespace", config.namespace]
    args += ["--etcd", config.etcd_endpoints]
    cli = CliRunner()
    # A group etcd knows nothing of (a misspelt name, or not started yet) is refused:
    # "Paused" there while the real group runs on was a success reported for nothing.
    refused = cli.invoke(main, ["pause", *args, "--reason", "db upgrade"])
    assert refused.exit_code == 1 and "has not one key under" in refused.output, refused.output
    assert "--force pauses it anyway" in refused.output
    assert "  paused by " not in cli.invoke(main, ["status", *args]).output
    first = cli.invoke(main, ["pause", *args, "--reason", "db upgrade", "--force"])
    assert first.exit_code == 0, first.output
    assert first.output.startswith(f"Paused group {config.namespace}/{config.group} by ")
    assert "(cli): db upgrade" in first.output and "shoal-consumer resume" in first.output
    second = cli.invoke(main, ["pause", *args])
    assert "is paused already" in second.output and "db upgrade" in second.output
    status = cli.invoke(main, ["status", *args])
    assert "  paused by " in status.output, status.output
    done = cli.invoke(main, ["resume", *args])
    assert done.exit_code == 0 and done.output.startswith("Resumed group "), done.output
    assert "not paused: nothing to do" in cli.invoke(main, ["resume", *args]).output


async def test_a_reset_lifts_only_its_own_pause(etcd: Etcd, config: GroupConfig) -> None:
    """A reset pauses the group and resumes it when it is done. Before, its end deleted
    whatever pause was in place: a group resumed and paused again by someone during
    the reset ran at its end. A pause asked for while the reset's is in place writes
    nothing (the operator must keep leaving the reset's pause alone), and says so."""
    from click.testing import CliRunner

    from shoal.consumer.cli import main
    from shoal.group.pause import RESET_SOURCE, resume_if_source

    keys = config.keys
    reset = PauseRecord(by="ops", time=time.time(), source=RESET_SOURCE, reason="reset")
    assert await pause_group(etcd, keys, reset) is None
    args = ["--group", config.group, "--namespace", config.namespace]
    args += ["--etcd", config.etcd_endpoints]
    said = await asyncio.to_thread(CliRunner().invoke, main, ["pause", *args])
    assert "is paused by a reset" in said.output and "pause it again" in said.output, said
    assert await read_pause(etcd, keys) == reset
    # Resumed and paused again by someone while the reset runs: the reset leaves it.
    assert await resume_group(etcd, keys) == reset
    mine = PauseRecord(by="me", time=time.time(), source="cli", reason="db upgrade")
    assert await pause_group(etcd, keys, mine) is None
    assert await resume_if_source(etcd, keys, RESET_SOURCE) == mine
    assert await read_pause(etcd, keys) == mine
    assert await resume_group(etcd, keys) == mine
    # Its own pause: lifted.
    assert await pause_group(etcd, keys, reset) is None
    assert await resume_if_source(etcd, keys, RESET_SOURCE) is None
    assert await read_pause(etcd, keys) is None


async def test_resume_refuses_the_pause_of_a_reset_that_runs(
    etcd: Etcd, config: GroupConfig
) -> None:
    """`resume` while a reset runs (its `resetting` key on a live lease) changes nothing
    and says why: before, it deleted the reset's pause and said the members pull again,
    while the reset was recreating durables. Once the reset is gone (died: its lease
    ended) its pause is an interrupted reset's, and `resume` lifts it."""
    from click.testing import CliRunner

    from shoal.consumer.cli import main
    from shoal.group.pause import RESET_SOURCE

    keys = config.keys
    args = ["--group", config.group, "--namespace", config.namespace]
    args += ["--etcd", config.etcd_endpoints]
    lease = await etcd.grant_lease(30)
    try:
        await etcd.put(keys.resetting, b'{"by": "ops@host", "time": 1}', lease)
        reset = PauseRecord(by="ops@host", time=time.time(), source=RESET_SOURCE, reason="r")
        assert await pause_group(etcd, keys, reset) is None
        said = await asyncio.to_thread(CliRunner().invoke, main, ["resume", *args])
        assert said.exit_code == 1, said.output
        assert "paused by a reset that is still running (" in said.output, said.output
        assert "ops@host" in said.output and "nothing changed" in said.output
        assert await read_pause(etcd, keys) == reset
    finally:
        await etcd.revoke_lease(lease)
    said = await asyncio.to_thread(CliRunner().invoke, main, ["resume", *args])
    assert said.exit_code == 0 and said.output.startswith("Resumed group "), said.output
    assert await read_pause(etcd, keys) is None


async def test_a_pause_resumed_between_create_and_read_is_written(
    etcd: Etcd, config: GroupConfig
) -> None:
    """Someone resumes the group between pause_group's refused create and its read:
    the group is not paused, so the pause is written. Before, pause_group returned the
    caller's own record as the one "in place", and `shoal-consumer pause` said "paused
    already" of a group that ran on."""
    keys = config.keys
    theirs = PauseRecord(by="them", time=1.0, source="cli", reason="")
    assert await pause_group(etcd, keys, theirs) is None

    class ResumedMeanwhile:
        """The real etcd; its first refused create is followed by a resume."""

        def __init__(self) -> None:
            self.resumed = False

        def __getattr__(self, name: str) -> Any:
            return getattr(etcd, name)

        async def create_returning_revision(self, key: str, value: bytes, lease: Any) -> Any:
            created = await etcd.create_returning_revision(key, value, lease)
            if created is None and not self.resumed:
                self.resumed = True
                assert await resume_group(etcd, keys) == theirs
            return created

    mine = PauseRecord(by="me", time=2.0, source="cli", reason="db upgrade")
    assert await pause_group(ResumedMeanwhile(), keys, mine) is None  # type: ignore[arg-type]
    assert await read_pause(etcd, keys) == mine


# -- the operator and the command line together -------------------------------------------


BODY: Any = {}  # kopf's Body, for Events nobody posts (kopf.info is recorded)


def _cli(config: GroupConfig, *argv: str) -> Any:
    from click.testing import CliRunner

    from shoal.consumer.cli import main

    args = ["--group", config.group, "--namespace", config.namespace]
    args += ["--etcd", config.etcd_endpoints]
    return CliRunner().invoke(main, [argv[0], *args, *argv[1:]])


@pytest.fixture
def operator_events(etcd: Etcd, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The operator's follow_pause on the test's etcd; its Events, recorded."""
    import kopf

    from shoal.operator import reconciler

    events: list[tuple[str, str]] = []

    def info(body: Any, *, reason: str, message: str = "") -> None:
        events.append((reason, message))

    async def real_etcd(*_: Any, **__: Any) -> Etcd:
        return etcd

    monkeypatch.setattr(kopf, "info", info)
    monkeypatch.setattr(reconciler, "_etcd", real_etcd)
    return events


def _managed(manager: str, when: str) -> dict[str, Any]:
    entry = {"manager": manager, "time": when, "fieldsV1": {"f:spec": {"f:paused": {}}}}
    return {"managedFields": [entry]}


async def test_resume_refuses_a_pause_spec_paused_made(
    etcd: Etcd, config: GroupConfig, operator_events: list[tuple[str, str]]
) -> None:
    """`resume` of a group paused through spec.paused printed "Resumed group ...: members
    pull again" and exited 0, and the operator paused the group again within seconds (a
    second Paused Event). It refuses now, changes nothing, and names the kubectl command
    that resumes it; --force lifts it anyway (a group no operator runs any more)."""
    from shoal.contracts.spec import parse_spec
    from shoal.operator import reconciler

    paused = parse_spec({"handler": "a.b:c", "paused": True})
    memo: Any = None
    managed = _managed("kubectl-patch", "2026-01-01T00:00:00Z")
    record = await reconciler.follow_pause(memo, config, paused, managed, BODY)
    assert record is not None and record.source == "spec.paused"
    said = await asyncio.to_thread(_cli, config, "resume")
    assert said.exit_code == 1, said.output
    ns, g = config.namespace, config.group
    assert f"{ns}/{g} is paused through its ConsumerGroup's spec.paused (by kubectl-patch" in (
        said.output
    ), said.output
    assert "nothing changed" in said.output and "Resumed" not in said.output
    command = f"""kubectl patch cg {g} -n {ns} --type merge -p '{{"spec":{{"paused":false}}}}'"""
    assert command in " ".join(said.output.split()), said.output
    assert await read_pause(etcd, config.keys) == record
    # The operator's next look finds its pause in place: no second Paused Event.
    assert await reconciler.follow_pause(memo, config, paused, managed, BODY) == record
    assert [reason for reason, _ in operator_events] == ["Paused"]
    forced = await asyncio.to_thread(_cli, config, "resume", "--force")
    assert forced.exit_code == 0 and forced.output.startswith("Resumed group "), forced.output
    assert await read_pause(etcd, config.keys) is None


async def test_the_operator_keeps_a_pause_the_cli_made(
    etcd: Etcd, config: GroupConfig, operator_events: list[tuple[str, str]]
) -> None:
    """`pause` on a group the operator runs (spec.paused false) printed "Paused ...",
    and the operator lifted the pause at its next look, with an Event blaming whoever
    last set spec.paused ("Resumed by kubectl-patch after 1 s (paused by root@vm ...
    (cli): test)"). spec.paused: false lifts only the pause spec.paused made: the CLI's
    stands, through spec.paused going true and false again, until `resume` lifts it."""
    from shoal.contracts.spec import parse_spec
    from shoal.operator import reconciler

    running = parse_spec({"handler": "a.b:c"})
    paused = parse_spec({"handler": "a.b:c", "paused": True})
    memo: Any = None
    managed = _managed("kubectl-patch", "2026-01-01T00:00:00Z")
    said = await asyncio.to_thread(_cli, config, "pause", "--reason", "test", "--force")
    assert said.exit_code == 0 and said.output.startswith("Paused group "), said.output
    mine = await read_pause(etcd, config.keys)
    assert mine is not None and mine.source == "cli" and mine.reason == "test"
    # The status timer (the record as it read it) and a reconcile (not read): it stays.
    assert await reconciler.follow_pause(memo, config, running, managed, BODY, mine) == mine
    assert await reconciler.follow_pause(memo, config, running, managed, BODY) == mine
    assert await read_pause(etcd, config.keys) == mine and operator_events == []
    # spec.paused true meanwhile: paused already, by the CLI (first on record stays).
    assert await reconciler.follow_pause(memo, config, paused, managed, BODY) == mine
    # ... and false again: the CLI's pause is still not the spec's to lift.
    assert await reconciler.follow_pause(memo, config, running, managed, BODY) == mine
    assert await read_pause(etcd, config.keys) == mine and operator_events == []
    done = await asyncio.to_thread(_cli, config, "resume")
    assert done.exit_code == 0 and done.output.startswith("Resumed group "), done.output
    assert await reconciler.follow_pause(memo, config, running, managed, BODY) is None
    assert operator_events == []


async def test_the_operator_lifts_only_the_pause_it_read(
    etcd: Etcd,
    config: GroupConfig,
    operator_events: list[tuple[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """spec.paused false, the spec's pause read, and in between the operator's read and
    its delete someone lifts it and pauses with `shoal-consumer pause`: the CLI's pause
    stays (before, the operator deleted whatever it found at its second read), and no
    Resumed Event names the spec's manager as having lifted it."""
    from shoal.contracts.spec import parse_spec
    from shoal.operator import reconciler

    keys = config.keys
    running = parse_spec({"handler": "a.b:c"})
    spec_pause = PauseRecord(by="kubectl-patch", time=1.0, source="spec.paused")
    assert await pause_group(etcd, keys, spec_pause) is None
    mine = PauseRecord(by="ops@host", time=2.0, source="cli", reason="db upgrade")

    class PausedMeanwhile:
        """The real etcd; after its first read of the pause key, the CLI's swap."""

        def __init__(self) -> None:
            self.swapped = False

        def __getattr__(self, name: str) -> Any:
            return getattr(etcd, name)

        async def get_prefix(self, prefix: str) -> Any:
            found = await etcd.get_prefix(prefix)
            if prefix == keys.paused and not self.swapped:
                self.swapped = True
                await etcd.delete(keys.paused)
                assert await pause_group(etcd, keys, mine) is None
            return found

    async def swapping_etcd(*_: Any, **__: Any) -> Any:
        return PausedMeanwhile()

    monkeypatch.setattr(reconciler, "_etcd", swapping_etcd)
    memo: Any = None
    managed = _managed("kubectl-patch", "2026-01-01T00:02:00Z")
    left = await reconciler.follow_pause(memo, config, running, managed, BODY)
    assert left == mine and await read_pause(etcd, keys) == mine
    assert operator_events == []
