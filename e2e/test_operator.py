"""The operator on the local control plane: a ConsumerGroup becomes a working group.

The operator runs as a local process (the Helm test runs it as a Pod) and watches only
this file's namespaces, so it can share the session's plane with other suites.
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

from harness.fleet import wait_for_events, wait_for_status
from harness.kubetest import condition, create_namespace, get_json, operator_process, wait_until
from harness.localkube.plane import LocalKube
from harness.servers import free_port
from harness.waiting import eventually_async
from shoal.assignor import min_moves, moved
from shoal.clients.etcd import Etcd
from shoal.consumer.ledger import audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    SEQ_HEADER,
    Keys,
    default_stream_name,
    ledger_stream_name,
    log_stream_name,
    partition_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent
NAMESPACES = ("op-test", "op-bad")


@pytest.fixture(scope="module")
def operator(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    with operator_process(localkube, NAMESPACES, log_path):
        for ns in NAMESPACES:
            create_namespace(localkube, ns)
        yield log_path


def example(namespace: str, replicas: int = 3, **spec: Any) -> str:
    manifest = yaml.safe_load((ROOT / "examples" / "consumergroup.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"]["replicas"] = replicas
    manifest["spec"].update(spec)
    return json.dumps(manifest)


def test_a_group_becomes_ready_scales_and_deletes(localkube: LocalKube, operator: Path) -> None:
    plane, ns = localkube, "op-test"
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=example(ns))
    cg = wait_until(
        lambda: (
            (c := get_json(plane, "cg", "orders", "-n", ns))
            and condition(c, "Ready").get("status") == "True"
            and c
        ),
        90,
        "the group to become Ready",
    )
    became_ready = time.monotonic() - started
    assert became_ready < 60, f"Ready only after {became_ready:.0f} s"
    status = cg["status"]
    assert status["leader"].startswith("orders-consumer-")
    assert status["skew"] <= 1 and status["members"] == 3 and status["readyReplicas"] == 3

    # The children, adopted by the group.
    uid = cg["metadata"]["uid"]
    for kind in ("deployment", "serviceaccount", "role", "rolebinding", "pdb"):
        child = get_json(plane, kind, "orders-consumer", "-n", ns)
        assert [o["uid"] for o in child["metadata"]["ownerReferences"]] == [uid], kind
    role = get_json(plane, "role", "orders-consumer", "-n", ns)
    scale_rules = [r for r in role["rules"] if "consumergroups/scale" in r["resources"]]
    assert scale_rules and scale_rules[0]["resourceNames"] == ["orders"]

    table = plane.kubectl("get", "cg", "-n", ns).stdout
    assert table.split("\n")[0].split() == [
        "NAME",
        "REPLICAS",
        "READY",
        "LEADER",
        "STATUS",
        "SKEW",
        "LAG",
        "AGE",
    ]
    described = plane.kubectl("describe", "cg", "orders", "-n", ns).stdout
    assert "Reconciled" in described and "Rebalanced" in described

    asyncio.run(_scale_while_producing(plane, ns))
    scaled = wait_until(
        lambda: (c := get_json(plane, "cg", "orders", "-n", ns))["status"].get("lastScale") and c,
        30,
        "status.lastScale",
    )
    assert scaled["status"]["lastScale"]["from"] == 3
    assert scaled["status"]["lastScale"]["to"] == 5
    assert "Scaled" in plane.kubectl("describe", "cg", "orders", "-n", ns).stdout

    plane.kubectl("delete", "cg", "orders", "-n", ns, "--timeout=120s")
    wait_until(lambda: not get_json(plane, "pods", "-n", ns)["items"], 90, "pods to go")
    assert (
        plane.kubectl("get", "deployment", "orders-consumer", "-n", ns, check=False).returncode != 0
    )
    asyncio.run(_stream_kept_and_etcd_cleared(plane, ns))


async def _scale_while_producing(plane: LocalKube, ns: str) -> None:
    etcd = Etcd(plane.state.etcd_endpoint)
    await etcd.connect(attempts=5)
    nc = await nats.connect(plane.state.nats_url)
    try:
        js = nc.jetstream()
        before = await wait_for_status(
            etcd, ns, "orders", 128, lambda s: len(s.members) == 3 and not s.unclaimed, 30
        )
        items = [
            Outgoing(f"project-{i % 1000}", b"x", f"op-{i}", {SEQ_HEADER: str(i // 1000)})
            for i in range(6000)
        ]
        producer = Producer(js, f"shoal.{ns}.orders", 128)
        production = asyncio.create_task(producer.publish_many(items, window=256))
        await asyncio.to_thread(plane.kubectl, "scale", "cg", "orders", "-n", ns, "--replicas=5")
        after = await wait_for_status(
            etcd,
            ns,
            "orders",
            128,
            lambda s: (
                len(s.members) == 5 and not s.unowned and s.claims == s.owners and s.skew <= 1
            ),
            90,
        )
        # Pods that register further apart than the leader's debounce give one generation
        # each; every generation must move the minimum from the one before it.
        previous = before.owners
        log_stream = log_stream_name(default_stream_name(ns, "orders"))
        events = await assignment_events(js, log_stream, before.generation, after.generation)
        for event in events:
            current = {int(p): m for p, m in event["assignment"].items()}
            assert len(moved(previous, current)) == len(event["moved"])
            assert len(event["moved"]) == min_moves(128, event["members"], previous), event
            previous = current
        assert previous == after.owners
        await production

        async def left() -> int:
            return int((await js.stream_info(f"shoal_{ns}_orders")).state.messages)

        # Fails with the number of messages left, rather than auditing an undrained group.
        await eventually_async(
            left, 90, "the group to drain its stream", until=lambda n: n == 0, interval=0.5
        )
        records = await read_ledger(js, ledger_stream_name(default_stream_name(ns, "orders")))
        result = audit(records, [i.message_id or "" for i in items])
        assert result.summary()["lost"] == 0
        assert result.summary()["duplicates"] == 0
    finally:
        await nc.close()
        etcd.close()


async def assignment_events(
    js: Any, stream: str, after_generation: int, through_generation: int, timeout: float = 40
) -> list[Any]:
    """The leader's assignment log (one JSON event per generation), in order, once it holds
    `through_generation` (an event is written when its hand-overs are done, up to 30 s)."""

    def logged(events: list[Any]) -> bool:
        return any(e["generation"] >= through_generation for e in events)

    events = await wait_for_events(js, stream, logged, timeout, f"generation {through_generation}")
    return [e for e in events if after_generation < e["generation"] <= through_generation]


async def _stream_kept_and_etcd_cleared(plane: LocalKube, ns: str) -> None:
    etcd = Etcd(plane.state.etcd_endpoint)
    await etcd.connect(attempts=5)
    nc = await nats.connect(plane.state.nats_url)
    try:
        info = await nc.jetstream().stream_info(f"shoal_{ns}_orders")
        assert info.config.name == f"shoal_{ns}_orders"  # deletionPolicy Retain
        _, kvs = await etcd.get_prefix(Keys(ns, "orders").prefix)
        assert kvs == {}
    finally:
        await nc.close()
        etcd.close()


def test_an_unknown_handler_degrades_with_a_warning(localkube: LocalKube, operator: Path) -> None:
    plane, ns = localkube, "op-bad"
    plane.kubectl("apply", "-f", "-", input_text=example(ns, 1, handler="no_such_module:handle"))
    degraded = wait_until(
        lambda: condition(get_json(plane, "cg", "orders", "-n", ns), "Degraded"),
        60,
        "a Degraded condition",
    )
    assert degraded["status"] == "True" and degraded["reason"] == "HandlerInvalid"
    assert "no_such_module" in degraded["message"]
    events = plane.kubectl(
        "get", "events", "-n", ns, "--field-selector", "reason=HandlerInvalid"
    ).stdout
    assert "Warning" in events and "no_such_module" in events
    # One Event per failed try, ours (with the reason): kopf's own for the handler's
    # failure ("Handler 'reconcile' failed temporarily: <the same message>", type Error,
    # reason Logging) used to follow each one. kopf posts in the order it was asked to,
    # so a second or two after ours is plenty to have seen it.
    time.sleep(3)
    logged = plane.kubectl(
        "get", "events", "-n", ns, "--field-selector", "reason=Logging", "-o", "json"
    ).stdout
    repeated = [
        e["message"]
        for e in json.loads(logged)["items"]
        if "failed" in e["message"] and "no_such_module" in e["message"]
    ]
    assert repeated == []
    # Nothing was created for a group that cannot work.
    assert (
        plane.kubectl("get", "deployment", "orders-consumer", "-n", ns, check=False).returncode != 0
    )
    plane.kubectl("delete", "cg", "orders", "-n", ns, "--timeout=60s")


def test_a_spec_change_undone_while_it_is_refused_clears_degraded(
    localkube: LocalKube, operator: Path
) -> None:
    """A change the operator refuses (a handler no pod could import) is retried by kopf
    after a delay; undone before that, kopf sees the spec it last handled and calls no
    handler (its pending retry is dropped), so nothing cleared the refusal: the group
    stayed Degraded (HandlerInvalid) and not Ready until the next change or an operator
    restart. The status timer now runs the reconcile again for a spec that is no longer
    the one refused."""
    plane, ns = localkube, "op-bad"
    manifest = json.loads(example(ns, 1))
    manifest["metadata"]["name"] = "undone"
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))
    ready = "the group to be Ready"
    wait_until(
        lambda: (
            condition(get_json(plane, "cg", "undone", "-n", ns), "Ready").get("status") == "True"
        ),
        90,
        ready,
    )
    good = manifest["spec"]["handler"]
    patch = json.dumps({"spec": {"handler": "no_such_module:handle"}})
    plane.kubectl("patch", "cg", "undone", "-n", ns, "--type", "merge", "-p", patch)
    degraded = wait_until(lambda: _degraded_reason(plane, ns, "undone"), 60, "Degraded")
    assert degraded["reason"] == "HandlerInvalid", degraded
    # `kubectl get cg` says it in its Status column: the pods of the spec before still
    # run, and that column used to say "Stable" beside a Degraded condition it hides.
    row = wait_until(
        lambda: (
            (r := plane.kubectl("get", "cg", "undone", "-n", ns, "--no-headers").stdout)
            and "HandlerInvalid" in r.split()
            and r
        ),
        30,
        "HandlerInvalid in the Status column",
    )
    assert "Stable" not in row.split(), row
    patch = json.dumps({"spec": {"handler": good}})
    plane.kubectl("patch", "cg", "undone", "-n", ns, "--type", "merge", "-p", patch)
    cg = wait_until(
        lambda: (
            (c := get_json(plane, "cg", "undone", "-n", ns))
            and condition(c, "Ready").get("status") == "True"
            and condition(c, "Degraded").get("status") != "True"
            and c
        ),
        60,
        "Ready again, not Degraded, once the refused change was undone",
    )
    assert cg["status"]["observedGeneration"] == cg["metadata"]["generation"]
    plane.kubectl("delete", "cg", "undone", "-n", ns, "--timeout=60s")


def _degraded_reason(plane: LocalKube, ns: str, name: str) -> dict[str, Any]:
    cg = get_json(plane, "cg", name, "-n", ns)
    found = condition(cg, "Degraded")
    return found if found.get("status") == "True" else {}


def test_unreachable_nats_degrades_and_retries(localkube: LocalKube, operator: Path) -> None:
    plane, ns = localkube, "op-bad"
    manifest = json.loads(example(ns, 1))
    manifest["metadata"]["name"] = "lost"
    manifest["spec"]["nats"] = {"url": f"nats://127.0.0.1:{free_port()}"}
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))
    degraded = wait_until(lambda: _degraded_reason(plane, ns, "lost"), 60, "Degraded")
    assert degraded["reason"] == "NatsUnavailable"
    assert "unavailable" in degraded["message"]
    events = plane.kubectl(
        "get", "events", "-n", ns, "--field-selector", "reason=NatsUnavailable"
    ).stdout
    assert "Warning" in events
    plane.kubectl("delete", "cg", "lost", "-n", ns, "--timeout=90s")


def test_stream_config_and_policies(localkube: LocalKube, operator: Path) -> None:
    plane, ns = localkube, "op-bad"
    manifest = json.loads(example(ns, 1))
    manifest["metadata"]["name"] = "streams"
    manifest["spec"]["deletionPolicy"] = "Delete"
    manifest["spec"]["nats"] = {"consumer": {"ackWaitSeconds": 7, "maxDeliver": 4}}
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))
    stream = f"shoal_{ns}_streams"

    async def durables() -> list[Any]:
        nc = await nats.connect(plane.state.nats_url)
        try:
            return list(await nc.jetstream().consumers_info(stream))
        except Exception:
            return []
        finally:
            await nc.close()

    infos = wait_until(
        lambda: (d := asyncio.run(durables())) and len(d) == 128 and d, 60, "128 durable consumers"
    )
    p7 = next(i for i in infos if i.name == "p7")
    assert p7.config.filter_subject == f"shoal.{ns}.streams.7"
    # (maxDeliver is counted by the members: the durables' own limit is off.)
    assert p7.config.ack_wait == 7 and p7.config.max_deliver == -1

    # Retention cannot change in place: Degraded, a Warning, and the stream left as it is.
    plane.kubectl(
        "patch",
        "cg",
        "streams",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"nats": {"stream": {"retention": "limits"}}}}),
    )
    degraded = wait_until(
        lambda: _degraded_reason(plane, ns, "streams"), 60, "a StreamConfigConflict"
    )
    assert degraded["reason"] == "StreamConfigConflict", degraded
    assert stream in degraded["message"]

    # deletionPolicy Delete: the streams go with the group.
    plane.kubectl("delete", "cg", "streams", "-n", ns, "--timeout=120s")

    async def stream_names() -> list[str]:
        nc = await nats.connect(plane.state.nats_url)
        try:
            return [str(s.config.name) for s in await nc.jetstream().streams_info()]
        finally:
            await nc.close()

    assert not [s for s in asyncio.run(stream_names()) if s.startswith(stream)]


def test_a_stalled_partition_is_told_by_describe_and_moved(
    localkube: LocalKube, operator: Path
) -> None:
    """Issue 24's "kubectl describe cg says it happened", with a real stall: one project's
    handler never returns on one pod (harness.handlers:scripted_ledger `hang-on:<pod>`, no
    handler timeout) and more messages than its partition holds wait behind it."""
    plane, ns, name = localkube, "op-test", "stally"
    manifest = json.loads(example(ns, 2, handler="harness.handlers:scripted_ledger"))
    manifest["metadata"]["name"] = name
    manifest["spec"].update(
        {"partitions": 4, "maxReplicas": 2, "stallAfterSeconds": 5, "deletionPolicy": "Delete"}
    )
    manifest["spec"]["nats"]["consumer"] = {"handlerTimeoutSeconds": 0}
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))
    try:
        wait_until(
            lambda: (
                condition(get_json(plane, "cg", name, "-n", ns), "Ready").get("status") == "True"
            ),
            90,
            "the group to become Ready",
        )
        victim, member = asyncio.run(_wedge_one_partition(plane, ns, name, 4))

        def told(reason: str) -> list[dict[str, Any]]:
            events = get_json(plane, "events", "-n", ns, f"--field-selector=reason={reason}")
            return [e for e in events["items"] if e["involvedObject"]["name"] == name]

        ended = wait_until(
            lambda: told("PartitionStallEnded"), 60, "the stall to start and end", interval=1
        )
        stalled = told("PartitionStalled")
        assert [(e["type"], e["message"]) for e in stalled] == [
            (
                "Warning",
                f"Partition {victim} stalled on member {member}: work waiting and no progress "
                "for 5 s or more; the leader moves it to another member",
            )
        ]
        assert [e["type"] for e in ended] == ["Normal"]
        assert ended[0]["message"].startswith(
            f"Partition {victim} no longer reported stalled by member {member}"
        )
        described = plane.kubectl("describe", "cg", name, "-n", ns).stdout
        assert "PartitionStalled" in described and "PartitionStallEnded" in described
        print("\n".join(line for line in described.splitlines() if "PartitionStall" in line))
        # Moved and consumed elsewhere: the stream drains (work queue), the status clears.
        asyncio.run(_drained(plane, f"shoal_{ns}_{name}"))
        cg = wait_until(
            lambda: (
                (c := get_json(plane, "cg", name, "-n", ns))
                and "stalledPartitions" not in c["status"]
                and c
            ),
            30,
            "status.stalledPartitions to go",
        )
        assert condition(cg, "Progressing")["reason"] != "PartitionsStalled"
    finally:
        plane.kubectl("delete", "cg", name, "-n", ns, "--timeout=120s", check=False)


async def _wedge_one_partition(
    plane: LocalKube, ns: str, name: str, partitions: int
) -> tuple[int, str]:
    """Publish 150 messages of one project whose handler hangs on the member owning its
    partition; (that partition, that member)."""
    etcd = Etcd(plane.state.etcd_endpoint)
    await etcd.connect(attempts=5)
    nc = await nats.connect(plane.state.nats_url)
    try:
        status = await wait_for_status(
            etcd,
            ns,
            name,
            partitions,
            lambda s: len(s.members) == 2 and not s.unowned and s.claims == s.owners,
            60,
        )
        victim = min(status.owners)
        member = status.owners[victim]
        project = next(
            f"wedged-{i}" for i in range(1000) if partition_for(f"wedged-{i}", partitions) == victim
        )
        items = [
            Outgoing(project, f"hang-on:{member}".encode(), f"{project}-{i}", {SEQ_HEADER: str(i)})
            for i in range(150)
        ]
        await Producer(nc.jetstream(), f"shoal.{ns}.{name}", partitions).publish_many(items)
        return victim, member
    finally:
        await nc.close()
        etcd.close()


async def _drained(plane: LocalKube, stream: str) -> None:
    nc = await nats.connect(plane.state.nats_url)
    try:

        async def left() -> int:
            return int((await nc.jetstream().stream_info(stream)).state.messages)

        await eventually_async(left, 60, f"{stream} to drain", until=lambda n: n == 0)
    finally:
        await nc.close()


def test_crash_looping_members_degrade_the_group_and_say_why(
    localkube: LocalKube, operator: Path
) -> None:
    """A member that exits at start (here a health port no consumer can serve) crash-loops:
    the group is Degraded MembersCrashLooping naming the pod, its container and last exit,
    Ready and the Status column say it, `kubectl describe cg` has one Warning; with the
    value removed the pods run and Degraded turns False, with no second Warning."""
    plane, ns, name = localkube, "op-bad", "looping"
    manifest = json.loads(example(ns, 1))
    manifest["metadata"]["name"] = name
    manifest["spec"]["env"] = [{"name": "SHOAL_HEALTH_PORT", "value": "not-a-port"}]
    started = time.monotonic()
    plane.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))

    def told(reason: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind=ConsumerGroup,involvedObject.name={name},reason={reason}"
        found = get_json(plane, "events", "-n", ns, "--field-selector", selector)["items"]
        return [e for e in found for _ in range(int(e.get("count") or 1))]

    try:
        degraded = wait_until(lambda: _degraded_reason(plane, ns, name), 45, "Degraded", 1)
        print(f"Degraded after {time.monotonic() - started:.1f} s: {degraded['message']}")
        assert degraded["reason"] == "MembersCrashLooping", degraded
        assert degraded["message"].startswith("1 of 1 member pod crash-looping: looping-consumer-")
        assert " container consumer: " in degraded["message"]
        assert "(last exit " in degraded["message"]
        # FallbackToLogsOnError: the member's last log line says why, naming the variable.
        assert "(from SHOAL_HEALTH_PORT)" in degraded["message"], degraded["message"]
        cg = get_json(plane, "cg", name, "-n", ns)
        assert condition(cg, "Ready")["reason"] == "MembersCrashLooping"
        assert condition(cg, "Ready")["message"].startswith("0 of 1 members ready; 1 of 1 ")
        row = plane.kubectl("get", "cg", name, "-n", ns).stdout.splitlines()[1].split()
        assert "MembersCrashLooping" in row, row
        wait_until(lambda: told("MembersCrashLooping"), 15, "the Warning Event", 1)
        described = plane.kubectl("describe", "cg", name, "-n", ns).stdout
        assert "MembersCrashLooping" in described and "crash-looping" in described

        # Fixed: the pod rolls, runs and becomes ready; Degraded False, nothing more posted.
        plane.kubectl(
            "patch", "cg", name, "-n", ns, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/env"}]',
        )  # fmt: skip
        wait_until(
            lambda: (
                condition(get_json(plane, "cg", name, "-n", ns), "Degraded").get("status")
                == "False"
            ),
            60,
            "Degraded False",
            1,
        )
        assert len(told("MembersCrashLooping")) == 1
    finally:
        plane.kubectl("delete", "cg", name, "-n", ns, "--timeout=90s", check=False)
