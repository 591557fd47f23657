"""A real group under a steady producer, for one injected fault at a time.

    async with FaultGroup(workdir, nats, etcd, proxied={"m-2": ("etcd", "nats")}) as g:
        await g.start()                      # streams, 3 members, settled, producer on
        g.proxy("m-2", "nats").blackhole()   # the fault
        ...
        g.proxy("m-2", "nats").pass_through()
        figures = await g.finish()           # settled, drained, audited; asserts the rest

Every member is a real `shoal-consumer run` process (harness.fleet) running the `ledger`
handler; the members named in `proxied` reach etcd and/or NATS through a TcpProxy the
group owns (harness.proxy), the others directly. The harness's own clients (status
reads, the producer) always connect directly.

`finish()` checks what every scenario must show (the fault issue's table): every member
process alive, every partition claimed by a live member, one leader, skew <= 1, nothing
acked lost, no two members on one partition at overlapping times. It returns the
measured figures; `report()` writes them as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import nats
import nats.js.errors

from harness.audit import FaultAudit, audit_faults
from harness.drain import wait_drained
from harness.fleet import Fleet
from harness.handlers import SLEEP_PREFIX
from harness.proxy import TcpProxy
from harness.servers import (
    HOST,
    EtcdServer,
    NatsCluster,
    NatsServer,
    ServerProcess,
    _http_get,
)
from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd
from shoal.consumer.ledger import LedgerRecord, read_ledger
from shoal.contracts.names import (
    MSG_ID_HEADER,
    PROJECT_HEADER,
    SEQ_HEADER,
    partition_for,
    partition_subject,
    stream_subjects,
)
from shoal.group.config import GroupConfig
from shoal.group.jetstream import ensure_group
from shoal.group.status import GroupStatus, read_status

__all__ = [
    "EtcdCluster",
    "FaultGroup",
    "QuotaEtcdServer",
    "SteadyProducer",
    "freeze",
    "log_causes",
    "report",
    "rss_mb",
    "thaw",
]

log = logging.getLogger(__name__)

Server = Literal["etcd", "nats"]

# Short leases keep scenarios short; the protocol does not depend on the value. ack_wait
# stays below fence_after (TTL - fence margin), as with the defaults.
TTL = 5
MEMBER_ENV = {
    "SHOAL_LEASE_TTL": str(TTL),
    "SHOAL_KEEPALIVE_INTERVAL": "1",
    "SHOAL_ACK_WAIT": "2",
}
FENCE_AFTER = TTL - 2.0  # GroupConfig's default fence margin is 2 s
# How long every durable must show nothing pending or unacked before the messages a
# stream still holds count as stranded rather than on their way (harness.drain).
STRANDED_AFTER = 10.0


class SteadyProducer:
    """Publishes `rate` messages per second over `projects` projects until stopped.

    It never catches up after an outage (a tick whose publishes cannot be sent is
    skipped), so the load stays what it says. Only messages JetStream acknowledged are
    promised to the consumers: `acked` maps their ids to the time they were sent.
    """

    TICK = 0.05

    def __init__(
        self,
        js: Any,
        subject_prefix: str,
        partitions: int,
        *,
        rate: float,
        projects: int,
        run: str,
    ) -> None:
        self.js = js
        self.subject_prefix = subject_prefix
        self.partitions = partitions
        self.rate = rate
        self.projects = projects
        self.run_id = run
        self.published = 0
        self.failed = 0
        self.skipped = 0
        self.acked: dict[str, float] = {}
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._subjects = [
            partition_subject(subject_prefix, partition_for(f"project-{i}", partitions))
            for i in range(projects)
        ]

    def start(self) -> None:
        self.started_at = time.time()
        self._task = asyncio.create_task(self._run(), name="steady-producer")

    async def stop(self) -> None:
        """Stop sending and wait for the publishes in flight (each ends within 2 s)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        self.stopped_at = time.time()

    async def _one(self, i: int) -> None:
        project = i % self.projects
        mid = f"{self.run_id}-{i}"
        headers = {
            PROJECT_HEADER: f"project-{project}",
            MSG_ID_HEADER: mid,
            SEQ_HEADER: str(i // self.projects),
        }
        sent = time.time()
        try:
            await self.js.publish(self._subjects[project], b"x", headers=headers, timeout=2)
        except Exception as exc:  # NATS away: this one is not promised to anyone
            self.failed += 1
            log.debug("publish %s failed: %r", mid, exc)
            return
        self.acked[mid] = sent

    async def _run(self) -> None:
        i = 0
        next_tick = time.monotonic()
        while True:
            # Read every tick: a soak varies `rate` while the producer runs.
            per_tick = max(1, round(self.rate * self.TICK))
            limit = int(self.rate * 2)  # at most 2 s of publishes awaiting their acks
            if len(self._inflight) + per_tick > limit:
                self.skipped += per_tick
            else:
                for _ in range(per_tick):
                    task = asyncio.create_task(self._one(i))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
                    i += 1
                    self.published += 1
            next_tick += self.TICK
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))


class QuotaEtcdServer(EtcdServer):
    """An etcd whose backend quota is small, so a scenario can fill it (NOSPACE)."""

    def __init__(self, workdir: str | os.PathLike[str], *, quota_bytes: int) -> None:
        self.quota_bytes = quota_bytes
        super().__init__(workdir)

    def _command(self) -> list[str]:
        return [*super()._command(), f"--quota-backend-bytes={self.quota_bytes}"]


class EtcdClusterMember(EtcdServer):
    """One member of a multi-member etcd cluster (see EtcdCluster)."""

    def __init__(self, workdir: str | os.PathLike[str], *, member_name: str) -> None:
        self.member_name = member_name
        self.initial_cluster = ""  # set by EtcdCluster once every member has its ports
        # What the other members dial: its peer port, or a proxy in front of it.
        self.advertised_peer_url = ""
        super().__init__(workdir)

    @property
    def peer_url(self) -> str:
        return f"http://{HOST}:{self.peer_port}"

    def _command(self) -> list[str]:
        command = [
            self.binary,
            f"--name={self.member_name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.advertised_peer_url or self.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=shoal-faults",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        if self._supports("--unsafe-no-fsync"):
            command.append("--unsafe-no-fsync")
        return command


class EtcdCluster:
    """Three etcd members on free loopback ports; `endpoints` as ETCD_ENDPOINTS wants.

    With `peer_proxies`, each member's peers reach it through a TcpProxy of its own (its
    advertised peer URL), so that `isolate(i)` can cut member i from its peers while it
    still answers clients on its client port (with no leader, so no writes).
    """

    def __init__(self, workdir: Path, size: int = 3, *, peer_proxies: bool = False) -> None:
        self.members = [
            EtcdClusterMember(Path(workdir) / f"etcd{i}", member_name=f"e{i}") for i in range(size)
        ]
        self.peer_proxies: list[TcpProxy] = []
        if peer_proxies:
            for m in self.members:
                # peek: etcd's peer requests name their sender (X-Server-From).
                proxy = TcpProxy(f"{HOST}:{m.peer_port}", name=f"{m.member_name}-peers", peek=True)
                self.peer_proxies.append(proxy.start())
                m.advertised_peer_url = f"http://{proxy.address}"
        cluster = ",".join(
            f"{m.member_name}={m.advertised_peer_url or m.peer_url}" for m in self.members
        )
        for member in self.members:
            member.initial_cluster = cluster

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> Self:
        # Together: a member is healthy only once it has a quorum to talk to.
        with ThreadPoolExecutor(len(self.members)) as pool:
            for future in [pool.submit(m.start) for m in self.members]:
                future.result()
        return self

    def member_ids(self) -> list[str]:
        """Each member's raft id as etcd writes it in its peer requests (hex)."""
        status, body = _http_get(f"{self.members[-1].peer_url}/members")
        if status != 200:
            raise RuntimeError(f"etcd /members answered {status}")
        by_name = {m["name"]: format(int(m["id"]), "x") for m in json.loads(body)}
        return [by_name[m.member_name] for m in self.members]

    def isolate(self, index: int) -> None:
        """Cut member `index` from its peers (both ways); its clients still reach it."""
        if not self.peer_proxies:
            raise RuntimeError("isolate() needs EtcdCluster(peer_proxies=True)")
        sender = f"X-Server-From: {self.member_ids()[index]}".encode()
        for i, proxy in enumerate(self.peer_proxies):
            if i == index:
                proxy.blackhole()  # nobody reaches it
            else:
                proxy.hold(sender)  # it reaches nobody

    def heal(self) -> None:
        for proxy in self.peer_proxies:
            proxy.hold(None)
            proxy.pass_through()

    def stop(self) -> None:
        for member in self.members:
            member.stop()
        for proxy in self.peer_proxies:
            proxy.close()


def freeze(server: ServerProcess) -> None:
    """SIGSTOP a server (its whole process group): it keeps its sockets and says nothing."""
    if server.pid is not None:
        os.killpg(server.pid, signal.SIGSTOP)


def thaw(server: ServerProcess) -> None:
    if server.pid is not None:
        os.killpg(server.pid, signal.SIGCONT)


# A log record's first line (shoal.logs.FORMAT): "<date> <time> LEVEL logger: message".
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (\w+) ([\w.]+): (.*)$")
# takeover.describe's line: "Partition 5 taken over: 7 of 7 earlier deliveries back after
# 3.34 s (...)".
_TAKEOVER = re.compile(r"taken over: \d+ of \d+ earlier deliveries back after ([\d.]+) s")
_VARYING = re.compile(r"\b[0-9a-f]*[0-9][0-9a-f]*\b")


def log_causes(text: str, *, width: int = 40) -> dict[str, int]:
    """How many log records of each cause `text` (a member's log) holds.

    A cause is the logger and the start of the message with its numbers masked: "Lease
    keep-alive failed (...); fencing in 2.5 s" and "... in 0.0 s" are one cause. Lines
    that do not start a record (tracebacks) count with the record they belong to.
    """
    causes: dict[str, int] = {}
    for line in text.splitlines():
        match = _RECORD.match(line)
        if match is None:
            continue
        _level, logger, message = match.groups()
        cause = f"{logger}: {_VARYING.sub('#', message)[:width]}"
        causes[cause] = causes.get(cause, 0) + 1
    return causes


def rss_mb(pid: int) -> float:
    """A process's resident set size (VmRSS of /proc/<pid>/status), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def report(name: str, figures: Mapping[str, Any]) -> str:
    """One JSON line per scenario: to stdout, and appended to $SHOAL_FAULTS_RESULTS."""
    line = json.dumps({"scenario": name, **figures}, sort_keys=False, default=str)
    print(line, flush=True)
    path = os.environ.get("SHOAL_FAULTS_RESULTS")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")
    return line


class FaultGroup:
    """One group (3 members by default) on the given servers, with optional proxies."""

    def __init__(
        self,
        workdir: Path,
        nats_server: NatsServer | NatsCluster,
        etcd_server: EtcdServer,
        *,
        members: int = 3,
        proxied: Mapping[str, Collection[Server]] | None = None,
        env: Mapping[str, str] | None = None,
        rate: float = 400,
        projects: int = 1000,
        partitions: int = 128,
        handler: str = "shoal.consumer.handlers:ledger",
        name: str | None = None,
        etcd_endpoints: str | None = None,
        stream_replicas: int = 1,
        member_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.nats_server = nats_server
        self.etcd_server = etcd_server
        self.member_ids = [f"m-{i}" for i in range(members)]
        self.proxied = {m: set(servers) for m, servers in (proxied or {}).items()}
        self.rate = rate
        self.projects = projects
        self.config = GroupConfig(
            group=f"f{uuid.uuid4().hex[:8]}",
            namespace="faults",
            partitions=partitions,
            nats_url=nats_server.url,
            # Several (an EtcdCluster's): the members get all of them, in order.
            etcd_endpoints=etcd_endpoints or etcd_server.endpoint,
            handler=handler,
            ledger=True,  # the audit reads the ledger handler's records
            # The durables are created with the members' ack_wait (and max_deliver).
            ack_wait=float({**MEMBER_ENV, **(env or {})}["SHOAL_ACK_WAIT"]),
            **(
                {"max_deliver": int(env["SHOAL_MAX_DELIVER"])}
                if env and "SHOAL_MAX_DELIVER" in env
                else {}
            ),
            # Streams and durables (members create them too: they must agree, or a
            # member would "update" the stream to its own replica count).
            stream_replicas=stream_replicas,
        )
        self.env = {**MEMBER_ENV, "SHOAL_STREAM_REPLICAS": str(stream_replicas), **(env or {})}
        # Per member: e.g. each member's NATS_URL a different node of a NatsCluster.
        self.member_env = {m: dict(e) for m, e in (member_env or {}).items()}
        self.fleet = Fleet.for_config(self.workdir / "members", self.config, env=self.env)
        self.proxies: dict[tuple[str, Server], TcpProxy] = {}
        # The harness reads through the last endpoint only: a scenario kills the first,
        # and the harness's view must not depend on the fail-over under test.
        self.etcd = Etcd((etcd_endpoints or etcd_server.endpoint).split(",")[-1])
        self.nc: Any = None
        self.js: Any = None
        self.producer: SteadyProducer | None = None
        # Members a scenario stopped on purpose (no longer expected alive at the end).
        self.gone: set[str] = set()
        # What the scenario measured; the suite reports it (one JSON line, see report())
        # whether the scenario passed or not.
        self.name = name
        self.figures: dict[str, Any] = {}

    # -- set-up and tear-down ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self, *, leader: str | None = None, settle_timeout: float = 30) -> GroupStatus:
        """Streams, members (through their proxies), settled; then the producer starts.

        With `leader`, that member starts first and leads.
        """
        await self.etcd.connect(attempts=20)
        servers = (
            self.nats_server.urls
            if isinstance(self.nats_server, NatsCluster)
            else [self.nats_server.url]
        )
        self.nc = await nats.connect(
            servers,
            name="fault-harness",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=2,
        )
        self.js = self.nc.jetstream()
        for attempt in range(1, 6):
            try:
                # Idempotent: a retry creates only what is still missing. R3 durables on
                # a busy 2-core machine can take longer than one request's timeout.
                await ensure_group(self.js, self.config)
                break
            except (TimeoutError, nats.errors.TimeoutError):
                if attempt == 5:
                    raise
                log.info("creating the streams and durables timed out; again (%d)", attempt)
        if leader is not None:
            # Start it alone first, so that it is the one elected.
            self.start_member(leader)
            await self.wait_for(lambda s: s.leader == leader, settle_timeout, f"{leader} to lead")
        for member in self.member_ids:
            if member != leader:
                self.start_member(member)
        status = await self.wait_for(self.settled(), settle_timeout, "the group to settle")
        self.producer = SteadyProducer(
            self.js,
            self.config.subject_prefix,
            self.config.partitions,
            rate=self.rate,
            projects=self.projects,
            run=self.config.group,
        )
        self.producer.start()
        return status

    def start_member(self, member: str) -> None:
        servers = self.proxied.get(member, set())
        extra: dict[str, str] = dict(self.member_env.get(member, {}))
        if "etcd" in servers:
            extra["ETCD_ENDPOINTS"] = self._proxy(member, "etcd").address
        if "nats" in servers:
            extra["NATS_URL"] = f"nats://{self._proxy(member, 'nats').address}"
        self.fleet.start(member, **extra)
        self.gone.discard(member)

    def _proxy(self, member: str, server: Server) -> TcpProxy:
        key = (member, server)
        if key not in self.proxies:
            upstream = self.etcd_server.endpoint if server == "etcd" else self._nats_address()
            self.proxies[key] = TcpProxy(upstream, name=f"{member}-{server}").start()
        return self.proxies[key]

    def _nats_address(self) -> str:
        return self.nats_server.url.removeprefix("nats://")

    def proxy(self, member: str, server: Server) -> TcpProxy:
        """The proxy between `member` and `server` (the member must be in `proxied`)."""
        return self.proxies[(member, server)]

    async def close(self) -> None:
        """Stop everything this group started, whatever state it is in."""
        try:
            if self.producer is not None:
                async with asyncio.timeout(10):
                    await self.producer.stop()
        except Exception:
            log.exception("stopping the producer")
        self.fleet.close()
        for proxy in self.proxies.values():
            proxy.close()
        if self.nc is not None:
            try:
                async with asyncio.timeout(5):
                    await self.nc.close()
            except Exception:
                log.debug("closing NATS", exc_info=True)
        self.etcd.close()

    async def publish_slow(
        self, member: str, seconds: float, cleanup: float = 0.0
    ) -> tuple[str, int]:
        """One message that takes `seconds` (harness.handlers:slow_ledger; `cleanup` more
        to stop when cancelled) on a partition `member` owns now; it counts as acked like
        the producer's. Its id and partition."""
        owned = self.partitions_of(await self.status(), member)
        project = next(
            f"slow-{k}"
            for k in range(100_000)
            if partition_for(f"slow-{k}", self.config.partitions) in owned
        )
        partition = partition_for(project, self.config.partitions)
        mid = f"{self.config.group}-slow-{uuid.uuid4().hex[:6]}"
        sent = time.time()
        await self.js.publish(
            partition_subject(self.config.subject_prefix, partition),
            SLEEP_PREFIX + f"{seconds}:{cleanup}".encode(),
            headers={PROJECT_HEADER: project, MSG_ID_HEADER: mid},
        )
        assert self.producer is not None
        self.producer.acked[mid] = sent
        return mid, partition

    def project_on(self, partition: int, prefix: str) -> str:
        """A project name starting with `prefix` that hashes to `partition`."""
        return next(
            f"{prefix}-{k}"
            for k in range(1_000_000)
            if partition_for(f"{prefix}-{k}", self.config.partitions) == partition
        )

    async def publish(
        self, project: str, data: bytes, *, seq: int | None = None, promised: bool = True
    ) -> str:
        """One message of `project` (as the producer sends them); its id. A promised one
        counts as acked like the producer's: the audit expects it in the ledger (a
        message meant to be dead-lettered is not promised)."""
        mid = f"{self.config.group}-{project}-{uuid.uuid4().hex[:8]}"
        headers = {PROJECT_HEADER: project, MSG_ID_HEADER: mid}
        if seq is not None:
            headers[SEQ_HEADER] = str(seq)
        partition = partition_for(project, self.config.partitions)
        sent = time.time()
        await self.js.publish(
            partition_subject(self.config.subject_prefix, partition), data, headers=headers
        )
        if promised:
            assert self.producer is not None
            self.producer.acked[mid] = sent
        return mid

    async def dead_letters(self) -> list[dict[str, str]]:
        """The headers of every message in the dead-letter stream, in order."""
        info = await self.js.stream_info(self.config.dlq_stream)
        letters = []
        if info.state.messages:
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    msg = await self.js.get_msg(self.config.dlq_stream, seq)
                except nats.js.errors.NotFoundError:
                    continue
                letters.append(dict(msg.headers or {}))
        return letters

    def rss(self) -> dict[str, float]:
        """Each live member process's resident set size, in MB."""
        return {
            m: round(rss_mb(member.pid), 2)
            for m, member in self.fleet.members.items()
            if member.alive()
        }

    # -- observing -----------------------------------------------------------------------

    def alive(self) -> set[str]:
        return {m for m, member in self.fleet.members.items() if member.alive()}

    def expected(self) -> set[str]:
        return set(self.member_ids) - self.gone

    async def status(self) -> GroupStatus:
        c = self.config
        return await read_status(self.etcd, c.namespace, c.group, c.partitions)

    async def wait_for(
        self, predicate: Callable[[GroupStatus], bool], timeout: float, what: str
    ) -> GroupStatus:
        """Poll the status until predicate holds (etcd errors are retried until timeout)."""
        deadline = time.monotonic() + timeout
        last: GroupStatus | None = None
        while True:
            try:
                last = await self.status()
                if predicate(last):
                    return last
            except TRANSIENT_ERRORS as exc:
                log.debug("status read failed: %s", exc)
            if time.monotonic() > deadline:
                state = last.as_dict() if last is not None else "(etcd unreachable)"
                raise TimeoutError(f"waited {timeout:.0f} s for {what}; last status: {state}")
            await asyncio.sleep(0.1)

    def settled(self, members: set[str] | None = None) -> Callable[[GroupStatus], bool]:
        """Exactly these members (default: the expected ones), one leader among them,
        every partition owned by one of them and claimed by its owner, skew <= 1."""

        def check(status: GroupStatus) -> bool:
            want = self.expected() if members is None else members
            return (
                set(status.members) == want
                and status.leader in want
                and not status.unowned
                and all(owner in want for owner in status.owners.values())
                and status.claims == status.owners
                and status.skew <= 1
            )

        return check

    def partitions_of(self, status: GroupStatus, member: str) -> set[int]:
        return {p for p, m in status.owners.items() if m == member}

    def log_of(self, member: str) -> str:
        return self.fleet.members[member].log_text()

    async def wait_log(self, member: str, text: str, timeout: float, *, after: int = 0) -> float:
        """Wait until `member`'s log shows `text` (past offset `after`); the time it took."""
        started = time.monotonic()
        while text not in self.log_of(member)[after:]:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{member} never logged {text!r} within {timeout:.0f} s")
            await asyncio.sleep(0.05)
        return time.monotonic() - started

    # -- the end of every scenario -------------------------------------------------------

    async def records(self) -> list[LedgerRecord]:
        return await read_ledger(self.js, self.config.ledger_stream)

    async def finish(
        self, *, settle_timeout: float = 45, drain_timeout: float = 60, order_kept: bool = True
    ) -> dict[str, Any]:
        """Check what every scenario must show; return `figures`, the audit's added.

        The group must settle with every expected member (processes alive, partitions
        claimed by their owners, one leader, skew <= 1) while the producer still runs;
        then production stops, the stream drains, and the ledger is audited: nothing
        lost, no overlap, and (unless `order_kept` is False: a scenario whose fault the
        order promise does not cover, or a Fast baseline) no per-project inversion.
        """
        dead = self.expected() - self.alive()
        assert not dead, f"member processes died: {sorted(dead)}\n{self.fleet.logs()}"
        settle_started = time.monotonic()
        final = await self.wait_for(self.settled(), settle_timeout, "the group to settle")
        settled_in = time.monotonic() - settle_started
        assert self.producer is not None
        await self.producer.stop()
        stranded = await self._drained(drain_timeout)
        result = await self.audit()
        processed_ids = {record.message_id for record in await self.records()}
        unprocessed = sorted(stranded - processed_ids)
        assert not unprocessed, (
            f"{len(unprocessed)} message(s) stranded in the stream, no durable holding them, "
            f"never processed: {unprocessed[:10]}"
        )
        dead = self.expected() - self.alive()
        assert not dead, f"member processes died: {sorted(dead)}\n{self.fleet.logs()}"
        figures = self.figures
        figures.update(
            {
                **result.figures(),
                **self.takeover_pauses(),
                "dead_lettered": await self._dead_lettered(),
                "publish_failed": self.producer.failed,
                "publish_skipped": self.producer.skipped,
                "final_settle_s": round(settled_in, 2),
                "final_members": sorted(final.members),
                "final_skew": final.skew,
                "leader": final.leader,
            }
        )
        assert result.lost == [], (figures, result.lost[:10])
        assert result.overlaps == [], (figures, result.overlaps[:10])
        if order_kept:
            assert result.order_inversions == 0, figures
        return figures

    def takeover_pauses(self) -> dict[str, Any]:
        """What holding newer messages back after an unclean takeover cost (takeover.py):
        every pause of 0.5 s or more the members logged, and the longest."""
        pauses = sorted(
            float(found)
            for member in self.fleet.members.values()
            for found in _TAKEOVER.findall(member.log_text())
        )
        return {"takeover_pauses": len(pauses), "takeover_pause_max_s": max(pauses, default=0.0)}

    async def audit(self) -> FaultAudit:
        assert self.producer is not None
        records = await self.records()
        window = (self.producer.started_at, self.producer.stopped_at or time.time())
        return audit_faults(records, self.producer.published, self.producer.acked, window=window)

    async def _drained(self, timeout: float) -> set[str]:
        """Wait for the stream to drain; the ids of any messages it kept stranded."""
        drained = await wait_drained(
            self.js,
            self.config.stream,
            stream_subjects(self.config.subject_prefix)[0],
            timeout,
            stranded_after=STRANDED_AFTER,
        )
        if not drained.clean:
            self.figures["stranded_in_stream"] = len(drained.stranded)
        return drained.stranded

    async def _dead_lettered(self) -> int:
        info = await self.js.stream_info(self.config.dlq_stream)
        return int(info.state.messages)
