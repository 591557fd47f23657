"""Leader-driven autoscaling on the local control plane, with real NATS and etcd.

A backlog of 30,000 messages over 1,000 projects arrives at a group of one member whose
handler waits 5 ms and runs at most 4 messages at once (about 800 msg/s a member, so the
backlog needs about 40 s on one member, and scaling up pays): the leader scales up through
the scale subresource, the backlog drains, and the leader scales back down, one member per
cooldown, to minReplicas. The ledger proves the planned moves lost and duplicated nothing,
and the leader never removed itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import autoscale
from harness.kubetest import create_namespace, operator_process
from harness.localkube.plane import LocalKube
from shoal.assignor import min_moves
from shoal.consumer.autoscaler import LEADER_COST

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NS = "as-test"
COOLDOWN = 15
# An I/O-bound member with its concurrency capped: at the default of 100 one member drains
# the backlog in about 3 s, before the leader's first decision (interval 2 s), and the
# scenario would prove nothing about scaling.
MAX_CONCURRENCY = 4
DELAY_MS = 5


@pytest.fixture(scope="module")
def operator(localkube: LocalKube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log_path = tmp_path_factory.mktemp("autoscaling") / "operator.log"
    with operator_process(localkube, [NS], log_path):
        create_namespace(localkube, NS)
        yield log_path


def test_backlog_scales_up_then_down_after_cooldowns(localkube: LocalKube, operator: Path) -> None:
    plane = localkube
    try:
        line = autoscale.run(
            plane,
            NS,
            autoscaling=True,
            cooldown=COOLDOWN,
            max_replicas=4,
            max_concurrency=MAX_CONCURRENCY,
            delay_ms=DELAY_MS,
        )
    finally:
        autoscale.delete(plane, NS)
    changes = line.changes()
    assert changes, f"never scaled: {line.replicas[-5:]}"
    ups = [c for c in changes if c[2] > c[1]]
    downs = [c for c in changes if c[2] < c[1]]
    assert ups and ups[0] == changes[0], f"the first change must be up: {changes}"
    assert max(to for _, _, to in changes) <= 4  # maxReplicas
    assert downs and changes[-1][2] == 1, f"must end at minReplicas: {changes}"
    assert all(b - a == -1 for _, a, b in downs), f"one member per scale-down: {downs}"
    # No two actions inside one cooldown (so no reversal in one). Changes are seen by a
    # 0.5 s poll, hence the margin.
    for (t1, _, _), (t2, _, _) in itertools.pairwise(changes):
        assert t2 - t1 >= COOLDOWN - 1.5, f"actions {t2 - t1:.1f} s apart: {changes}"
    assert line.drained_s is not None

    # The leader was never the victim: one leader throughout, and its pod is the one left.
    assert line.leaders == {line.first_leader}
    assert line.pods_at_end == [line.first_leader]
    # ... because the leader marked the pods before each scale-down (the ReplicaSet on its
    # own removes the newest pods first, which would spare an old leader only by luck).
    assert line.deletion_costs == {line.first_leader: str(LEADER_COST)}

    reasons = [e["reason"] for e in line.events]
    assert "ScaledUp" in reasons and "ScaledDown" in reasons, reasons
    scaled_up = next(e for e in line.events if e["reason"] == "ScaledUp")
    assert "lag" in scaled_up["message"] and "lag_total=" in scaled_up["message"]
    assert line.last_scale["reason"].startswith("autoscaler:"), line.last_scale
    assert (line.last_scale["from"], line.last_scale["to"]) == (2, 1)

    # The assignment log: the scale-up is one generation (the leader waited for all the
    # new members), logged as "scale", moving the minimum, with its hand-over times.
    scaled = [g for g in line.generations if g["reason"] == "scale"]
    assert scaled, [(g["generation"], g["reason"], g["members"]) for g in line.generations]
    first = scaled[0]
    assert len(first["members"]) == ups[0][2], first["members"]
    previous = next(g for g in line.generations if g["generation"] == first["generation"] - 1)
    owners = {int(p): m for p, m in previous["assignment"].items()}
    assert len(first["moved"]) == min_moves(128, first["members"], owners)
    assert set(first["handover_ms"]) == {str(m["partition"]) for m in first["moved"]}
    assert all(0 <= ms < 30_000 for ms in first["handover_ms"].values())

    assert line.audit is not None
    summary = line.audit.summary()
    assert summary["lost"] == 0, summary
    assert summary["duplicates"] == 0, summary
    assert summary["overlaps"] == 0, summary
