"""Claims in one etcd transaction (Etcd.create_all_returning_revision, used by
Worker._claim_all): all created, with one create revision, or none at all."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.clients.etcd import Etcd
from shoal.consumer.ownership import Ownership, Stage
from shoal.consumer.worker import CLAIM_BATCH, Worker
from shoal.contracts.names import Keys

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


async def test_all_or_nothing(etcd: Etcd) -> None:
    prefix = f"/test-claims/{uuid.uuid4().hex}/"
    lease = await etcd.grant_lease(30)
    keys = [f"{prefix}{p}" for p in range(CLAIM_BATCH)]

    revision = await etcd.create_all_returning_revision(keys, b"m-1", lease)
    assert revision is not None
    _, kvs = await etcd.get_prefix(prefix)
    assert sorted(kvs) == sorted(keys)
    assert {kv.create_revision for kv in kvs.values()} == {revision}
    assert {kv.value for kv in kvs.values()} == {b"m-1"}

    # One of them exists: nothing is created, nothing is overwritten.
    more = [keys[-1], f"{prefix}new"]
    assert await etcd.create_all_returning_revision(more, b"m-2", lease) is None
    _, after = await etcd.get_prefix(prefix)
    assert f"{prefix}new" not in after
    assert after[keys[-1]].value == b"m-1"

    # The claims live on the lease.
    await etcd.revoke_lease(lease)
    _, gone = await etcd.get_prefix(prefix)
    assert not gone


async def test_an_unexpected_error_leaves_no_partition_claiming() -> None:
    """A batch whose claims were held goes to one-by-one claims after the loop; an
    unexpected error in a later batch ended the loop before them, and the finally clause
    skipped them on purpose, so they stayed CLAIMING for good: targeted at this member,
    claimed by nobody, never tried again (the reconcile pass leaves CLAIMING alone)."""

    class HeldThenOk:
        calls = 0

        async def create_all_returning_revision(self, keys: Any, value: bytes, lease: int) -> Any:
            self.calls += 1
            return None if self.calls == 1 else 7  # the first batch: some held

    worker = Worker.__new__(Worker)
    worker.ownership = Ownership()
    worker.etcd = HeldThenOk()  # type: ignore[assignment]
    worker.config = SimpleNamespace(keys=Keys("ns", "g"), member_id="m-1")  # type: ignore[assignment]
    worker.membership = SimpleNamespace(lease_id=1)  # type: ignore[assignment]

    def start(p: int, revision: int, target_ts: Any) -> None:
        raise RuntimeError("unexpected")

    worker._start = start  # type: ignore[method-assign,assignment]
    ps = list(range(2 * CLAIM_BATCH))
    for p in ps:
        worker.ownership.move(p, Stage.CLAIMING)
    with pytest.raises(RuntimeError):
        await worker._claim_all(dict.fromkeys(ps))
    assert [p for p in ps if worker.ownership.stage(p) is Stage.CLAIMING] == []
