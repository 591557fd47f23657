"""A release that etcd refuses with an error other than "unreachable" is retried, and the
runner never outlives it (worker.runner_done). Real etcd; the refusal is injected once
in front of it (EtcdAuthError: what a permission taken away for a moment gives).

Before the fix the error escaped runner_done: the runner task ended silently, stayed in
`runners` stopping for ever, and its claim stayed on the member's live lease, so nobody
consumed the partition again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shoal.clients.etcd import Etcd, EtcdAuthError
from shoal.consumer.metrics import Metrics
from shoal.consumer.ownership import Stage
from shoal.consumer.partition import PartitionRunner
from shoal.consumer.worker import Worker
from shoal.group.config import GroupConfig
from shoal.group.view import GroupView

pytestmark = pytest.mark.e2e


class RefusesOnce:
    """The real client, whose first release (claim deletion) is refused."""

    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd
        self.refused = 0

    async def release_claim(self, claim: str, revision: int, record: str, value: Any) -> bool:
        if not self.refused:
            self.refused += 1
            raise EtcdAuthError("etcd refused user 'shoal': etcdserver: permission denied")
        return await self._etcd.release_claim(claim, revision, record, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._etcd, name)


class Membership:
    def __init__(self, lease: int) -> None:
        self.lease_id = lease
        self.incarnation = 0

    def safe(self) -> bool:
        return True


async def test_a_refused_release_is_retried_and_the_runner_goes(etcd: Etcd, group: str) -> None:
    config = GroupConfig(group=group, namespace="test", member_id="m-0", partitions=4)
    lease = await etcd.grant_lease(30)
    key = config.keys.claim(1)
    revision = await etcd.create_returning_revision(key, b"m-0", lease)
    assert revision is not None
    view = GroupView(etcd, config.keys, config.partitions)
    view.load(*await etcd.get_prefix(config.keys.prefix))
    refusing = RefusesOnce(etcd)
    worker = Worker(
        config,
        refusing,  # type: ignore[arg-type]
        view,
        Membership(lease),  # type: ignore[arg-type]
        None,
        None,
        None,  # type: ignore[arg-type]
        Metrics(),
        nats_reachable=lambda: False,  # no flush: there is no NATS in this test
    )
    runner = PartitionRunner(worker, 1, claim_revision=revision, target_ts=None)
    assert worker.ownership.move(1, Stage.CONSUMING, runner=runner)
    runner.stop()

    await worker.runner_done(runner)

    assert refusing.refused == 1
    assert 1 not in worker.runners  # gone, not a zombie
    # Still counted as ours until the claim is gone: nothing starts it meanwhile.
    assert worker.ownership.stage(1) is Stage.RELEASING
    for _ in range(50):
        if key not in (await etcd.get_prefix(key))[1]:
            break
        await asyncio.sleep(0.1)
    assert key not in (await etcd.get_prefix(key))[1], "the claim was never released"
    for task in list(worker._tasks):
        await task
    assert worker.ownership.stage(1) is Stage.FREE
