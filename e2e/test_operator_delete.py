"""Deleting a ConsumerGroup while its etcd (or, with deletionPolicy Delete, its NATS) is
unreachable: bounded, reported, and decided by deletionPolicy (real kube-apiserver, a real
operator process, a real etcd or nats-server stopped).

The groups use an etcd and a nats-server of this test's own (spec.etcd.endpoints,
spec.nats.url), so stopping them touches no other suite; the operator retries etcd for
SHOAL_DELETE_ETCD_TIMEOUT and the streams for SHOAL_DELETE_NATS_TIMEOUT (8 s each here).
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

from harness.faults import QuotaEtcdServer
from harness.kubetest import condition, create_namespace, get_json, operator_process, wait_until
from harness.localkube.plane import LocalKube
from harness.servers import EtcdServer, NatsServer
from shoal.clients.etcd import Etcd, EtcdNoSpace
from shoal.contracts.names import FINALIZER, Keys

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NS = "op-delete"
TIMEOUT = 8


@pytest.fixture(scope="module")
def group_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("group-etcd"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def operator(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("operator-delete") / "operator.log"
    env = {"SHOAL_DELETE_ETCD_TIMEOUT": str(TIMEOUT), "SHOAL_DELETE_NATS_TIMEOUT": str(TIMEOUT)}
    with operator_process(localkube, (NS,), log_path, extra_env=env):
        create_namespace(localkube, NS)
        yield log_path


def manifest(
    name: str, etcd: EtcdServer | None, policy: str, nats: NatsServer | None = None
) -> str:
    """A group without pods (only the finalizer's work is under test), on the given etcd
    and NATS (None: the plane's)."""
    spec: dict[str, Any] = {
        "handler": "shoal.consumer.handlers:ledger",
        "replicas": 0,
        "deletionPolicy": policy,
    }
    if etcd is not None:
        spec["etcd"] = {"endpoints": etcd.endpoint}
    if nats is not None:
        spec["nats"] = {"url": nats.url}
    return json.dumps(
        {
            "apiVersion": "shoal.dev/v1alpha1",
            "kind": "ConsumerGroup",
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }
    )


async def _put(etcd: EtcdServer, key: str) -> None:
    client = Etcd(etcd.endpoint)
    try:
        await client.connect(attempts=10)
        await client.put(key, b"x")
    finally:
        client.close()


async def _keys(etcd: EtcdServer, prefix: str) -> list[str]:
    client = Etcd(etcd.endpoint)
    try:
        await client.connect(attempts=10)
        _, kvs = await client.get_prefix(prefix)
        return sorted(kvs)
    finally:
        client.close()


def events(plane: LocalKube, name: str) -> list[dict[str, Any]]:
    found = get_json(plane, "events", "-n", NS, "--field-selector", f"involvedObject.name={name}")[
        "items"
    ]
    return [e for e in found if e.get("type") == "Warning"]


def has_finalizer(plane: LocalKube, name: str) -> bool:
    return FINALIZER in get_json(plane, "cg", name, "-n", NS)["metadata"].get("finalizers", [])


def degraded_for(plane: LocalKube, name: str, reason: str) -> dict[str, Any]:
    """The Degraded condition if it is True for `reason`, else {}."""
    found = condition(get_json(plane, "cg", name, "-n", NS), "Degraded")
    return found if found.get("status") == "True" and found.get("reason") == reason else {}


def gone(plane: LocalKube, name: str) -> bool:
    return plane.kubectl("get", "cg", name, "-n", NS, check=False).returncode != 0


def test_deletion_with_etcd_down_is_bounded_and_follows_the_deletion_policy(
    localkube: LocalKube, operator: Path, group_etcd: EtcdServer
) -> None:
    plane = localkube
    for name, policy in (("keep", "Retain"), ("purge", "Delete")):
        plane.kubectl("apply", "-f", "-", input_text=manifest(name, group_etcd, policy))
        wait_until(functools.partial(has_finalizer, plane, name), 60, f"{name}'s finalizer")
        asyncio.run(_put(group_etcd, Keys(NS, name).member("m-0")))

    group_etcd.stop()
    try:
        started = time.monotonic()
        for name in ("keep", "purge"):
            plane.kubectl("delete", "cg", name, "-n", NS, "--wait=false")

        # Both report it while the operator retries: status and one Warning Event each.
        for name in ("keep", "purge"):
            degraded = wait_until(
                functools.partial(degraded_for, plane, name, "EtcdUnreachable"),
                TIMEOUT + 20,
                f"{name} to report the unreachable etcd",
            )
            assert "unreachable" in degraded["message"], degraded
        # Retain: after the bounded time the group goes, its keys left (and said so).
        wait_until(lambda: gone(plane, "keep"), TIMEOUT + 60, "the Retain group to go")
        keep_gone_after = time.monotonic() - started
        reasons = [e["reason"] for e in events(plane, "keep")]
        assert reasons.count("EtcdUnreachable") == 1, reasons
        assert "EtcdKeysKept" in reasons, reasons
        kept = next(e for e in events(plane, "keep") if e["reason"] == "EtcdKeysKept")
        assert Keys(NS, "keep").prefix in kept["message"], kept

        # Delete: still there, waiting for etcd, and says how to give up.
        time.sleep(3)
        assert not gone(plane, "purge")
        degraded = condition(get_json(plane, "cg", "purge", "-n", NS), "Degraded")
        assert "deletionPolicy Delete: waiting for etcd" in degraded["message"], degraded
        reasons = [e["reason"] for e in events(plane, "purge")]
        # The first failure and the decision; never one per retry.
        assert 1 <= reasons.count("EtcdUnreachable") <= 2, reasons
    finally:
        group_etcd.start()

    # etcd back: the Delete group goes and takes its keys; the Retain group's stay.
    wait_until(lambda: gone(plane, "purge"), 90, "the Delete group to go once etcd is back")
    assert asyncio.run(_keys(group_etcd, Keys(NS, "purge").prefix)) == []
    assert asyncio.run(_keys(group_etcd, Keys(NS, "keep").prefix)) == [
        Keys(NS, "keep").member("m-0")
    ]
    print(f"Retain group gone {keep_gone_after:.1f} s after the delete (timeout {TIMEOUT} s)")


async def _fill(etcd: EtcdServer, prefix: str) -> None:
    """Write junk until etcd raises its NOSPACE alarm."""
    client = Etcd(etcd.endpoint)
    try:
        await client.connect(attempts=10)
        for i in range(1000):
            try:
                await client.put(f"{prefix}{i}", b"\0" * (512 * 1024))
            except EtcdNoSpace:
                return
        raise AssertionError("etcd took 500 MB without a NOSPACE alarm")
    finally:
        client.close()


async def _free(etcd: EtcdServer, prefix: str) -> None:
    """What an etcd operator does: delete, compact, defragment, disarm."""
    client = Etcd(etcd.endpoint)
    try:
        await client.connect(attempts=10)
        await client.delete_prefix(prefix)
        revision, _ = await client.get_prefix("/")
        await client.call(client.client.compact, revision, physical=True)
        await client.call(client.client.defragment)
        # Per member: etcd3's disarm_alarm() without one (member 0) disarms nothing.
        for alarm in await client.call(lambda: list(client.client.list_alarms())):
            await client.call(client.client.disarm_alarm, alarm.member_id)
    finally:
        client.close()


def test_etcd_nospace_shows_in_status_and_events(
    localkube: LocalKube, operator: Path, tmp_path: Path
) -> None:
    plane, name = localkube, "full"
    etcd = QuotaEtcdServer(tmp_path / "quota-etcd", quota_bytes=16 * 1024 * 1024)
    try:
        etcd.start()
        plane.kubectl("apply", "-f", "-", input_text=manifest(name, etcd, "Delete"))
        wait_until(functools.partial(has_finalizer, plane, name), 60, "the finalizer")
        asyncio.run(_fill(etcd, "/junk/"))
        raised = time.monotonic()
        degraded = wait_until(
            functools.partial(degraded_for, plane, name, "EtcdNoSpace"), 30, "EtcdNoSpace"
        )
        shown_after = time.monotonic() - raised
        assert "NOSPACE alarm raised" in degraded["message"], degraded
        time.sleep(6)  # more observations: still one Event
        reasons = [e["reason"] for e in events(plane, name)]
        assert reasons.count("EtcdNoSpace") == 1, reasons

        asyncio.run(_free(etcd, "/junk/"))
        wait_until(lambda: not degraded_for(plane, name, "EtcdNoSpace"), 30, "EtcdNoSpace to clear")
        recovered = get_json(
            plane, "events", "-n", NS, "--field-selector", "reason=EtcdSpaceRecovered"
        )["items"]
        assert recovered, "no EtcdSpaceRecovered Event"
        plane.kubectl("delete", "cg", name, "-n", NS, "--timeout=60s")
        print(f"EtcdNoSpace in status {shown_after:.1f} s after the alarm")
    finally:
        etcd.stop()


async def _streams(nats_url: str) -> list[str]:
    nc = await nats.connect(nats_url)
    try:
        return sorted(str(s.config.name) for s in await nc.jetstream().streams_info())
    finally:
        await nc.close()


def test_streams_nats_cannot_delete_are_retried_then_kept_and_named(
    localkube: LocalKube, operator: Path, tmp_path: Path
) -> None:
    """deletionPolicy Delete with the group's NATS down: the finalizer retries for the
    bounded time (Degraded StreamsNotDeleted, one Warning), then lets the group go with a
    StreamsKept Warning naming the streams. Before, every delete_stream error was logged
    at debug level and the group went at once, its streams silently left behind."""
    plane, name = localkube, "unstreamed"
    server = NatsServer(tmp_path / "group-nats")
    try:
        server.start()
        plane.kubectl("apply", "-f", "-", input_text=manifest(name, None, "Delete", server))
        stream = f"shoal_{NS}_{name}"
        wait_until(lambda: stream in asyncio.run(_streams(server.url)), 60, "the group's stream")

        server.stop()
        started = time.monotonic()
        plane.kubectl("delete", "cg", name, "-n", NS, "--wait=false")
        degraded = wait_until(
            functools.partial(degraded_for, plane, name, "StreamsNotDeleted"),
            TIMEOUT + 30,
            "the group to report the streams it cannot delete",
        )
        assert stream in degraded["message"], degraded
        wait_until(lambda: gone(plane, name), TIMEOUT + 90, "the group to go at last")
        gone_after = time.monotonic() - started
        reasons = [e["reason"] for e in events(plane, name)]
        assert reasons.count("StreamsNotDeleted") == 1, reasons
        (kept,) = [e for e in events(plane, name) if e["reason"] == "StreamsKept"]
        assert stream in kept["message"] and "left in place" in kept["message"], kept

        # They are indeed still there once NATS is back (file storage).
        server.start()
        assert stream in asyncio.run(_streams(server.url))
        print(f"group gone {gone_after:.1f} s after the delete (timeout {TIMEOUT} s)")
    finally:
        server.stop()
