"""Claims in one etcd transaction (Etcd.create_all_returning_revision, used by
Worker._claim_all): all created, with one create revision, or none at all."""

from __future__ import annotations

import uuid

import pytest

from shoal.clients.etcd import Etcd
from shoal.consumer.worker import CLAIM_BATCH

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
