"""A fleet of real `shoal-consumer run` processes, for tests, the demo and benchmarks.

Every member is a separate OS process (so kill -9 and SIGSTOP mean what they say), logs
to its own file, and is stopped by `close()` whatever state it is in, or by the kernel if
the process that started it dies first (harness.children).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from harness.children import spawn
from harness.waiting import eventually_async
from shoal.clients.etcd import Etcd
from shoal.group.config import GroupConfig
from shoal.group.status import GroupStatus, read_status

log = logging.getLogger(__name__)


@dataclass
class Member:
    member_id: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Fleet:
    def __init__(
        self,
        workdir: Path,
        *,
        nats_url: str,
        etcd_endpoint: str,
        namespace: str,
        group: str,
        handler: str = "shoal.consumer.handlers:ledger",
        partitions: int = 128,
        ledger: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nats_url = nats_url
        self.etcd_endpoint = etcd_endpoint
        self.namespace = namespace
        self.group = group
        self.handler = handler
        self.partitions = partitions
        self.ledger = ledger
        self.env = dict(env or {})
        self.members: dict[str, Member] = {}

    @classmethod
    def for_config(
        cls, workdir: Path, config: GroupConfig, env: Mapping[str, str] | None = None
    ) -> Fleet:
        """Members of the group `config` describes (its servers, handler, partitions)."""
        return cls(
            workdir,
            nats_url=config.nats_url,
            etcd_endpoint=config.etcd_endpoints,
            namespace=config.namespace,
            group=config.group,
            handler=config.handler,
            partitions=config.partitions,
            ledger=config.ledger,
            env=env,
        )

    def start(self, member_id: str, **extra_env: str) -> Member:
        env = dict(os.environ)
        env.update(
            {
                "NATS_URL": self.nats_url,
                "ETCD_ENDPOINTS": self.etcd_endpoint,
                "SHOAL_NAMESPACE": self.namespace,
                "SHOAL_GROUP": self.group,
                "SHOAL_PARTITIONS": str(self.partitions),
                "SHOAL_HANDLER": self.handler,
                "SHOAL_LEDGER": "true" if self.ledger else "false",
                "SHOAL_MEMBER_ID": member_id,
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.env)
        env.update(extra_env)
        log_path = self.workdir / f"{member_id}.log"
        with log_path.open("ab") as out:
            process = spawn(
                [sys.executable, "-m", "shoal.consumer", "run"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        member = Member(member_id, process, log_path)
        self.members[member_id] = member
        return member

    def signal(self, member_id: str, sig: signal.Signals) -> None:
        member = self.members[member_id]
        if member.alive():
            os.kill(member.pid, sig)

    def term(self, member_id: str) -> None:
        self.signal(member_id, signal.SIGTERM)

    def kill(self, member_id: str) -> None:
        self.signal(member_id, signal.SIGKILL)
        self.members[member_id].process.wait(10)

    def wait_exit(self, member_id: str, timeout: float) -> int:
        return self.members[member_id].process.wait(timeout)

    def close(self) -> None:
        """Stop every member: SIGCONT (in case it is stopped), SIGTERM, then SIGKILL."""
        for member in self.members.values():
            if member.alive():
                for sig in (signal.SIGCONT, signal.SIGTERM):
                    try:
                        os.kill(member.pid, sig)
                    except ProcessLookupError:
                        pass
        deadline = time.monotonic() + 15
        for member in self.members.values():
            try:
                member.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def logs(self) -> str:
        return "\n".join(
            f"===== {m.member_id} =====\n{m.log_text()[-4000:]}" for m in self.members.values()
        )


async def wait_for_status(
    etcd: Etcd,
    namespace: str,
    group: str,
    partitions: int,
    predicate: Callable[[GroupStatus], bool],
    timeout: float,
    interval: float = 0.1,
) -> GroupStatus:
    """Poll the group's status until predicate holds; WaitTimeout with the last status."""
    return await eventually_async(
        lambda: read_status(etcd, namespace, group, partitions),
        timeout,
        f"group {namespace}/{group} to reach the expected state",
        until=predicate,
        interval=interval,
        describe=lambda status: repr(status.as_dict()),
    )


def settled(members: set[str]) -> Callable[[GroupStatus], bool]:
    """Exactly these members, every partition owned by one of them and claimed by its owner."""

    def check(status: GroupStatus) -> bool:
        return (
            set(status.members) == members
            and not status.unowned
            and all(owner in members for owner in status.owners.values())
            and status.claims == status.owners
            and status.skew <= 1
        )

    return check


def settled_count(count: int, members: set[str] | None = None) -> Callable[[GroupStatus], bool]:
    """`count` members (exactly `members` if given), every partition owned by one of them
    and claimed by its owner, skew <= 1: for groups whose member names the test does not
    choose (pods)."""

    def check(status: GroupStatus) -> bool:
        return (
            len(status.members) == count
            and (members is None or set(status.members) == members)
            and not status.unowned
            and status.claims == status.owners
            and status.skew <= 1
            and set(status.owners.values()) <= set(status.members)
        )

    return check


async def wait_for_events(
    js: Any,
    stream: str,
    done: Callable[[list[dict[str, Any]]], bool],
    timeout: float,
    what: str = "the expected events",
) -> list[dict[str, Any]]:
    """A stream's JSON events once `done(events)` holds; WaitTimeout with the last events.

    The leader logs a generation only once its hand-overs are done (up to 30 s later).
    """
    return await eventually_async(
        lambda: stream_json(js, stream),
        timeout,
        f"{what} in stream {stream}",
        until=done,
        interval=0.3,
        describe=_brief_events,
    )


def _brief_events(events: list[dict[str, Any]]) -> str:
    """Assignment-log events without their assignments (128 owners each): what tells the
    story of a group is each generation's reason and members."""
    keys = ("generation", "reason", "members")
    return repr([{k: e[k] for k in keys if k in e} or e for e in events])


async def stream_json(js: Any, stream: str) -> list[dict[str, Any]]:
    """Every message of a (small) stream as JSON, in order, e.g. the assignment log."""
    info = await js.stream_info(stream)
    return [
        json.loads((await js.get_msg(stream, seq)).data or b"{}")
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
        if info.state.messages
    ]
