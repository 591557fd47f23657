"""One owned partition: pulling its durable, dozing while it is idle, and letting it go.

A `PartitionRunner` pulls the partition's durable into the member's `Dispatcher`
(dispatch.py), which runs different projects concurrently and each project's messages in
order. It keeps about half a second of its own settle rate, between `PULL_FLOOR` and
`fetch_batch` messages (holding.py). When the `Worker` (worker.py) stops it, it does the
letting-go half of the hand-over (DESIGN.md, and worker.py's docstring): no new pull,
the running handlers finish and ack, what was fetched but not started goes back to
JetStream in stream order, and the last nak is a request, so that all are applied before
the worker deletes the claim.

When the group is paused (Keys.paused, Worker.set_paused) the runner keeps its claim
and does the first half of that at the top of its pull loop: no new pull, nothing new
starts, the running handlers finish and ack, and what was fetched and not started is
given back (see `_pause` for why given back rather than kept alive). Resumed, it pulls
again, holding what arrives until everything it gave back is there (as a new owner
does after a hand-over), so per-project order holds across the pause.

Pulling uses raw JetStream pull requests rather than nats-py's fetch(): every request is
read until the server ends it (batch complete, or a 404/408/409 status), so when the
partition is let go no pull request of ours is still open on the server. An open request
would deliver a message after we stopped reading; that message would sit unacked until
ack_wait, then come back to the next owner out of order.

The member reads every pull's replies on one subscription (Worker.receive), where a
JetStream message keeps its own subject: it reaches the partition's runner by the
durable in its reply subject, and cannot be told to belong to one request rather than
another. So a partition never has more than one request of this member open on the
server, and the runner counts what arrives against that one: it sends the next only
once the server ended the last; a request it ended itself (a fence, or taken for lost)
is waited out before anything pulls the partition again (`_outlast_fenced`,
`_lost_expires`); and it pulls nothing while NATS is away (nats-py would buffer the
request and send it on reconnecting, beside the ones sent after it). Statuses do tell
requests apart: each request has a reply subject of its own, so an old request's 408
cannot end a newer one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from enum import Enum
from typing import TYPE_CHECKING, Any

from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from shoal.clients.nats import round_trip
from shoal.clients.natsclient import Delivery
from shoal.consumer.alarm import Alarm
from shoal.consumer.dispatch import NAKED, SETTLED, Held, ProjectQueue
from shoal.consumer.handlers import Fenced
from shoal.consumer.holding import PARTITION_HOLD_SECONDS, HoldBudget
from shoal.consumer.progress import Progress
from shoal.consumer.pull import PullRequest, RequestWatch
from shoal.consumer.restart import restart_sequence
from shoal.consumer.takeover import MARGIN_SECONDS, MAX_EXTENSIONS, Gate, describe
from shoal.contracts.names import PROJECT_HEADER, durable_name, partition_for, partition_subject
from shoal.group.jetstream import ack_floor, consumer_config

if TYPE_CHECKING:
    from shoal.consumer.worker import Worker

__all__ = [
    "IDLE_BATCH",
    "PULL_FLOOR",
    "PartitionRunner",
    "Phase",
    "ack_fields",
]

log = logging.getLogger(__name__)

# JetStream's error for a create that would change an existing durable's start.
DELIVER_POLICY_UNCHANGEABLE = 10012

# Pulls nobody answers (503: the durable or the stream is gone): first and longest wait.
MISSING_DURABLE_BACKOFF = 0.25
MISSING_DURABLE_BACKOFF_MAX = 2.0
# Unanswered pulls in a row (about 2 s with the backoff) before the durable is recreated.
RECREATE_AFTER_SILENT_PULLS = 4
# What an idle partition's pull asks for; doubled while pulls come back full.
IDLE_BATCH = 4
# A pull that came back full within this long found a backlog: the next asks for all the
# partition may hold, not twice as much.
BACKLOG_PULL_SECONDS = 0.02
# The least a busy partition may hold (fetch_batch if smaller), however slowly it settles.
PULL_FLOOR = 64
# How long handlers cancelled by abort() may take to stop before it becomes a fence.
ABORT_GRACE = 5.0
# Empty pulls in a row (fetch_expires each) after which a partition dozes (Alarm).
DOZE_AFTER_EMPTY_PULLS = 3
# How long after a request's expiry its end (a 408) may still be on its way to us (read
# late by a busy member, or over a cluster's routes): a request we ended ourselves
# counts as open on the server until it has come, or until then.
SERVER_END_MARGIN = 1.0
# How long a fenced runner waits for one round trip (the proof that the server read its
# pulls, _until_the_server_read_ours) before it looks at the connection again and asks anew.
FENCE_FLUSH_TIMEOUT = 1.0
PROJECT_HEADER_BYTES = PROJECT_HEADER.encode()


def ack_fields(reply: str) -> tuple[str, int, int]:
    """(consumer, stream sequence, delivery count) from a JetStream reply subject.

    $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>,
    or the longer v2 form with a domain and an account hash after ACK. nats-py's
    Msg.metadata parses every field, a datetime included, on each message; the hot path
    needs these three.
    """
    tokens = reply.split(".")
    if len(tokens) == 9:
        return tokens[3], int(tokens[5]), int(tokens[4])
    return tokens[5], int(tokens[7]), int(tokens[6])


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Phase(Enum):
    """Where a partition is in its life on this member (PartitionRunner.phase).

    Before a runner exists the worker claims the partition; after it, the claim is
    deleted, its deletion retried, or left for handlers still stopping (the worker's
    record of the partition: ownership.Stage). A stall (progress.py) is not a phase: a
    partition stalls in any of them, and the stall check says so.
    """

    CONSUMING = "consuming"  # pulling, or waiting for room to pull
    DOZING = "dozing"  # nothing outstanding: no pull open, the alarm armed (alarm.py)
    # The group is paused: no new pull, nothing new starts; the open pull and the running
    # handlers end, then what was fetched and not started is given back (_pause).
    PAUSING = "pausing"
    PAUSED = "paused"  # holds nothing, pulls nothing; keeps its claim, so resuming is instant
    STOPPING = "stopping"  # told to let go: no new pull; the open one and handlers end
    GIVING_BACK = "giving back"  # naking what was fetched and not started, in order
    FENCED = "fenced"  # stopped at once: handlers cancelled, nothing given back
    RELEASED = "released"  # its claim deleted (or, fenced, left to the lease)


# Every move a runner may make; any other is a bug of ours, logged and refused.
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.CONSUMING: frozenset({Phase.DOZING, Phase.PAUSING, Phase.STOPPING, Phase.FENCED}),
    Phase.DOZING: frozenset({Phase.CONSUMING, Phase.PAUSING, Phase.STOPPING, Phase.FENCED}),
    Phase.PAUSING: frozenset({Phase.PAUSED, Phase.STOPPING, Phase.FENCED}),
    Phase.PAUSED: frozenset({Phase.CONSUMING, Phase.STOPPING, Phase.FENCED}),
    Phase.STOPPING: frozenset({Phase.GIVING_BACK, Phase.FENCED, Phase.RELEASED}),
    Phase.GIVING_BACK: frozenset({Phase.FENCED, Phase.RELEASED}),
    Phase.FENCED: frozenset({Phase.RELEASED}),
    Phase.RELEASED: frozenset(),
}
# The phases of letting the partition go (PartitionRunner.letting_go).
_LETTING_GO = frozenset({Phase.STOPPING, Phase.GIVING_BACK, Phase.FENCED, Phase.RELEASED})


class PartitionRunner:
    """Pulls one partition's durable into the dispatcher, and lets it go when told.

    Its life is `phase` (Phase), changed in one place (`_enter`), each change logged at
    debug level; `stopping`, `fenced` and `dozing` are read on the hot path and follow it,
    and `letting_go` by the worker.
    """

    def __init__(
        self,
        worker: Worker,
        partition: int,
        claim_revision: int,
        target_ts: float | None,
        *,
        fresh_claim: bool = False,
    ):
        self.worker = worker
        self.partition = partition
        self.claim_revision = claim_revision
        # Whether we created claim_revision just now (else: a runner of ours ran under it
        # before and was fenced): only then can the last hand-over tell us it was orderly.
        self.fresh_claim = fresh_claim
        self.target_ts = target_ts
        self.phase = Phase.CONSUMING
        # No new pull, nothing new starts: letting go (STOPPING or later), or paused
        # (PAUSING, PAUSED). Read by the dispatcher and deliver(), as it always was.
        self.stopping = False
        self.letting_go = False  # STOPPING or later: the worker's "is it stopping?"
        self.fenced = False  # FENCED (and then RELEASED)
        self.first_message_seen = False
        self.stop_requested_at = 0.0
        self.abort_by = 0.0  # abort(): when cancelled handlers must have stopped
        self.task: asyncio.Task[None] | None = None
        # dispatch.Source: the held messages of each project, and how many run now.
        self.projects: dict[str, ProjectQueue] = {}
        self.inflight = 0
        self.buffered = 0  # held messages (queued, running, or waiting for a retry)
        self.processed = 0
        self.attempts_ended = 0  # handler runs that failed and will be retried in place
        self.retry_until = 0.0  # (monotonic) the latest retry in place is due then
        # Messages that arrived after the stop: given back once no request is open.
        self._late: list[Any] = []
        self._want = IDLE_BATCH  # what the next pull asks for, at most
        # What this partition may hold: half a second of its own settle rate (holding.py).
        self.hold = HoldBudget(worker.config.fetch_batch, hold_seconds=PARTITION_HOLD_SECONDS)
        self._floor = min(PULL_FLOOR, worker.config.fetch_batch)
        self._cap = self._floor
        self.request: PullRequest | None = None  # the open pull request, if any
        # Requests we ended ourselves (fenced, taken for lost) that the server may not
        # have ended yet: their inboxes stay ours until it has (see the module docstring).
        self._unfinished: list[PullRequest] = []
        # A request was taken for lost with the connection: nats-py may have sent it only
        # on reconnecting, so it may be open until `expires` after that (its expires here).
        self._lost_expires = 0.0
        self._quiet_until = 0.0  # (monotonic) no pull before then: see _lost_expires
        self._wakeup: asyncio.Future[None] | None = None
        self.arrived = 0  # messages delivered to our pull requests
        self.answered = 0  # pull requests the server ended with its batch, or with nothing
        # num_pending + num_ack_pending of the durable, as last read (runtime's lag loop).
        self.server_lag = 0
        # Where the durable was, for recreating it where it was if it is deleted under
        # us (restart.py): its ack floor as last read from its info (None: not read),
        # and the highest stream sequence delivered to us.
        self.ack_floor: int | None = None
        self.delivered_high = 0
        # After such a recreate: the new durable delivers again what the old one had
        # delivered up to this sequence; of those, what we settled is acked again
        # (settled.py) and what we still hold is ignored until it leaves our hands
        # (settled: acked, dead-lettered or naked; or given back).
        self._replay_until = 0
        self._held_at_restart: set[int] = set()
        self.progress = Progress()  # the stall check's (Worker.check_stalls)
        # Worker.stream_epoch when what this runner holds was delivered: another one
        # means those deliveries were of a stream since deleted (_recreate_durable).
        self.stream_epoch = worker.stream_epoch
        # Credits of messages given back to this partition by earlier owners and not
        # delivered to us yet (stream sequence -> credit: dispatch.Held.credit), read from
        # the hand-over record when we start; what we give back, with its new credits,
        # when we stop (`handback`, written with the claim's deletion: Worker.runner_done).
        self.credits: dict[int, int] = {}
        # None: what we held could not be given back (NATS away, the naks failed), so the
        # hand-over is not orderly: the release writes no record, and the next owner
        # waits for our deliveries (takeover.py) instead of taking it for orderly.
        self.handback: dict[int, int] | None = {}
        self.gave_up_a_request = False  # a pull taken for lost (RequestWatch)
        # Taken over with earlier deliveries outstanding: what arrives waits here until
        # they are back (takeover.py); None otherwise, and once it has opened.
        self.gate: Gate | None = None
        # A counting gate (earlier deliveries we do not know by sequence) was closed
        # before it opened: until a gate opens, or the durable shows none outstanding,
        # a hand-over of ours is not orderly (_give_back).
        self._earlier_unknown = False
        self.dozing = False  # DOZING
        self.roused = False
        self._naked = False  # a message was naked since the last check before dozing
        self.alarm = Alarm(worker.nc, partition_subject(worker.config.subject_prefix, partition))
        # Paused (_pause): the sequences given back, to wait for on resuming; whether the
        # durable must be asked instead (a takeover's gate was closed at the pause, or a
        # give-back failed); what could not be given back yet (NATS away), retried.
        self._resume_wait: set[int] = set()
        self._resume_ask_durable = False
        self._unreturned: list[Held] = []

    # -- dispatch.Source ----------------------------------------------------------------

    def settled(self, held: Held) -> None:
        if self.fenced and self.phase is Phase.RELEASED:
            # A handler deaf to the fence's cancel, finished after runner_done took all
            # this runner held off the member's count: not a second time.
            return
        if self._held_at_restart:
            # Acked (and then in the settled ring) or naked: its next delivery is taken.
            self._held_at_restart.discard(held.seq)
        if held.verdict is not None and held.verdict[0] is NAKED:
            # JetStream sends it again only to a pull, and no publish rings the alarm: a
            # partition that dozed while it held this message must pull until it is back
            # (it waited for the safety sweep, 60 s).
            self._naked = True
            if self.dozing:
                self.rouse()
        self.buffered -= 1
        self.processed += 1
        self.hold.settled()
        w = self.worker
        w.buffered -= 1
        w.holding.settled()
        # Wake the puller only when it could pull now: waking it on every settled
        # message, to find its buffer still more than half full, cost a fifth of a
        # busy member's CPU.
        if self._wakeup is not None and self._room() > 0:
            self._wake()
        if w.starved:
            w.wake_starved()

    def went_idle(self) -> None:
        self._wake()
        if self.fenced:
            # The worker may be waiting for these handlers to stop before it starts the
            # partition again or releases its claim (Worker._reconcile).
            self.worker.poke()

    # -- control --------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._wakeup is not None:
            _resolve(self._wakeup)

    async def sleep_until_woken(self, timeout: float) -> None:
        """Until _wake(), or `timeout` (a safety net; asyncio.wait_for costs more)."""
        loop = asyncio.get_running_loop()
        self._wakeup = waiter = loop.create_future()
        timer = loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._wakeup = None

    def _enter(self, phase: Phase) -> bool:
        """Move to `phase`, if that is a move its life allows; True if it moved."""
        if phase is self.phase:
            return False
        if phase not in _NEXT[self.phase]:
            log.warning(
                "Partition %d: no move from %s to %s (a bug); staying %s",
                self.partition,
                self.phase.value,
                phase.value,
                self.phase.value,
            )
            return False
        log.debug("Partition %d: %s -> %s", self.partition, self.phase.value, phase.value)
        self.phase = phase
        self.dozing = phase is Phase.DOZING
        self.stopping = phase not in (Phase.CONSUMING, Phase.DOZING)
        self.letting_go = phase in _LETTING_GO
        self.fenced = self.fenced or phase is Phase.FENCED
        return True

    def stop(self) -> None:
        if self.letting_go:
            return
        self._enter(Phase.STOPPING)
        self.stop_requested_at = time.monotonic()
        self._wake()

    def abort(self) -> None:
        """Let go now, and in order: cancel the running handlers (their messages stay at
        the head of their projects), then the usual hand-over gives everything back in
        stream order once the open pull has ended. For a partition moved away because it
        stalled: whatever its handlers wait on may never come. (A fence gives nothing back,
        so its messages return only after ack_wait, behind newer ones of their projects.)
        Handlers that ignore the cancel for ABORT_GRACE make it a fence after all."""
        if self.letting_go:
            return
        self.stop()
        self.abort_by = time.monotonic() + ABORT_GRACE
        cancelled = self.worker.dispatcher.cancel_running(self)
        log.warning(
            "Partition %d: letting go at once, %d running handler(s) cancelled",
            self.partition,
            cancelled,
        )

    def pause(self) -> None:
        """The group is paused (Worker.set_paused): nothing new starts from now on, and
        the pull loop does the rest (_pause) once its open pull has ended."""
        if self.phase is Phase.CONSUMING or self.phase is Phase.DOZING:
            self._enter(Phase.PAUSING)
            self._wake()

    def resume(self) -> None:
        """The group runs again: a paused runner pulls at once (_pause reads the worker's
        flag; one still pausing finishes its give-back first)."""
        self._wake()

    def durable_reset(self) -> None:
        """The durable was recreated at a new position (`shoal-consumer reset`, while the
        group is paused, Worker.follow_reset): what the runner remembers of the old
        one's deliveries means nothing now. The sequences it gave back when it paused
        may never come again (a reset to the end), so resuming must not wait for them;
        credits are of deliveries the new durable never made, and where the old one
        was is no place for recreating this one."""
        self.credits.clear()
        self.ack_floor = None
        self.delivered_high = 0
        self._replay_until = 0
        self._held_at_restart.clear()
        self._resume_wait.clear()
        self._resume_ask_durable = False
        self._late.clear()
        self._unreturned = []

    def released(self) -> None:
        """Its claim is deleted, or left to the lease (Worker.runner_done)."""
        self._enter(Phase.RELEASED)

    def fence(self) -> None:
        if not self._enter(Phase.FENCED):
            return
        # Handlers still running must stop now, not when they are done: fencing happens
        # fence_margin before our lease can expire, and once it has, the next owner
        # starts the partition. Left running, a handler would overlap with it, and the
        # in-progress acks would keep JetStream from redelivering its message (so the
        # next owner would also start on the later messages first). Cancelled, each
        # stops at its next await; its message is redelivered after ack_wait.
        cancelled = self.worker.dispatcher.cancel_running(self)
        if cancelled:
            log.warning(
                "Fenced: cancelled %d handler(s) running on partition %d",
                cancelled,
                self.partition,
            )
        self._wake()
        if self.request is not None:
            self.request.finish("fenced")

    # -- pulling --------------------------------------------------------------------------

    def _room(self) -> int:
        """How many messages the next pull asks for.

        The member never holds, or has asked for, more than max_buffered messages:
        what it holds runs its ack_wait on the server while it waits its turn, so holding
        more than it can start soon means redeliveries, i.e. duplicates. A partition
        asks for `_want`: a few while it is idle (its pulls stay open and reserve their
        batch, so big idle pulls would starve busy partitions), twice as many each time
        a pull comes back full, up to what it may hold (`_cap`). It asks again once half
        of its buffer is free (or it is empty), so a busy partition pulls in batches, not
        one request per settled message.
        """
        w = self.worker
        batch = self._cap
        room = min(self._want, batch - self.buffered, w.budget() - w.buffered - w.reserved)
        if self.gate is not None:
            # What a closed gate waits for comes only with pulls (takeover.py).
            return max(room, self.gate.wanted())
        if self.buffered and room < max(1, min(self._want, batch) // 2):
            return 0
        return room

    async def run(self) -> None:
        w = self.worker
        api = w.config.nats_js_api_prefix
        api_subject = f"{api}.CONSUMER.MSG.NEXT.{w.config.stream}.{durable_name(self.partition)}"
        try:
            # Inside the try: whatever fails from here on still ends in runner_done,
            # which lets the claim go. (A runner that died before it left its claim
            # held on a live lease, and its partition consumed by nobody.)
            self.credits = w.view.handback_credits(self.partition)
            if self.credits:
                await self._forget_acked_credits()
            if self.fresh_claim and w.view.handed_over_cleanly(self.partition):
                # Given back in order, but queued for redelivery in the order of the naks
                # (takeover.py): hold what arrives until every given-back message has.
                self._gate_given_back()
            elif w.config.order_after_failure == "Strict":
                # Not given back in order (or resumed after a fence of ours): the durable
                # may have deliveries outstanding.
                await self._gate_earlier_deliveries()
            backoff = MISSING_DURABLE_BACKOFF
            silent = 0  # pulls in a row that nobody answered (503)
            empty = 0  # pulls in a row that ended with nothing (404/408)
            while not self.letting_go:
                if self.phase is Phase.PAUSING:
                    await self._pause()
                    continue
                # A partition that settles fast holds more, so that its pulls bring more
                # each: every pull costs the server about as much as a message or two,
                # and a noop member's 32-message pulls cost it a microsecond per message
                # more than a plain reader's 256. A slow one keeps PULL_FLOOR, so the
                # member's budget is not taken by a few partitions while others starve.
                now = time.monotonic()
                if self._lost_expires and w.nc.is_connected:
                    # (Not before the connection is back: the request may go out then.)
                    self._quiet_until = now + self._lost_expires + SERVER_END_MARGIN
                    self._lost_expires = 0.0
                if now < self._quiet_until:
                    # A request taken for lost may still be open: what it brings meanwhile
                    # is held as usual, and counted against no request of ours.
                    await self.sleep_until_woken(self._quiet_until - now)
                    continue
                self._cap = self.hold.limit(self._floor, now)
                room = self._room()
                if room <= 0:
                    # Full: wait until the dispatcher settles some of ours (or, when the
                    # whole member is full, anyone's).
                    if self.buffered < self._cap:
                        w.starved[self] = None
                    await self.sleep_until_woken(1.0)
                    w.starved.pop(self, None)
                    continue
                sent = time.monotonic()
                status, got = await self._pull(api_subject, room)
                if status == "batch":
                    if time.monotonic() - sent < BACKLOG_PULL_SECONDS:
                        # Full at once: a backlog waits. Doubling from IDLE_BATCH took
                        # six pulls per partition to reach 256, most of a 390-message
                        # share of a 50,000-message backlog.
                        self._want = w.config.fetch_batch
                    else:
                        self._want = min(self._want * 2, w.config.fetch_batch)
                elif status in ("404", "408"):
                    self._want = IDLE_BATCH
                if status == "unsent":
                    # NATS is away: nothing was asked for. Try again after a backoff (the
                    # worker wakes us when the connection is back: check_connection).
                    await self.sleep_until_woken(backoff)
                    backoff = min(backoff * 2, MISSING_DURABLE_BACKOFF_MAX)
                    continue
                if status == "503":
                    # Nobody answers pulls on this durable: it (or the stream) was
                    # deleted, or its leader is being elected (a cluster node died), or
                    # JetStream is away. Asking again at once is a busy loop of requests:
                    # back off, and recreate the durable only once it has stayed silent
                    # for a while (an election takes seconds; a create sent meanwhile
                    # only times out, and would stretch the backoff).
                    silent += 1
                    started = asyncio.get_running_loop().time()
                    if silent >= RECREATE_AFTER_SILENT_PULLS and await self._recreate_durable():
                        # JetStream answered the create, so the durable exists now: pull
                        # at once. (Sleeping out the backoff here added 2 s to every
                        # resume after a lone server's restart, which loses the durables
                        # whose state is in memory.)
                        silent, backoff = 0, MISSING_DURABLE_BACKOFF
                        continue
                    # The recreate's own wait (up to its 2 s timeout while JetStream
                    # elects leaders) counts toward the backoff: once JetStream answers
                    # again, the next pull comes within the backoff, not the backoff plus
                    # that timeout (a 3-node cluster's partition resumed 16 s after a
                    # node died instead of the others' 8-12 s).
                    elapsed = asyncio.get_running_loop().time() - started
                    await asyncio.sleep(max(0.0, backoff - elapsed))
                    backoff = min(backoff * 2, MISSING_DURABLE_BACKOFF_MAX)
                    continue
                silent = 0
                backoff = MISSING_DURABLE_BACKOFF
                if w.unsent_pulls and status not in ("lost", "fenced"):
                    # (Answered by the server: a lost request was only buffered.)
                    log.warning(
                        "Pull requests flow again (%d could not be sent meanwhile)",
                        w.unsent_pulls,
                    )
                    w.unsent_pulls = 0
                if status == "409":
                    await asyncio.sleep(0.1)
                if got or status not in ("404", "408"):
                    empty = 0
                    if self.alarm.armed:
                        await self.alarm.disarm()
                    continue
                empty += 1
                if w.brisk():
                    # Partitions are about to move: no doze step. Brisk pulls come back
                    # empty often, and a doze's pulls while the alarm is armed wait out
                    # the full fetch_expires, so a partition caught in one was released
                    # up to 0.3 s after its stop (most of a join's hand-over tail). A
                    # step begun already is undone; the partition dozes afterwards.
                    if self.alarm.armed:
                        await self.alarm.disarm()
                elif empty >= DOZE_AFTER_EMPTY_PULLS and not self.stopping:
                    empty = await self._doze_step()
        except Fenced:
            pass
        except Exception:
            if not self.letting_go:
                log.exception("Partition %d consumer failed; releasing it", self.partition)
                self.stop()
                await asyncio.sleep(1.0)  # no tight loop while e.g. NATS is away
        try:
            self._close_gate()
            await self.alarm.disarm()
            if self.fenced:
                # The worker says so once for all of them (one line per partition was
                # 64 lines at once on a member of a group of two).
                log.debug("Fenced: stopped consuming partition %d at once", self.partition)
                await self._outlast_fenced()
            else:
                await self._hand_back()
        finally:
            for request in self._unfinished:
                w.forget_inbox(request.inbox)
            self._unfinished = []
            await w.runner_done(self)

    async def _pull(self, api_subject: str, room: int) -> tuple[str, int]:
        """Send one pull request for up to `room` messages and wait for its end.

        Returns how it ended ("batch", a status such as "408", "lost", "fenced" or
        "unsent") and how many messages it brought.
        """
        w = self.worker
        if not w.nc.is_connected:
            # Published now, it would wait in nats-py's reconnect buffer with every other
            # pull sent meanwhile (each taken for lost after its expiry, and asked again),
            # all going out live on reconnecting, each sized as if it were the only one:
            # the member then held far more than its budget.
            self._unsent("NATS is away")
            return "unsent", 0
        self._forget_finished()
        loop = asyncio.get_running_loop()
        # The pull that confirms a doze (the alarm armed) waits the full fetch_expires for
        # what was published just before the alarm's subscription to reach the stream.
        expires = w.config.fetch_expires if self.alarm.armed else w.pull_expires()
        arrived = self.arrived
        payload = json.dumps({"batch": room, "expires": int(expires * 1e9)}).encode()
        self.request = request = PullRequest(w, room, expires)
        inbox = w.inbox_for(self, request)
        watch: RequestWatch | None = None
        try:
            try:
                await w.nc.publish(api_subject, payload, reply=inbox)
            except Exception as exc:
                self._unsent(repr(exc))
                request.over = True  # (never sent)
                return "unsent", 0
            request.due = time.monotonic() + expires
            # The request ends with its batch, or a status; bounded in case the status
            # was lost with a connection or a server.
            watch = RequestWatch(loop, w.nc, request.end, expires, w.answers)
            status = await request.end
            if status != "lost":
                watch.ended(status)
                if status in ("batch", "404", "408"):
                    self.answered += 1
            else:
                self.gave_up_a_request = True
                if not w.nc.is_connected or w.nc.stats.get("reconnects", 0) != watch.reconnects:
                    # Lost with the connection: written from nats-py's buffer only on
                    # reconnecting, it would be open until `expires` after that.
                    self._lost_expires = max(self._lost_expires, expires)
        finally:
            if watch is not None:
                watch.cancel()
            self.request = None
            request.close()
            if request.over:
                w.forget_inbox(inbox)
            else:  # ended by us (fenced, lost): the server may still answer it
                self._unfinished.append(request)
        return status, self.arrived - arrived

    def _forget_finished(self) -> None:
        """Let go of the inboxes of requests we ended that the server has ended too, or
        must have by now."""
        if not self._unfinished:
            return
        w = self.worker
        late = time.monotonic() - RequestWatch.GIVE_UP_AFTER
        unfinished = []
        for request in self._unfinished:
            if request.over or request.due < late:
                w.forget_inbox(request.inbox)
            else:
                unfinished.append(request)
        self._unfinished = unfinished

    def _unsent(self, why: str) -> None:
        """A pull request could not be sent; say so once per outage (the worker keeps
        the count), not once per partition and retry."""
        w = self.worker
        if not w.unsent_pulls:
            log.warning("Could not send pull requests (%s); retrying with a backoff", why)
        w.unsent_pulls += 1

    # -- dozing ---------------------------------------------------------------------------

    async def _doze_step(self) -> int:
        """The partition's pulls keep coming back empty: stop pulling, if that is safe,
        until a message is published to it. Returns the new count of empty pulls.

        Steps, one per call (the caller pulls in between):
          1. arm the alarm (a core subscription to the partition's subject), then check
             that the durable has nothing for us: nothing pending, and nothing unacked
             but what we hold (a crashed owner's unacked messages come back after
             ack_wait, with no publish to wake us). Then one more pull, sent after the
             subscription: it catches what was published just before it;
          2. that pull came back empty too: doze until the alarm rings, the runner is
             stopped, the connection was lost, or a safety sweep is due.
        """
        if self._naked:
            # Check the durable again: the naked message is outstanding until it is
            # redelivered, so the partition keeps pulling until then.
            self._naked = False
            if self.alarm.armed:
                await self.alarm.disarm()
        if not self.alarm.armed:
            await self.alarm.arm()
            if not await self._nothing_outstanding():
                await self.alarm.disarm()
                return 0
            return DOZE_AFTER_EMPTY_PULLS - 1  # one more (confirming) pull, then doze
        rang = await self._doze(self.worker.config.doze_sweep)
        if rang:
            await self.alarm.disarm()
            return 0
        return DOZE_AFTER_EMPTY_PULLS - 1  # a sweep: one pull, still armed, then doze

    async def _doze(self, sweep: float) -> bool:
        """Until the alarm rings (True), or the runner stops, is roused (the connection
        dropped, and what was published meanwhile rang nothing; or its durable or the
        stream was deleted), or `sweep` seconds passed (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + sweep
        if not self._enter(Phase.DOZING):
            return False  # stopping already
        self.roused = False
        self.alarm.on_ring(self._wake)
        try:
            while not self.alarm.rang and not self.stopping and not self.roused:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                await self.sleep_until_woken(left)
            return self.alarm.rang
        finally:
            if self.phase is Phase.DOZING:
                self._enter(Phase.CONSUMING)

    def has_work(self) -> bool:
        """Messages held, or pending in the durable as last read (that, not while dozing:
        a partition dozes only once nothing is outstanding on the server; what it holds
        still counts, since it may doze holding a handler that never ends). Paused, it
        has none by design: it holds nothing, and what waits on the server waits for the
        resume, so the stall check must not count it (PAUSING still does: its handlers
        run)."""
        if self.phase is Phase.PAUSED:
            return False
        return self.buffered > 0 or (not self.dozing and self.server_lag > 0)

    def progress_mark(self) -> tuple[int, int, int]:
        """The counters that move with progress (Worker.check_stalls). Holding messages,
        only their handlers' ends count: a pull answered with nothing is no progress
        for a message that never finishes, and a partition with room pulls on (every
        few seconds while it holds a message whose handler hangs, then dozing)."""
        if self.buffered > 0:
            return (self.processed, self.attempts_ended, -1)
        return (self.arrived, self.answered, self.processed)

    def waits_deliberately(self, now: float) -> bool:
        """Whether what it holds waits for something bounded on purpose: a retry in place
        (the backoff, or an HTTP Retry-After, may exceed stall_after), or the takeover
        gate (earlier deliveries, at most ack_wait)."""
        return self.retry_until > now or self.gate is not None

    def waiting_on(self) -> str:
        """What the partition is waiting for, in words (for the stall's log line)."""
        w = self.worker
        if self.fenced:
            return "nothing: it is fenced"
        if self.phase is Phase.PAUSING:
            return f"the pause ({self.inflight} handler(s) still running)"
        if self.phase is Phase.PAUSED:
            return "nothing: the group is paused"
        if self.stopping:
            return f"its hand-over ({self.inflight} handler(s) still running)"
        if w.unsent_pulls:
            return "NATS: pull requests cannot be sent"
        if self.request is not None:
            return "the answer to an open pull request"
        if self.inflight:
            return f"{self.inflight} running handler(s), {self.buffered} message(s) held"
        if self.buffered:
            return f"a dispatch lane for {self.buffered} held message(s)"
        room = w.budget() - w.buffered - w.reserved
        return (
            f"room to pull (the member's pull budget has {room}; {w.buffered} held, "
            f"{w.reserved} asked for)"
        )

    def rouse(self) -> None:
        """Pull again now, although the alarm did not ring (see Worker.check_connection
        and Worker._on_deleted)."""
        self.roused = True
        self._wake()

    async def _nothing_outstanding(self) -> bool:
        w = self.worker
        try:
            info = await w.js.consumer_info(
                w.config.stream, durable_name(self.partition), timeout=2
            )
        except Exception as exc:
            log.debug("Partition %d: no consumer info (%r); not dozing", self.partition, exc)
            return False
        self.ack_floor = ack_floor(info)
        # Our held messages are unacked on the server, so they count in num_ack_pending;
        # anything beyond them is someone else's, or an ack of ours not applied yet.
        return not info.num_pending and (info.num_ack_pending or 0) <= self.buffered

    def deliver_status(self, headers: dict[str, str], request: PullRequest) -> None:
        """A status (no reply subject, nothing to ack) arrived for `request`, one of ours
        (by its own reply subject: Worker.receive_status): 100 is an idle heartbeat;
        anything else is the server's end of it (404/408: nothing more; 409: the server
        ended it, e.g. a leader change; 503: no JetStream answers). It ends that request
        only: one we ended already (fenced, taken for lost) is merely over now."""
        status = headers.get("Status", "")
        if status == "100":
            return
        if status not in ("404", "408"):
            log.debug(
                "Pull on partition %d ended: %s %s",
                self.partition,
                status,
                headers.get("Description", ""),
            )
        request.over = True
        request.finish(status or "?")
        if self.fenced:
            self._wake()  # _outlast_fenced waits for it

    def deliver(self, msg: Delivery, seq: int, delivered: int) -> str | None:
        """A message arrived for our pull requests (its stream sequence and delivery count
        parsed already): hold it for the dispatcher. Returns why it must be dead-lettered
        instead, if it must (the caller awaits that; this is not a coroutine, as it runs
        once per message)."""
        self.arrived += 1
        if seq > self.delivered_high:
            self.delivered_high = seq
        # Ours, then: the partition's only request open on the server (see the module
        # docstring); None between requests, when all that can come is what a request
        # we ended ourselves still brings.
        request = self.request
        if request is not None and request.remaining:
            # PullRequest.arrived(), inline: this runs once per message.
            request.remaining -= 1
            self.worker.reserved -= 1
            if not request.remaining:
                request.over = True
                request.finish("batch")
        if self.stopping:
            # Given back with the rest (_hand_back), or once the requests a fence ended
            # are over (_outlast_fenced).
            self._late.append(msg)
            return None
        if self.gate is not None:
            self.gate.hold(msg, seq, delivered)
            self.worker.buffered += 1  # the member's budget counts them; ours does not
            if self.gate.complete():
                self._let_in("all back")
            return None
        return self._accept(msg, seq, delivered)

    def _accept(self, msg: Delivery, seq: int, delivered: int) -> str | None:
        """deliver()'s second half: check the message and hold it for the dispatcher."""
        w = self.worker
        # Taken whatever becomes of the message (resettled, refused), or it would stay,
        # and be passed on in our own hand-over record (_give_back).
        credit = self.credits.pop(seq, 0) if self.credits else 0
        if (delivered > 1 or seq <= self._replay_until) and seq in w.settled_seqs:
            w.resettle(self, msg, seq)  # handled here already: its ack came late, or not
            return None
        if seq <= self._replay_until and seq in self._held_at_restart:
            # Held since before the durable was recreated: it runs (or ran) once, and
            # the new durable, which gets no ack for this delivery, sends it again
            # after ack_wait, when the line above acks it.
            return None
        project = msg.header(PROJECT_HEADER_BYTES)
        if not project:
            return "missing Shoal-Project-Id header"
        if not w.belongs(project, self.partition):
            return (
                f"project {project!r} belongs to partition "
                f"{partition_for(project, w.config.partitions)}"
            )
        if delivered > 1 and (queue := self.projects.get(project)) is not None:
            for held in queue.pending:
                if held.seq == seq:
                    # JetStream sent again what we hold (running, or waiting its turn):
                    # its ack_wait ran out between two in-progress acks (the durable's
                    # ackWaitSeconds lowered under running members: they keep messages
                    # alive at the old pace until their pods roll). One run, settled on
                    # the newest delivery, which is the one JetStream now waits on.
                    held.msg = msg
                    held.kept = time.monotonic()
                    return None
        self.buffered += 1
        w.buffered += 1
        held = Held(msg, project, seq, delivered, time.monotonic())
        held.credit = credit
        w.dispatcher.submit(self, held)
        return None

    # -- taking over ----------------------------------------------------------------------

    def _gate_given_back(self) -> None:
        """Before the first pull after an orderly hand-over: hold what arrives until the
        messages it gave back (its record's sequences, our credits) are all here."""
        w = self.worker
        self.gate = Gate.for_given_back(self.credits, w.config.ack_wait)
        if self.gate is not None:
            log.debug(
                "Partition %d: %d message(s) given back to us; holding what arrives until "
                "they are all here",
                self.partition,
                self.gate.outstanding,
            )
            w.spawn(self._watch_gate(self.gate))

    async def _forget_acked_credits(self) -> None:
        """Drop the credits of messages the durable has acked (at or below its ack
        floor). A hand-over record outlives its hand-over when the next owner crashed or
        was fenced: it is kept, as its credits still count for what was given back and
        not yet run, but the rest were run and acked, and never come again. Kept, the
        next owner would hold its first messages waiting for them (takeover.Gate), and
        write them into its own record for the owner after it, each crash adding more."""
        w = self.worker
        try:
            info = await w.js.consumer_info(
                w.config.stream, durable_name(self.partition), timeout=2.0
            )
        except Exception as exc:  # keep them: a gate that waits for one is bounded
            log.debug("Partition %d: no consumer info for its credits (%r)", self.partition, exc)
            return
        floor = int(info.ack_floor.stream_seq or 0)
        self.credits = {seq: credit for seq, credit in self.credits.items() if seq > floor}

    async def _gate_earlier_deliveries(self) -> None:
        """Before the first pull: if the durable has deliveries outstanding (an earlier
        owner's, not given back), hold what arrives until they are back (takeover.py).

        The read often fails exactly when a takeover happens (JetStream under load, its
        consumer leader being elected again after a node died): under Strict it is asked
        again, and if the durable never answers within ack_wait (+ the margin), nothing is
        pulled before then, by when whatever was outstanding is back on its redelivery
        queue, which the first pull serves first. (Pulling at once without a gate ran a
        project's newer messages first.) Under Fast, not knowing is no reason to wait."""
        w = self.worker
        strict = w.config.order_after_failure == "Strict"
        started = time.monotonic()
        until = started + w.config.ack_wait + MARGIN_SECONDS
        while True:
            try:
                info = await w.js.consumer_info(
                    w.config.stream, durable_name(self.partition), timeout=2.0
                )
                break
            except Exception as exc:
                # Asked again only what may pass (a timeout, no responders, JetStream
                # unavailable): a durable missing or a permission refused will not.
                passing = not isinstance(exc, APIError) or isinstance(exc, ServiceUnavailableError)
                if not strict or not passing:
                    log.debug(
                        "Partition %d: no consumer info at the start (%r)", self.partition, exc
                    )
                    return
                now = time.monotonic()
                if now >= until or self.letting_go:
                    log.warning(
                        "Partition %d: JetStream did not say for %.0f s what is outstanding on "
                        "its durable (%r); consuming now, as what was is back by then",
                        self.partition,
                        now - started,
                        exc,
                    )
                    return
                log.debug("Partition %d: no consumer info at the start (%r)", self.partition, exc)
                await self.sleep_until_woken(min(0.5, until - now))
        self.gate = Gate.for_durable(
            int(info.num_ack_pending or 0), int(info.delivered.stream_seq or 0), w.config.ack_wait
        )
        if self.gate is None:
            self._earlier_unknown = False  # nothing outstanding elsewhere
        else:
            log.debug(
                "Partition %d: %d earlier deliveries outstanding (up to sequence %d); "
                "holding newer messages until they are back",
                self.partition,
                self.gate.outstanding,
                self.gate.upto,
            )
            w.spawn(self._watch_gate(self.gate))

    async def _watch_gate(self, gate: Gate) -> None:
        """While the gate is closed: keep what it holds alive, open it once the durable
        says nobody else holds a delivery, or once ack_wait has passed."""
        w = self.worker
        durable = durable_name(self.partition)
        period = max(0.2, w.config.ack_wait / 4)
        asked = 0.0
        while self.gate is gate:
            await asyncio.sleep(0.1)
            if self.gate is not gate:
                return
            now = time.monotonic()
            for waiting in gate.due_keeping(now, period):
                try:
                    await waiting.msg.in_progress()
                except Exception:
                    log.debug("In-progress ack failed", exc_info=True)
                    break
            if gate.expired(now):
                if await self._still_held_elsewhere(gate) and gate.extend(w.config.ack_wait, now):
                    log.warning(
                        "Partition %d: deliveries still held elsewhere after ack_wait (kept "
                        "alive late, e.g. by an earlier owner's keep-alives that crossed a "
                        "network gone silent); holding newer messages %.0f s more (%d of %d)",
                        self.partition,
                        gate.deadline - now,
                        gate.extensions,
                        MAX_EXTENSIONS,
                    )
                    continue
                if self.gate is gate:
                    self._let_in("ack_wait passed")
                return
            if now - asked < 0.5:
                continue
            asked = now
            held = len(gate.held)
            try:
                info = await w.js.consumer_info(w.config.stream, durable, timeout=1.0)
            except Exception:
                continue
            if self.gate is gate and gate.nobody_else_holds(int(info.num_ack_pending or 0), held):
                self._let_in("none left elsewhere")

    async def _still_held_elsewhere(self, gate: Gate) -> bool:
        """Whether a fresh read of the durable says someone else still holds deliveries
        (False if it does not answer: the deadline is the bound then)."""
        w = self.worker
        held = len(gate.held)
        try:
            info = await w.js.consumer_info(
                w.config.stream, durable_name(self.partition), timeout=1.0
            )
        except Exception:
            return False
        return not gate.nobody_else_holds(int(info.num_ack_pending or 0), held)

    def _let_in(self, how: str) -> None:
        """Open the gate: what it held goes to the dispatcher in stream order."""
        gate, self.gate = self.gate, None
        if gate is None:
            return
        self._earlier_unknown = False
        now = time.monotonic()
        w = self.worker
        waited = now - gate.started
        w.metrics.takeover_wait_seconds.observe(waited)
        log.log(
            logging.INFO if waited >= 0.5 else logging.DEBUG,
            "Partition %d taken over: %s",
            self.partition,
            describe(gate, how, now),
        )
        held = gate.release()
        w.buffered -= len(held)
        for waiting in held:
            refused = self._accept(waiting.msg, waiting.seq, waiting.delivered)
            if refused is not None:
                w.spawn(w.dead_letter(waiting.msg, self.partition, refused))
        self._wake()

    def _close_gate(self) -> None:
        """Stopping while the gate is closed: what it held is given back with the rest
        (fenced: left to JetStream's redelivery, as anything a fenced runner holds)."""
        gate, self.gate = self.gate, None
        if gate is None:
            return
        if gate.missing() is None:
            # It waited for earlier deliveries it knows only by number: what we give
            # back is not all that is outstanding, so our successor must wait for the
            # durable's deliveries as we did, not take the hand-over for orderly (it
            # would run the given-back messages before the earlier ones come back).
            self._earlier_unknown = True
        held = gate.release()
        self.worker.buffered -= len(held)
        if not self.fenced:
            self._late.extend(waiting.msg for waiting in held)

    # -- letting go -----------------------------------------------------------------------

    async def _hand_back(self) -> None:
        """After the last request ended: let running handlers finish, give back the rest."""
        while self.inflight and not self.fenced:
            if self.abort_by and time.monotonic() >= self.abort_by:
                log.warning(
                    "Partition %d: %d cancelled handler(s) still running %.0f s after the "
                    "abort; fencing it instead (its messages come back after ack_wait)",
                    self.partition,
                    self.inflight,
                    ABORT_GRACE,
                )
                self.fence()
                break
            await self.sleep_until_woken(1.0)
        if self.fenced:
            return
        if self.gave_up_a_request:
            # A message of a request we gave up on (its end status lost) may still come:
            # for a moment, or (lost with the connection) until it has surely expired.
            # (Every other request has ended: nothing more can come for it.)
            now = time.monotonic()
            if self._lost_expires and self.worker.nc.is_connected:
                self._quiet_until = now + self._lost_expires + SERVER_END_MARGIN
                self._lost_expires = 0.0
            await asyncio.sleep(max(0.02, self._quiet_until - now))
        await self._settle_decided()
        drained_at = time.monotonic()
        self._enter(Phase.GIVING_BACK)
        unstarted = self._unstarted(drained_at)
        await self._give_back(unstarted)
        log.debug(
            "Partition %d: handlers done %.0f ms after the stop, %d given back in %.0f ms",
            self.partition,
            1000 * (drained_at - self.stop_requested_at),
            len(unstarted),
            1000 * (time.monotonic() - drained_at),
        )

    async def _settle_decided(self) -> None:
        """Messages whose handler ran (or whose dead letter was decided) but whose ack or
        termination failed wait at the head of their project for a retry of just that.
        Given back, they would run again on the next owner: settle them now, once; only
        what still fails is given back (at-least-once, as before)."""
        w = self.worker
        if not w.nats_reachable():
            return  # it would only time out: they come back after ack_wait, as before
        for queue in list(self.projects.values()):
            if not queue.pending or queue.running:
                continue
            held = queue.pending[0]
            if held.verdict is None or held.verdict[0] is NAKED:
                continue  # never ran (a nak is what giving back does anyway)
            if await w.settle(self, held) is SETTLED:
                queue.pending.popleft()
                self.settled(held)

    def _unstarted(self, now: float) -> list[Held]:
        """What was fetched and not started, in stream order: held in the projects'
        queues, arrived after the stop or the pause (_late), or left over from a pause's
        give-back that failed (_unreturned). Taken from those (the queues stay listed
        until the give-back, which clears them)."""
        unstarted = [held for queue in self.projects.values() for held in queue.pending]
        unstarted.extend(self._unstarted_late(now))
        unstarted.extend(self._unreturned)
        self._unreturned = []
        unstarted.sort(key=lambda held: held.seq)
        for held in unstarted:  # given back now: their next delivery is taken
            self._held_at_restart.discard(held.seq)
        return unstarted

    # -- pausing --------------------------------------------------------------------------

    async def _pause(self) -> None:
        """The group is paused: finish what runs, give back what waits, pull nothing
        until it resumes (or the partition is let go, or fenced). The claim stays ours.

        What was fetched and not started is given back (naked in stream order, the
        last nak a request), not kept alive with in-progress acks:

        - a pause may last hours: kept, those messages would be renewed every quarter
          of ack_wait all along, and a member that dies or is fenced meanwhile would
          leave them to come back only after ack_wait, each such delivery counted as
          an attempt toward maxDeliver, with its successor (orderAfterFailure Strict)
          waiting for them; given back, a paused member holds nothing, its buffer is
          free, and a restart or a move during the pause has nothing outstanding;
        - a pause nak costs no attempt: as in a hand-over, the runner notes each one
          in its credits (dispatch.Held.credit), which go into the hand-over record
          (Keys.handbacks) if the partition moves while paused, so maxDeliver counts
          only handler runs (a member killed while paused loses those notes: one
          delivery counted too many, as keeping them alive would cost after a crash);
        - order after the resume holds: the runner holds what arrives until every
          sequence it gave back is there, then runs them in stream order
          (takeover.Gate.for_given_back, as after a hand-over).

        The price is one more delivery of those messages on resuming (a pull's worth).
        """
        w = self.worker
        started = time.monotonic()
        gate = self.gate
        if gate is not None:
            # Taken over moments ago and still waiting for earlier deliveries: wait for
            # them again after the resume (what the gate held is given back below).
            missing = gate.missing()
            if missing is None:
                self._resume_ask_durable = True
            else:
                self._resume_wait.update(missing)
            self._close_gate()
        if self.alarm.armed:
            await self.alarm.disarm()
        while self.inflight and not self.letting_go:
            await self.sleep_until_woken(1.0)
        if self.letting_go:
            return  # let go meanwhile: its hand-over gives back everything, in order
        await self._settle_decided()
        given = await self._give_back_paused()
        self._enter(Phase.PAUSED)
        w.partition_paused()
        log.debug(
            "Partition %d paused %.0f ms after the pause reached it; %d given back",
            self.partition,
            1000 * (time.monotonic() - started),
            given,
        )
        while w.paused and not self.letting_go:
            await self.sleep_until_woken(1.0)
            if (self._late or self._unreturned) and not self.letting_go:
                # A late message of a request taken for lost, or naks that failed.
                await self._give_back_paused()
        if self.letting_go:
            return
        await self._resume()

    async def _give_back_paused(self) -> int:
        """Give back what the paused runner holds (see _pause); how many went back.
        What cannot be given back now (NATS away) is kept in _unreturned and tried again."""
        w = self.worker
        unstarted = self._unstarted(time.monotonic())
        for queue in self.projects.values():
            # (Cleared, not only forgotten: a retry timer still set on one of them must
            # find nothing to run when it fires after the resume: dispatch._retry_due.)
            queue.pending.clear()
        self.projects.clear()
        w.buffered -= self.buffered
        self.buffered = 0
        if w.starved:
            w.wake_starved()
        if not unstarted:
            return 0
        if not w.nats_reachable() or not await self._flush_naks(unstarted):
            self._unreturned = unstarted
            return 0
        for held in unstarted:
            self.credits[held.seq] = held.credit + 1 - held.failures
            self._resume_wait.add(held.seq)
        return len(unstarted)

    async def _resume(self) -> None:
        """Pull again; what arrives waits until what the pause gave back is all there."""
        w = self.worker
        self._enter(Phase.CONSUMING)
        wait, self._resume_wait = self._resume_wait, set()
        ask_durable, self._resume_ask_durable = self._resume_ask_durable, False
        if self._unreturned:
            # Never given back (NATS was away throughout): unacked and no longer kept
            # alive, they come back after ack_wait.
            self._unreturned = []
            ask_durable = True
        self._want = IDLE_BATCH
        if ask_durable and w.config.order_after_failure == "Strict":
            # The durable's count covers what we gave back too (naked, it is pending).
            await self._gate_earlier_deliveries()
            return
        self.gate = Gate.for_given_back(wait, w.config.ack_wait)
        if self.gate is not None:
            w.spawn(self._watch_gate(self.gate))

    async def _give_back(self, unstarted: list[Held]) -> None:
        """Return fetched but unstarted messages to JetStream, in stream order, for the
        next owner, and note what each delivery was (`handback`): a message given back
        unstarted made no attempt here; one retried in place made `failures` attempts.
        The next owner reads the note (Keys.handbacks), so that hand-overs never use up
        a message's attempts (JetStream counts each nak as a delivery)."""
        w = self.worker
        # Credits we were handed and never used (messages not delivered to us) still hold.
        handback = dict(self.credits)
        # (None: not orderly, see _close_gate; what is unstarted is given back all the same.)
        self.handback = None if self._earlier_unknown else handback
        if not unstarted:
            return
        if not w.nats_reachable():
            # Without NATS a nak request would wait out its timeout on a dead connection;
            # unacked, the messages are redelivered after ack_wait anyway (and those
            # deliveries count as attempts: nothing is noted for them).
            self.handback = None
            return
        # What each round noted: a message given back may come again, to a request of
        # ours still open, and go back once more (each nak counts a delivery): added up.
        given: dict[int, int] = {}
        while unstarted:
            for held in unstarted:
                given[held.seq] = given.get(held.seq, 0) + held.credit + 1 - held.failures
                handback[held.seq] = given[held.seq]
            if not await self._flush_naks(unstarted):
                self.handback = None
                break
            # Late messages of a request we gave up on that came during the naks go back
            # too (not dropped unacked: they would come back after ack_wait, out of order).
            unstarted = self._unstarted_late(time.monotonic())
        self.projects.clear()

    async def _outlast_fenced(self) -> None:
        """Fenced: wait until the server has ended the requests the fence ended here,
        then give back what they brought meanwhile.

        The fence ends the open request here only; on the server it stays open until its
        expiry and delivers to this runner (by durable: Worker.receive). A successor on
        this member (once the lease is renewed the claim is still ours, and the worker
        starts one at once: Worker._reconcile) pulling meanwhile would count that
        request's messages against its own, end its own early and pull again while it
        was still open, until a hand-over released the claim with a request open: the
        next owner then ran the partition's later messages first. So the runner is done
        (Worker.runner_done, after which a successor may start) only once they are over,
        and what they brought is naked, in order, rather than waiting out ack_wait. A
        nak takes nothing from a member that may not consume: nothing is run."""
        w = self.worker
        await self._until_the_server_read_ours()
        while True:
            # (_quiet_until: a request taken for lost with the connection, see _lost_expires.)
            ends = [r.due + SERVER_END_MARGIN for r in self._unfinished if not r.over]
            left = max([self._quiet_until, *ends]) - time.monotonic()
            if left <= 0:
                break
            await self.sleep_until_woken(left)
        late = self._unstarted_late(time.monotonic())
        if late and w.nats_reachable():
            await self._flush_naks(late)

    async def _until_the_server_read_ours(self) -> None:
        """Wait until the server has read the requests a fence ended here, or they died
        with the connection: only then does each end by its expiry (`due`).

        A fence often comes of a network gone silent (etcd and NATS with it) while nats-py
        still counts itself connected: a request written then may reach the server only
        when the network heals, and stay open `expires` from then, beside the successor's.
        A round trip (its answer) proves that the server read everything written before
        it; a reconnect, that what it had not read is gone with the old connection. Bounded
        (RequestWatch.GIVE_UP_AFTER past the last due end): a connection silent that long
        is taken down by NatsHealth, and waiting on would only delay the claim's release."""
        nc = self.worker.nc
        open_ones = [r for r in self._unfinished if not r.over and r.due]
        if not open_ones:
            return
        reconnects = nc.stats.get("reconnects", 0)
        give_up = max(r.due for r in open_ones) + RequestWatch.GIVE_UP_AFTER
        while time.monotonic() < give_up:
            if not nc.is_connected or nc.stats.get("reconnects", 0) != reconnects:
                return
            try:
                await round_trip(nc, FENCE_FLUSH_TIMEOUT)
            except Exception:  # a timeout, or the connection going: look again
                await asyncio.sleep(0.05)
                continue
            # Read by now, perhaps only just (the network healed): the server ends each
            # by its expiry counted from when it read it, at the latest from now.
            read_by = time.monotonic()
            for request in open_ones:
                request.due = max(request.due, read_by + request.expires)
            return

    def _unstarted_late(self, now: float) -> list[Held]:
        """What arrived after the stop or the fence (_late), in stream order; taken."""
        late = []
        for msg in self._late:
            _, seq, delivered = ack_fields(msg.reply)
            held = Held(msg, "", seq, delivered, now)
            held.credit = self.credits.pop(seq, 0)
            self._held_at_restart.discard(seq)
            late.append(held)
        self._late.clear()
        late.sort(key=lambda held: held.seq)
        return late

    async def _flush_naks(self, naks: list[Held]) -> bool:
        """Nak in order; the last one as a request, answered once JetStream applied it.

        JetStream applies acks asynchronously, in the order they arrive: a plain nak can
        still be in its queue when the next owner's first pull arrives, which then gets
        newer messages first. The answer to the last nak means all of them are applied.
        """
        if not naks:
            return True
        nc = self.worker.nc
        try:
            for held in naks[:-1]:
                await nc.publish(held.msg.reply, b"-NAK")
            await nc.request(naks[-1].msg.reply, b"-NAK", timeout=5)
        except Exception:
            log.debug("Giving back messages of partition %d failed", self.partition, exc_info=True)
            return False
        return True

    async def _recreate_durable(self) -> bool:
        """Recreate this partition's durable where the old one was (restart.py), unless
        JetStream objects are not ours to manage or the stream itself is gone. True when
        JetStream confirmed the create, or answered that the durable exists."""
        w = self.worker
        c = w.config
        if not c.ensure_jetstream:
            log.error(
                "No JetStream consumer answers for partition %d (durable %s on stream %s "
                "deleted?); not recreating it (SHOAL_ENSURE_JETSTREAM is off)",
                self.partition,
                durable_name(self.partition),
                c.stream,
            )
            return False
        # The stream itself may be new (deleted and created again): then where the old
        # durable was, and what we hold, are of another stream (Worker.check_stream).
        await w.check_stream()
        if self.stream_epoch != w.stream_epoch:
            self.stream_epoch = w.stream_epoch
            held: set[int] = set()
        else:
            held = {h.seq for queue in self.projects.values() for h in queue.pending}
        config, where = self._recreated_config(held)
        try:
            try:
                await w.js.add_consumer(c.stream, config=config, timeout=2)
            except APIError as exc:
                if exc.err_code != DELIVER_POLICY_UNCHANGEABLE:
                    raise
                # It exists, with a start of its own (a member or the operator made it
                # meanwhile, or JetStream answers again after an election): keep it.
                log.info("The durable of partition %d exists again", self.partition)
                return True
            log.warning(
                "Recreated the missing durable consumer of partition %d (%s)",
                self.partition,
                where,
            )
            self._replay_until = self.delivered_high
            self._held_at_restart = held
            return True
        except NotFoundError:
            # The stream itself is gone, and its messages with it: recreating it is a
            # decision for whoever deleted it (the operator reconciles it). Say so once,
            # and keep backing off.
            if not w.stream_missing_logged:
                w.stream_missing_logged = True
                log.error("Stream %s is missing: nothing to consume until it is back", c.stream)
        except Exception as exc:  # JetStream away, or refusing: the backoff goes on
            log.warning("Could not recreate the durable of partition %d: %r", self.partition, exc)
        return False

    def _recreated_config(self, held: set[int]) -> tuple[api.ConsumerConfig, str]:
        """The config of a recreated durable, and where it starts, in words."""
        c = self.worker.config
        config = consumer_config(c, self.partition)
        if c.retention == "workqueue":
            # The stream holds only what nobody acked: all of it is where the old was.
            return config, "delivering what the work-queue stream still holds"
        start = restart_sequence(self.ack_floor, held, self.delivered_high)
        if start is None:
            log.warning(
                "Partition %d: where its deleted durable was is unknown (no delivery, no "
                "info read yet); the new one delivers the %s stream's messages of the "
                "partition from its start (shoal-consumer reset chooses another place)",
                self.partition,
                c.retention,
            )
            return config, "from the stream's start"
        config = dataclasses.replace(
            config, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
        )
        return config, f"from stream sequence {start}, where the old one was"
