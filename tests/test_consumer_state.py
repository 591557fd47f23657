"""Where the partitions' durables keep their state (docs/data-path.md, "Where the server's
time went").

A durable whose state is on disk has it rewritten by nats-server up to 10 times a second
while it delivers or is acked: a new file each time, created and renamed over the old
one. With 128 busy partitions that was about half of the server's CPU, and on a host
where creating a file is slow it starved the server's ack processing until acks came
later than ack_wait (redeliveries, duplicates). A work-queue stream deletes each message
once it is acked, so the stream itself records what is done, and its durables keep their
state in memory; other retentions keep theirs on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.servers import NatsServer
from shoal.contracts.names import durable_name
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

PARTITIONS = 4


def state_dirs(nats_server: NatsServer, stream: str) -> list[str]:
    """The durables of `stream` whose state nats-server keeps in files (one folder each)."""
    obs = Path(nats_server.store_dir) / "jetstream" / "$G" / "streams" / stream / "obs"
    return sorted(p.name for p in obs.iterdir()) if obs.is_dir() else []


async def test_work_queue_durables_keep_their_state_in_memory(
    js: Any, nats_server: NatsServer, make_config: Callable[..., GroupConfig]
) -> None:
    config = make_config(partitions=PARTITIONS, retention="workqueue")
    await ensure_group(js, config)
    infos = [await js.consumer_info(config.stream, durable_name(p)) for p in range(PARTITIONS)]
    assert [bool(info.config.mem_storage) for info in infos] == [True] * PARTITIONS
    assert state_dirs(nats_server, config.stream) == []


async def test_other_retentions_keep_durable_state_on_disk(
    js: Any, nats_server: NatsServer, make_config: Callable[..., GroupConfig]
) -> None:
    # Their stream keeps acked messages: only the durable's state says what is done.
    config = make_config(partitions=PARTITIONS, retention="limits")
    await ensure_group(js, config)
    expected = sorted(durable_name(p) for p in range(PARTITIONS))
    assert state_dirs(nats_server, config.stream) == expected
