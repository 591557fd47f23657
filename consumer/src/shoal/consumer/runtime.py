"""One consumer process: connect, join, lead when elected, consume, leave gracefully.

Shutdown order (SIGTERM) is what makes a planned departure lossless and fast:
  1. delete our member key, so the leader moves our partitions;
  2. release every partition (finish the message in hand, ack, give back the rest);
  3. if we lead, wait until our partitions have new owners, then delete the leader key
     so a successor takes over at once (adopting the assignment: nothing more moves);
  4. revoke the lease (any key left on it goes with it), close connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import time
from typing import Any

from shoal.clients.etcd import Etcd
from shoal.clients.kube import GroupObject
from shoal.clients.nats import NatsHealth, connect
from shoal.clients.natsauth import NatsClosed, NatsRefusal, refusal
from shoal.consumer.autoscaler import Autoscaler
from shoal.consumer.cpu import CpuMeter
from shoal.consumer.deadletter import ExhaustedMessages
from shoal.consumer.election import Election, GenerationRecord
from shoal.consumer.handlers import load_handler
from shoal.consumer.healthport import HealthServer
from shoal.consumer.httphandler import HttpHandler
from shoal.consumer.membership import Membership
from shoal.consumer.memory import trim_forever
from shoal.consumer.metrics import Metrics
from shoal.consumer.ready import HealthFile, MemberState, process_start
from shoal.consumer.worker import Worker
from shoal.contracts.events import AssignmentEvent
from shoal.contracts.names import assignments_subject
from shoal.contracts.values import MemberStats
from shoal.group.config import GroupConfig
from shoal.group.jetstream import (
    PartitionCountMismatch,
    check_partitions,
    ensure_group,
    partition_progress,
)
from shoal.group.problems import HandlerNotReady, RefusalReporter
from shoal.group.view import GroupView

log = logging.getLogger(__name__)

#: How long a generation's log event waits for its hand-overs to finish.
HANDOVER_LOG_TIMEOUT = 30.0


class ConsumerProcess:
    def __init__(self, config: GroupConfig) -> None:
        self.config = config
        self._started = process_start() or 0  # in the state file: which process wrote it
        # An unknown handler stops start-up here, before any connection is made.
        self.handler = load_handler(
            config.handler,
            timeout=config.handler_timeout,
            connections=config.max_concurrency,
            ledger=config.ledger,
            socket=config.handler_socket,
        )
        self.metrics = Metrics()
        self.metrics.group_partitions.set(config.partitions)
        self.etcd = Etcd(config.etcd_endpoints, **config.etcd_options())
        self.view = GroupView(self.etcd, config.keys, config.partitions)
        self.cpu = CpuMeter()
        self.lag = 0
        self._stats_problems_logged: set[str] = set()
        self.membership = Membership(
            self.etcd, config, self._stats, lambda: len(self.view.member_ids())
        )
        # shoal_fenced: joined once, and now unable to prove the lease.
        self.metrics.watch_fencing(
            lambda: self.membership.incarnation > 0 and not self.membership.safe()
        )
        self.leader = Election(
            self.etcd, self.view, self.membership, config, on_generation=self._record_generation
        )
        self.leader.on_leadership(lambda value: self.metrics.is_leader.set(1 if value else 0))
        self.worker: Worker | None = None
        self.autoscaler: Autoscaler | None = None
        self.nc: Any = None
        self.js: Any = None
        self.nats_health: NatsHealth | None = None
        self.metrics_port: int | None = None
        self.stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._generations: asyncio.Queue[GenerationRecord] = asyncio.Queue()
        # The probes' state file (shoal.consumer.ready), rewritten every second from the
        # event loop from start to exit: readiness follows joined / fenced / NATS, and
        # liveness only whether this loop still runs.
        self.health = (
            HealthFile(config.ready_file, self._member_state) if config.ready_file else None
        )
        self._health_task: asyncio.Task[None] | None = None
        # The same answers over HTTP (healthport.py), for httpGet probes.
        self.health_server: HealthServer | None = None
        # Why NATS refuses us (credentials, TLS), while it does: the probes say it.
        self.nats_refusal: NatsRefusal | None = None
        # ... and etcd says it too (Keys.problem): a refused member has not joined, so
        # without it neither `shoal-consumer status` nor the operator would know of it.
        self.refusals = RefusalReporter(
            self.etcd,
            config.keys.problem(config.member_id),
            config.lease_ttl,
            config.keepalive_interval,
        )
        # What ended the member, when it must exit non-zero (run_consumer raises it).
        self.fatal: NatsClosed | None = None
        # Why the HTTP handler accepts no connection, while it does (reach.py).
        self.handler_unreachable: str | None = None
        if isinstance(self.handler, HttpHandler):
            self.handler.reach.on_change = self._handler_reach

    def _member_state(self) -> MemberState:
        """What the probes see; memory only (never waits on etcd or NATS)."""
        m = self.membership
        return MemberState(
            member=self.config.member_id,
            pid=os.getpid(),
            mono=time.monotonic(),
            ts=round(time.time(), 3),
            joined=m.incarnation > 0 and m.lease_id != 0,
            safe=m.safe(),
            nats=self.nats_health is not None and self.nats_health.reachable(),
            leaving=m.leaving or self.stopping.is_set(),
            stalled=self.worker.stalled() if self.worker is not None else [],
            wedged=self.worker is not None and self.worker.wedged(),
            problem=self._problem(),
            started=self._started,
        )

    def _problem(self) -> str:
        """What keeps this member from its work, for its probes ("" if nothing)."""
        if self.nats_refusal:
            return str(self.nats_refusal)
        if self.handler_unreachable is not None:
            return f"its handler accepts no connection: {self.handler_unreachable}"
        return ""

    def _handler_reach(self, why: str | None) -> None:
        """The HTTP handler became unreachable (why), or reachable again (None): the
        metric, readiness (_problem), problems/<member> (a NATS refusal outranks it) and
        the stats' handler_ok (the leader moves our partitions) follow."""
        self.handler_unreachable = why
        self.metrics.handler_reachable.set(0 if why is not None else 1)
        if self.nats_refusal is None:
            self.refusals.report(HandlerNotReady(why) if why is not None else None)

    def _waiting(self, why: str) -> None:
        """The handler does not answer its ready path yet (HttpHandler.wait_ready). One
        problems/<member> key says one thing: a NATS refusal (a reconnect refused while
        we wait) outranks the wait, rather than each overwriting the other at every try
        (the operator would post the refusal's Warning and its end by turns)."""
        if self.nats_refusal is None:
            self.refusals.report(HandlerNotReady(why))

    def _on_nats_refusal(self, why: NatsRefusal | None) -> None:
        # Called at every attempt; the reporter writes etcd only when the refusal changes.
        # etcd is connected before NATS (start), so the write can be made at once.
        self.nats_refusal = why
        if why is None and self.handler_unreachable is not None:
            # The refusal outranked the handler's unreachability: that shows again.
            self.refusals.report(HandlerNotReady(self.handler_unreachable))
        else:
            self.refusals.report(why)

    def _stats(self) -> MemberStats:
        fields: dict[str, Any] = {
            "cpu": self.cpu.read(),
            "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "lag": self.lag,
            "pid": os.getpid(),
            "ts": round(time.time(), 3),
            # The leader gives no partitions to a member that cannot reach NATS.
            "nats_ok": self.nats_health is None or self.nats_health.reachable(),
        }
        if isinstance(self.handler, HttpHandler):
            # ... nor to one whose HTTP handler accepts no connection (reach.py).
            fields["handler_ok"] = self.handler_unreachable is None
        if self.worker is not None:
            fields.update(self.worker.stats())
        # Parsed, not constructed: a broken reading (a clock step, say) must cost this
        # member that field, not its stats and with them its lease's keep-alive loop.
        stats = MemberStats.parse(fields)
        for problem in stats.problems.values():
            if problem not in self._stats_problems_logged:
                self._stats_problems_logged.add(problem)
                log.warning("Left a broken field out of this member's stats: %s", problem)
        return stats

    async def _record_generation(self, record: GenerationRecord) -> None:
        self.metrics.rebalances.inc()
        self._generations.put_nowait(record)

    async def _publish_generations(self) -> None:
        """Log each generation, in order, once its moves are done (or given up on)."""
        while True:
            record = await self._generations.get()
            try:
                handover = await self._handover_times(record, HANDOVER_LOG_TIMEOUT)
                await self.js.publish(
                    assignments_subject(self.config.subject_prefix),
                    self._event(record, handover).to_bytes(),
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("Could not log generation %d: %r", record.generation, exc)
            finally:
                self._generations.task_done()

    async def _handover_times(self, record: GenerationRecord, timeout: float) -> dict[int, float]:
        """Milliseconds from the leader's write until each moved partition's new owner
        claimed it (as this member's view saw it); moves not done by `timeout` are left out.
        """
        pending = {p: to for p, _, to in record.moved}
        times: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            changed = self.view.change_event()
            claims, now = self.view.claims(), time.time()
            for p, to in list(pending.items()):
                claim = claims.get(p)
                if claim is not None and claim.member == to:
                    times[p] = round(max(0.0, now - record.ts) * 1000, 1)
                    del pending[p]
            if pending:
                try:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        await changed.wait()
                except TimeoutError:
                    pass
        return times

    def _event(self, record: GenerationRecord, handover: dict[int, float]) -> AssignmentEvent:
        """The analytics log's event (shoal.contracts.events, schema 1)."""
        return AssignmentEvent.of(
            ts=record.ts,
            namespace=self.config.namespace,
            group=self.config.group,
            generation=record.generation,
            epoch=record.epoch,
            leader=record.leader,
            reason=record.reason,
            strategy=self.config.strategy,
            members=record.members,
            assignment=record.assignment,
            moved=record.moved,
            handover_ms=handover,
            loads=record.loads,
        )

    async def start(self) -> None:
        c = self.config
        log.info(
            "Starting member %s of %s/%s (handler %s, %d partitions)",
            c.member_id,
            c.namespace,
            c.group,
            c.handler,
            c.partitions,
        )
        if c.ack_wait >= c.fence_after:
            log.warning(
                "ack_wait (%.1f s) is not shorter than lease TTL minus fence margin (%.1f s): "
                "after a crash, the crashed member's unacknowledged messages may be "
                "redelivered after newer ones of the same project",
                c.ack_wait,
                c.fence_after,
            )
        # Unusable NATS settings stop start-up here, before etcd is even asked.
        c.nats_security().check()
        if self.health is not None and self._health_task is None:
            self._health_task = asyncio.create_task(self.health.run(), name="health-file")
        if c.health_port is not None and c.ready_file and self.health_server is None:
            self.health_server = HealthServer(c.ready_file, c.health_port)
        if c.metrics_port is not None:
            self.metrics_port = self.metrics.serve(c.metrics_port)
        await self.etcd.connect()
        self.nc = await connect(
            c.nats_url,
            name=f"shoal-{c.group}-{c.member_id}",
            security=c.nats_security(),
            reconnect_buffer=c.nats_reconnect_buffer,
            on_refusal=self._on_nats_refusal,
        )
        self.js = self.nc.jetstream(prefix=c.nats_js_api_prefix)
        self.nats_health = NatsHealth(self.nc)
        # The partition count the group's stream records, before anything is written
        # (ensure_group would record ours): another count joined, took the partitions it
        # names and left the others to nobody.
        try:
            await check_partitions(self.js, c)
        except PartitionCountMismatch:
            raise
        except Exception as exc:  # no answer, no permission: as before the count was kept
            log.warning(
                "Could not read stream %s for the group's partition count (%r): going on "
                "with %d partitions",
                c.stream,
                exc,
                c.partitions,
            )
        if c.ensure_jetstream:
            await ensure_group(self.js, c)
        self.worker = Worker(
            c,
            self.etcd,
            self.view,
            self.membership,
            self.nc,
            self.js,
            self.handler,
            self.metrics,
            nats_reachable=self.nats_health.reachable,
        )
        self.exhausted = ExhaustedMessages(c, self.nc, self.js, self.leader)
        self._tasks.append(asyncio.create_task(self.view.run(), name="view"))
        await self.view.synced.wait()
        if c.handler_ready_path:
            # Not a member before the service beside us answers (spec.handlerReadyPath).
            if isinstance(self.handler, HttpHandler):
                # etcd says why too (Keys.problem): the operator and `status` show it.
                await self.handler.wait_ready(c.handler_ready_path, waiting=self._waiting)
                if self.nats_refusal is None:
                    self.refusals.report(None)
            else:
                log.warning(
                    "handlerReadyPath %s ignored: the handler %s is not an HTTP handler",
                    c.handler_ready_path,
                    c.handler,
                )
        await self.membership.join()
        if self.health is not None:
            self.health.write()  # ready at once, not up to a second later
        self._tasks += [
            asyncio.create_task(self.membership.run(), name="membership"),
            asyncio.create_task(self.leader.run(), name="leader"),
            asyncio.create_task(self.worker.run(), name="worker"),
            asyncio.create_task(self._lag_loop(), name="lag"),
            asyncio.create_task(trim_forever(self.config.malloc_trim_interval), name="trim"),
            asyncio.create_task(self._publish_generations(), name="assignment-log"),
            asyncio.create_task(self.exhausted.run(), name="exhausted-messages"),
            asyncio.create_task(self.nats_health.run(), name="nats-health"),
            asyncio.create_task(self._watch_connection(), name="nats-connection"),
        ]
        if c.autoscaler == "kubernetes":
            self._start_autoscaler()

    def _start_autoscaler(self) -> None:
        c = self.config
        try:
            target = GroupObject(c.namespace, c.group)
        except Exception as exc:
            # Consuming matters more than scaling: run on, without autoscaling, and say so.
            log.error("Autoscaling disabled: no Kubernetes credentials (%s)", exc)
            return
        self.autoscaler = Autoscaler(c, self.etcd, self.view, self.leader, target)
        self._tasks.append(asyncio.create_task(self.autoscaler.run(), name="autoscaler"))

    async def _lag_loop(self) -> None:
        """Our lag (num_pending + num_ack_pending over owned partitions) for the autoscaler.

        The durables' info comes from JetStream's API, answered by each consumer's
        leader (never a follower's stale copy). All partitions are asked at once: one
        round trip, so the figure is at most one stats interval old.
        """
        while True:
            await asyncio.sleep(self.config.stats_interval)
            if self.worker is None:
                continue
            # A dozing partition had nothing pending and nothing unacked but what we hold
            # when it began to doze, and nothing was published to it since: its lag is
            # what we hold. Asking its durable anyway would make an idle group cost the
            # server a request per partition every stats interval.
            owned, held = self.worker.lag_sources()
            results = await asyncio.gather(
                *(partition_progress(self.js, self.config, p) for p in owned),
                return_exceptions=True,
            )
            total = held
            for p, result in zip(owned, results, strict=True):
                if isinstance(result, BaseException):
                    # (The partition keeps its last known lag: the stall check's "work".)
                    log.debug("Lag of partition %d unavailable: %r", p, result)
                else:
                    lag, floor = result
                    total += lag
                    runner = self.worker.runners.get(p)
                    if runner is not None:
                        runner.server_lag = lag
                        runner.ack_floor = floor
            self.lag = total
            self.metrics.lag.set(total)
            # Every round, dozing or not: the deletion advisory is core NATS (one missed
            # while reconnecting, or late, is not sent again), and a dozing member is
            # the one the next burst of a recreated stream's messages finds.
            await self.worker.check_stream()

    async def _watch_connection(self) -> None:
        """End the member when nats-py has closed its connection for good.

        nats-py does so, instead of reconnecting, when the server drops the login of a
        connected client (its password rotated, its user removed: NatsAuthFailed).
        Nothing would bring the connection back; a new process (the pod restarting,
        with the secret as it is now) connects again, retrying with backoff.
        """
        await self.nc.closed_event.wait()
        error = self.nc.last_error
        why = refusal(error) if error is not None else None
        if why is not None:
            self.nats_refusal = why
        raise NatsClosed(f"NATS closed this member's connection for good: {why or repr(error)}")

    def request_stop(self) -> None:
        self.stopping.set()

    async def wait(self) -> None:
        """Run until a stop is requested or a component dies."""
        stop = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([stop, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is stop:
                continue
            exc = task.exception()
            if isinstance(exc, NatsClosed):
                self.fatal = exc
                log.error("%s; leaving the group", exc)
            elif exc is not None:
                log.error("Component %s failed: %r", task.get_name(), exc)
            elif not self.stopping.is_set():
                # Components run until the member stops: one that returns is a defect,
                # and the member leaving without saying why would be a silent one.
                log.error("Component %s ended on its own; leaving the group", task.get_name())
        stop.cancel()

    async def _stop_health(self) -> None:
        """Stop refreshing the probes' state and remove it (the process is going)."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self.health is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.health.path)
        if self.health_server is not None:
            await asyncio.to_thread(self.health_server.close)
            self.health_server = None

    async def shutdown(self) -> None:
        c = self.config
        log.info("Leaving the group gracefully")
        if self.health is not None:
            self.health.write()  # unready at once (leaving), still alive while draining
        if self.worker is not None:
            # Pulls sent from now on are brisk; the full-length ones open end first (at
            # most fetch_expires), so that our partitions are released within a brisk
            # pull of our leaving: a SIGTERM'd member's open pulls kept each partition
            # up to 0.3 s (most of a leave's hand-over latency).
            await self.worker.prepare_to_leave(c.fetch_expires + 0.2)
        await self.membership.leave()
        drained = True
        if self.worker is not None:
            drained = await self.worker.drain(c.drain_timeout)
        if self.leader.is_leader:
            await self._wait_reassigned(min(c.drain_timeout, 15.0))
        if self.leader.is_leader:
            # Log the last generations (our own departure's) before the connection goes.
            try:
                async with asyncio.timeout(HANDOVER_LOG_TIMEOUT / 10):
                    await self._generations.join()
            except TimeoutError:
                log.info("Some assignment-log events were not written before leaving")
        await self.leader.resign()
        # Every handler has finished or been cancelled by now (drain): an HTTP handler's
        # open requests with them. Its connections can go.
        await self.close_handler()
        for task in self._tasks:
            task.cancel()
        # Bounded: a task that does not stop must not keep the process from exiting.
        _, stuck = await asyncio.wait(self._tasks, timeout=5) if self._tasks else (set(), set())
        for task in stuck:
            log.warning("Task %s did not stop within 5 s of being cancelled", task.get_name())
        await self.membership.close()
        if self.nc is not None:
            try:
                await self.nc.drain()
            except Exception:
                log.debug("NATS drain failed", exc_info=True)
        await self.refusals.close()
        self.etcd.close()
        await self._stop_health()
        log.info("Stopped%s", "" if drained else " (some partitions were not released in time)")

    async def close_handler(self) -> None:
        """Close what the handler holds open (an HTTP handler's connections)."""
        if isinstance(self.handler, HttpHandler):
            try:
                await self.handler.aclose()
            except Exception:
                log.debug("Closing the HTTP handler's session failed", exc_info=True)

    async def _wait_reassigned(self, timeout: float) -> None:
        """As leader, stay until none of our partitions is still assigned to us."""
        deadline = time.monotonic() + timeout
        me = self.config.member_id
        while time.monotonic() < deadline:
            others = set(self.view.members()) - {me}
            if not others or all(t.owner != me for t in self.view.targets().values()):
                return
            await asyncio.sleep(0.05)


async def run_consumer(config: GroupConfig) -> None:
    """Run one consumer until SIGTERM or SIGINT, then leave gracefully."""
    process = ConsumerProcess(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, process.request_stop)
    # A stop may come while start() is still retrying unreachable servers.
    starting = asyncio.create_task(process.start(), name="start")
    stop = asyncio.create_task(process.stopping.wait())
    await asyncio.wait([starting, stop], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        stop.cancel()
        log.info("Stopped before start-up completed")
        # A member NATS refused stops here: its refusal goes from etcd with it.
        await process.close_handler()  # (one waiting for its handler to be ready, too)
        await process.refusals.close()
        process.etcd.close()
        await process._stop_health()
        return
    stop.cancel()
    try:
        starting.result()
        await process.wait()
    finally:
        await process.shutdown()
    if process.fatal is not None:
        raise process.fatal
