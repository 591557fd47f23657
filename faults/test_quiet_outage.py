"""Servers gone for a minute: members wait quietly (little CPU, few log lines), then
recover by themselves.

A member whose etcd (or etcd and NATS) is down can do nothing useful: it is fenced, its
lease expires. It must not spin while it waits: in a cluster, every member pod would
otherwise burn a core exactly when the platform is already in trouble.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from harness.bench import cpu_seconds
from harness.faults import FaultGroup, log_causes
from harness.servers import EtcdServer, NatsServer

pytestmark = [pytest.mark.e2e, pytest.mark.faults, pytest.mark.timeout(240)]

OUTAGE = 60.0
# Each member's CPU while its servers are down, as a share of one core.
MAX_CPU = 0.05
# At most one line per this many seconds per cause (plus the first).
LOG_EVERY = 10.0


@pytest.mark.parametrize("down", ["etcd", "etcd+nats"])
async def test_servers_down_60s_members_wait_quietly(
    make_group: Callable[..., FaultGroup],
    etcd_server: EtcdServer,
    nats_server: NatsServer,
    down: str,
) -> None:
    """Bound: each member under 5 % CPU during the outage, at most one log line per
    10 s per cause; the group back to normal after (finish())."""
    g = make_group(name=f"{down} down {OUTAGE:.0f} s: members wait quietly", members=2, rate=50)
    await g.start()
    await asyncio.sleep(3)
    pids = {m: member.pid for m, member in g.fleet.members.items()}
    offsets = {m: len(g.log_of(m)) for m in g.member_ids}
    cpu_before = {m: cpu_seconds(pid) for m, pid in pids.items()}
    started = time.monotonic()
    etcd_server.kill()
    if down == "etcd+nats":
        nats_server.kill()
    try:
        await asyncio.sleep(OUTAGE)
    finally:
        cpu_after = {m: cpu_seconds(pid) for m, pid in pids.items()}
        outage_s = time.monotonic() - started
        if down == "etcd+nats":
            nats_server.start()
        etcd_server.start()
    back = time.monotonic()
    figures = g.figures
    figures["outage_s"] = round(outage_s, 1)
    figures["cpu_during_outage"] = {
        m: round((cpu_after[m] - cpu_before[m]) / outage_s, 4) for m in pids
    }
    causes = {m: log_causes(g.log_of(m)[offsets[m] :]) for m in g.member_ids}
    figures["log_lines_during_outage"] = {m: sum(c.values()) for m, c in causes.items()}
    figures["busiest_log_cause"] = {
        m: max(c.items(), key=lambda item: item[1], default=("", 0)) for m, c in causes.items()
    }
    # etcd kept the old keys (and restarted their leases): "settled" would hold at once.
    # Back to normal means every member renews its lease again, and the group settles.
    for m in g.member_ids:
        await g.wait_log(m, "etcd answers keep-alives again", 30, after=offsets[m])
    figures["keepalives_back_after_s"] = round(time.monotonic() - back, 2)
    await g.wait_for(g.settled(), 45, "the group to settle after the servers came back")
    figures["settled_after_back_s"] = round(time.monotonic() - back, 2)
    await asyncio.sleep(3)
    await g.finish()
    assert all(share < MAX_CPU for share in figures["cpu_during_outage"].values()), figures
    # Promptly: the members' retries back off to 5 s at most.
    assert figures["keepalives_back_after_s"] < 15, figures
    most = int(outage_s // LOG_EVERY) + 1
    noisy = {m: {k: n for k, n in c.items() if n > most} for m, c in causes.items()}
    assert not any(noisy.values()), (noisy, figures)
