"""The autoscaling scenario on the local control plane (its test and its benchmark).

A ConsumerGroup with autoscaling on starts with minReplicas members; a backlog over 1,000
projects arrives at once; the leader should scale up, the backlog drain, and the leader
scale back down one member per cooldown. The scenario records what happened, from
outside: spec.replicas and the leader over time (polled), the Events, the ledger.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass, field
from typing import Any

import nats
from kubernetes import client, config

from harness.fleet import stream_json
from harness.kubetest import condition, get_json, wait_until
from harness.localkube.plane import LocalKube
from shoal.consumer.ledger import Audit, audit, read_ledger
from shoal.consumer.producer import Outgoing, Producer
from shoal.contracts.names import (
    API_GROUP,
    API_VERSION,
    PLURAL,
    SEQ_HEADER,
    default_stream_name,
    ledger_stream_name,
    log_stream_name,
)
from shoal.contracts.names import DELETION_COST_ANNOTATION as DELETION_COST

NAME = "work"


@dataclass
class Timeline:
    """What the scenario saw; times are seconds since the backlog was published."""

    replicas: list[tuple[float, int]] = field(default_factory=list)  # (t, spec.replicas)
    members: list[tuple[float, int]] = field(default_factory=list)  # (t, status.members)
    leaders: set[str] = field(default_factory=set)
    pods_at_end: list[str] = field(default_factory=list)
    deletion_costs: dict[str, str | None] = field(default_factory=dict)
    first_leader: str = ""
    published_s: float = 0.0
    drained_s: float | None = None
    peak_s: float | None = None  # first time the members reached the peak replica count
    events: list[dict[str, Any]] = field(default_factory=list)
    last_scale: dict[str, Any] = field(default_factory=dict)
    audit: Audit | None = None
    generations: list[dict[str, Any]] = field(default_factory=list)  # the assignment log

    def changes(self) -> list[tuple[float, int, int]]:
        """(t, from, to) for every change of spec.replicas."""
        out = []
        for (_, a), (t, b) in zip(self.replicas, self.replicas[1:], strict=False):
            if a != b:
                out.append((t, a, b))
        return out


def manifest(
    ns: str,
    *,
    autoscaling: bool,
    replicas: int,
    min_replicas: int = 1,
    max_replicas: int = 4,
    cooldown: int = 15,
    target_lag: int = 4000,
    delay_ms: int = 5,
    cpu_ms: float = 0,
    max_concurrency: int = 100,
) -> str:
    spec: dict[str, Any] = {
        "handler": "shoal.consumer.handlers:ledger",
        "nats": {"stream": {"ledger": True}, "consumer": {"maxConcurrency": max_concurrency}},
        "replicas": replicas,
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "autoscaling": {
            "enabled": autoscaling,
            "intervalSeconds": 2,
            "cooldownSeconds": cooldown,
            # Lag drives this scenario; the seed's project rules are proven by the
            # decision traces (tests/test_scaler.py). 1,000 projects over 60 s would
            # otherwise hold every scale-down for a minute after the drain.
            "maxProjectsPerMember": 1_000_000,
            "minProjectsPerMember": 0,
            "targetLagPerMember": target_lag,
        },
        "env": [
            {"name": "SHOAL_HANDLER_DELAY_MS", "value": str(delay_ms)},
            {"name": "SHOAL_HANDLER_CPU_MS", "value": str(cpu_ms)},
            {"name": "SHOAL_STATS_INTERVAL", "value": "1"},
        ],
    }
    return json.dumps(
        {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": "ConsumerGroup",
            "metadata": {"name": NAME, "namespace": ns},
            "spec": spec,
        }
    )


def _ready(plane: LocalKube, ns: str, members: int) -> Any:
    cg = get_json(plane, "cg", NAME, "-n", ns)
    ok = condition(cg, "Ready").get("status") == "True"
    return cg if ok and cg["status"].get("members") == members else None


async def _publish(nats_url: str, ns: str, count: int) -> list[str]:
    nc = await nats.connect(nats_url)
    try:
        items = [
            Outgoing(f"project-{i % 1000}", b"x", f"as-{i}", {SEQ_HEADER: str(i // 1000)})
            for i in range(count)
        ]
        await Producer(nc.jetstream(), f"shoal.{ns}.{NAME}", 128).publish_many(items, window=512)
        return [i.message_id or "" for i in items]
    finally:
        await nc.close()


async def _pending(nats_url: str, ns: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        return int((await nc.jetstream().stream_info(f"shoal_{ns}_{NAME}")).state.messages)
    finally:
        await nc.close()


async def _audit(nats_url: str, ns: str, ids: list[str]) -> tuple[Audit, list[dict[str, Any]]]:
    """The ledger's audit, and the leader's assignment log (one event per generation)."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        result = audit(
            await read_ledger(js, ledger_stream_name(default_stream_name(ns, NAME))), ids
        )
        return result, await stream_json(js, log_stream_name(default_stream_name(ns, NAME)))
    finally:
        await nc.close()


def run(
    plane: LocalKube,
    ns: str,
    *,
    autoscaling: bool,
    messages: int = 30_000,
    until_replicas: int = 1,
    timeout: float = 300,
    **options: Any,
) -> Timeline:
    """Apply the group, wait until Ready, publish the backlog, watch until it has drained
    and spec.replicas is back at `until_replicas` (or, without autoscaling, drained)."""
    replicas = options.pop("replicas", options.get("min_replicas", 1))
    plane.kubectl(
        "apply",
        "-f",
        "-",
        input_text=manifest(ns, autoscaling=autoscaling, replicas=replicas, **options),
    )
    cg = wait_until(lambda: _ready(plane, ns, replicas), 90, f"{NAME} Ready")
    line = Timeline(first_leader=cg["status"]["leader"])
    line.replicas.append((0.0, replicas))
    start = time.monotonic()
    # Publish beside the watching: the leader may act before the backlog is complete.
    pool = concurrent.futures.ThreadPoolExecutor(1)
    publishing = pool.submit(asyncio.run, _publish(plane.state.nats_url, ns, messages))
    peak = replicas
    # Polled through the Python client: a kubectl process every 0.5 s would take a third
    # of a core from the group being measured.
    api = client.CustomObjectsApi(config.new_client_from_config(str(plane.kubeconfig_path)))
    while time.monotonic() - start < timeout:
        t = time.monotonic() - start
        cg = api.get_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL, NAME)
        spec_replicas, status = int(cg["spec"]["replicas"]), cg.get("status", {})
        line.replicas.append((t, spec_replicas))
        line.members.append((t, int(status.get("members", 0))))
        if status.get("leader"):
            line.leaders.add(status["leader"])
        peak = max(peak, spec_replicas)
        if line.peak_s is None and peak > replicas and status.get("members") == peak:
            line.peak_s = t
        if publishing.done() and not line.published_s:
            line.published_s = t
        if (
            line.drained_s is None
            and publishing.done()
            and asyncio.run(_pending(plane.state.nats_url, ns)) == 0
        ):
            line.drained_s = t
        if line.drained_s is not None and (
            not autoscaling
            or (spec_replicas == until_replicas and status.get("members") == until_replicas)
        ):
            break
        time.sleep(0.5)
    cg = get_json(plane, "cg", NAME, "-n", ns)
    line.last_scale = dict(cg.get("status", {}).get("lastScale") or {})
    line.events = [
        e
        for e in get_json(plane, "events", "-n", ns)["items"]
        if e.get("involvedObject", {}).get("name") == NAME
    ]
    listed = get_json(plane, "pods", "-n", ns)["items"]
    pods = [p for p in listed if not p["metadata"].get("deletionTimestamp")]
    line.pods_at_end = [p["metadata"]["name"] for p in pods]
    line.deletion_costs = {
        p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(DELETION_COST)
        for p in pods
    }
    ids = publishing.result()
    pool.shutdown()
    line.audit, line.generations = asyncio.run(_audit(plane.state.nats_url, ns, ids))
    return line


def delete(plane: LocalKube, ns: str) -> None:
    plane.kubectl("delete", "cg", NAME, "-n", ns, "--timeout=120s", check=False)
    wait_until(lambda: not get_json(plane, "pods", "-n", ns)["items"], 90, "pods to go")
