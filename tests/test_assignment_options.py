"""spec.assignment reaches the leader: strategy, and the loads of a load-aware group."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from harness.fleet import Fleet, settled, wait_for_events, wait_for_status
from harness.waiting import eventually_async
from shoal.assignor import assign
from shoal.clients.etcd import Etcd
from shoal.consumer.election import loads_from_stats, max_member_load
from shoal.consumer.producer import Producer
from shoal.contracts.names import partition_for
from shoal.contracts.values import MemberStats
from shoal.group.config import GroupConfig, config_from_env
from shoal.group.jetstream import ensure_group
from shoal.group.status import read_status
from shoal.operator.builders import consumer_env
from shoal.operator.settings import OperatorSettings


def _env(spec: dict[str, object]) -> dict[str, str]:
    env = consumer_env("g", "ns", {"handler": "m:f", **spec}, OperatorSettings())
    return {v["name"]: v["value"] for v in env if "value" in v}


def test_builders_pass_the_assignment_options() -> None:
    assert _env({})["SHOAL_STRATEGY"] == "sticky"
    assert _env({})["SHOAL_LOAD_AWARE"] == "false"
    env = _env({"assignment": {"strategy": "modulo"}})
    assert config_from_env({**env, "SHOAL_MEMBER_ID": "m"}).strategy == "modulo"
    env = _env({"assignment": {"loadAware": True}})
    assert config_from_env({**env, "SHOAL_MEMBER_ID": "m"}).load_aware is True


def test_load_aware_modulo_is_refused() -> None:
    with pytest.raises(ValidationError, match="load_aware needs strategy 'sticky'"):
        GroupConfig(group="g", strategy="modulo", load_aware=True)


def test_loads_come_from_member_stats_and_garbage_is_skipped() -> None:
    stats = {
        "a": {"partition_rates": {"0": 10.0, "1": 2, "x": 5, "2": -1, "3": True, "4": "7"}},
        "b": {"partition_rates": {"0": 12.5, "5": 0.5}},  # 0 mid-hand-over: the larger
        "c": {"cpu": 3},
        "d": {"partition_rates": [1, 2]},
    }
    parsed = {m: MemberStats.parse(json.dumps(raw).encode()) for m, raw in stats.items()}
    assert loads_from_stats(parsed) == {0: 12.5, 1: 2.0, 5: 0.5}


def test_load_aware_assignment_lowers_the_busiest_member() -> None:
    members = {"a", "b", "c", "d"}
    balanced = assign(16, members)
    # Every partition of one member is hot.
    hot = next(iter(members))
    loads = {p: (100.0 if owner == hot else 1.0) for p, owner in balanced.items()}
    before = max_member_load(balanced, loads)
    after = max_member_load(assign(16, members, balanced, loads=loads), loads)
    assert before == 400.0 and after < before


@pytest.mark.e2e
async def test_a_modulo_group_assigns_and_logs_as_modulo(
    tmp_path: Path,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    config = make_config(partitions=16, strategy="modulo")
    await ensure_group(js, config)
    with Fleet.for_config(tmp_path / "members", config, {"SHOAL_STRATEGY": "modulo"}) as fleet:
        for member in ("c-0", "c-1"):
            fleet.start(member)
        await wait_for_status(etcd, namespace, group, 16, settled({"c-0", "c-1"}), 30)
        fleet.start("c-2")
        status = await wait_for_status(
            etcd, namespace, group, 16, settled({"c-0", "c-1", "c-2"}), 30
        )
    # The seed's p % n over the sorted members, exactly.
    assert status.owners == {p: ["c-0", "c-1", "c-2"][p % 3] for p in range(16)}
    events = await wait_for_events(
        js, config.log_stream, lambda es: any(len(e["members"]) == 3 for e in es), 30
    )
    assert {e["strategy"] for e in events} == {"modulo"}
    join = next(e for e in events if len(e["members"]) == 3)
    # Modulo moves far more than the minimum a balanced assignment needs (5 of 16).
    assert len(join["moved"]) > 5


@pytest.mark.e2e
async def test_a_load_aware_leader_moves_a_hot_partition_off_the_busy_member(
    tmp_path: Path,
    etcd: Etcd,
    js: Any,
    group: str,
    namespace: str,
    make_config: Callable[..., GroupConfig],
) -> None:
    config = make_config(partitions=8, load_aware=True)
    await ensure_group(js, config)
    env = {
        "SHOAL_LOAD_AWARE": "true",
        "SHOAL_LOAD_CHECK_INTERVAL": "2",
        "SHOAL_STATS_INTERVAL": "1",
        "SHOAL_HANDLER_DELAY_MS": "10",
    }
    with Fleet.for_config(tmp_path / "members", config, env) as fleet:
        fleet.start("c-0")
        fleet.start("c-1")
        before = await wait_for_status(etcd, namespace, group, 8, settled({"c-0", "c-1"}), 30)
        # Two hot partitions, both on c-0; everything else idle.
        hot = [p for p, m in sorted(before.owners.items()) if m == "c-0"][:2]
        projects = [
            next(f"k{i}" for i in range(10_000) if partition_for(f"k{i}", 8) == p) for p in hot
        ]
        producer = Producer(js, config.subject_prefix, 8)

        async def publish_and_read_owners() -> dict[int, str]:
            # Both stay hot while we wait: the leader moves what it measures.
            for n in range(20):
                await producer.publish(projects[n % 2], b"x")
            return (await read_status(etcd, namespace, group, 8)).owners

        await eventually_async(
            publish_and_read_owners,
            30,
            f"the hot partitions {hot} to be split between the members",
            until=lambda owners: owners[hot[0]] != owners[hot[1]],
        )
        events = await wait_for_events(
            js,
            config.log_stream,
            lambda es: any(_weighed(e) for e in es),
            30,
            "a rebalance for load",
        )
    weighed = [e for e in events if _weighed(e)]
    loads = {int(p): v for p, v in weighed[0]["loads"].items()}
    assert min(loads[p] for p in hot) > 0


def _weighed(event: dict[str, Any]) -> bool:
    """A rebalance the leader made for load alone."""
    return bool(event["reason"] == "rebalance" and event["loads"])
