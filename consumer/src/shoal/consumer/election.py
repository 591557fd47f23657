"""Leader election and rebalancing.

Campaign: create `leader` on our lease in a transaction (create_revision == 0). The key's
create_revision is the leader's epoch, a fencing token: every write of the assignment is
a transaction guarded by "leader still has my epoch", so a deposed leader cannot write.

Inaugurate: adopt the assignment already in etcd (a fail-over moves nothing).
Execute: watch members; after a burst of changes settles (debounce), compute `assign()`
and write only the changed partitions/<p>, with the next generation.
Hand over: stop writing the instant leadership or the lease is in doubt; on shutdown
delete the leader key so a successor takes over at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from shoal.assignor import assign, moved, relieve_stalls
from shoal.clients.backoff import QuietLog
from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd
from shoal.consumer.leaseless import (
    LeaselessRemover,
    leaseless_keys,
    leaseless_leader,
    leaseless_member,
)
from shoal.consumer.membership import Membership
from shoal.contracts.values import MemberStats, TargetValue
from shoal.group.config import GroupConfig
from shoal.group.jetstream import partition_list
from shoal.group.view import GroupView, LeaderKey, Target

log = logging.getLogger(__name__)

# How often a leader re-checks the assignment even when no watch event arrived.
RECHECK_SECONDS = 5.0
# Load-aware groups: by how much the busiest member must get lighter to justify moving
# partitions between membership changes (every move pauses its partition briefly). How
# often the leader weighs the loads is config.load_check_interval.
LOAD_GAIN_THRESHOLD = 0.10
# After a scale-up, how long the leader waits for the new members before rebalancing.
SCALE_JOIN_WAIT = 15.0
# Debounce after departures only (_debounce_for).
LEAVE_DEBOUNCE = 0.1
# A member whose stats say it cannot reach NATS ("nats_ok": false) gets no partitions,
# but only while another member has reached NATS for at least this long (at least two
# stats intervals): when NATS as a whole was down, members report its return seconds
# apart, and the first one back must not take every partition for those seconds. The
# same for a member whose HTTP handler accepts no connection ("handler_ok": false).
NATS_STEADY_SECONDS = 5.0
# How long a new leader waits for the members' routine stats before its first
# load-aware assignment (it weighs partitions by them; without, it weighs them evenly).
STATS_SYNC_WAIT = 2.0


@dataclass
class GenerationRecord:
    """One written assignment generation (the analytics log's source)."""

    ts: float
    generation: int
    epoch: int
    leader: str
    reason: str
    members: list[str]
    assignment: dict[int, str]
    moved: list[tuple[int, str, str]]
    loads: dict[int, float] = field(default_factory=dict)


OnGeneration = Callable[[GenerationRecord], Awaitable[None]]


def loads_from_stats(stats: Mapping[str, MemberStats]) -> dict[int, float]:
    """Messages per second of every partition, from the rates the members report.

    A partition two members report (during a hand-over) takes the larger rate (garbage
    entries never get here: MemberStats drops them).
    """
    loads: dict[int, float] = {}
    for data in stats.values():
        for p, rate in data.partition_rates.items():
            loads[p] = max(loads.get(p, 0.0), rate)
    return loads


def max_member_load(assignment: Mapping[int, str], loads: Mapping[int, float]) -> float:
    totals: dict[str, float] = {}
    for p, member in assignment.items():
        totals[member] = totals.get(member, 0.0) + loads.get(p, 0.0)
    return max(totals.values(), default=0.0)


def classify(previous_members: set[str], members: set[str], had_owners: bool, first: bool) -> str:
    if not had_owners:
        return "initial"
    if first:
        return "failover"
    joined, left = members - previous_members, previous_members - members
    if joined and not left:
        return "join"
    if left and not joined:
        return "leave"
    return "rebalance"


class Election:
    def __init__(
        self,
        etcd: Etcd,
        view: GroupView,
        membership: Membership,
        config: GroupConfig,
        *,
        on_generation: OnGeneration | None = None,
        loads: Callable[[], dict[int, float]] | None = None,
    ) -> None:
        self.etcd = etcd
        self.view = view
        self.membership = membership
        self.config = config
        self.on_generation = on_generation
        self.loads = loads
        self.epoch = 0
        self.is_leader = False
        self.rebalances = 0
        self._wrote_at = 0.0  # (monotonic) the last assignment this leader wrote
        # Partition -> (owner, generation, monotonic time) of the targets this term wrote,
        # until the view shows them (_unseen_writes).
        self._written: dict[int, tuple[str, int, float]] = {}
        self.resigning = False
        # Set by the autoscaler: generations until the members number `replicas` (or the
        # deadline passes) are logged with reason "scale".
        self._scale_expected: tuple[int, float] | None = None
        self._on_change: list[Callable[[bool], None]] = []
        # Member -> since when (monotonic) we see it reach NATS; and NATS and its handler
        # both. None while it cannot (_eligible).
        self._nats_since: dict[str, float | None] = {}
        self._able_since: dict[str, float | None] = {}
        # The last _rebalance could not write its assignment (an etcd error): retry it.
        self._write_failed = False
        # While etcd refuses, each retry fails again: one line per 10 s says so.
        self._campaign_failures = QuietLog(log)
        self._write_failures = QuietLog(log)
        self._leaseless = LeaselessRemover(etcd)

    def on_leadership(self, callback: Callable[[bool], None]) -> None:
        self._on_change.append(callback)

    def _set_leader(self, value: bool) -> None:
        if value != self.is_leader:
            self.is_leader = value
            # Only the leader reads the members' routine stats (the autoscaler, load-aware
            # balancing): only it receives their rewrites (Keys.stats).
            self.view.follow_stats(value)
            for callback in self._on_change:
                callback(value)

    def expect_scale(self, replicas: int, until: float) -> None:
        self._scale_expected = (replicas, until)

    def _reason(self, applied: set[str], previous: set[str], members: set[str], first: bool) -> str:
        reason = classify(applied or previous, members, bool(previous), first)
        if self._scale_expected is not None and reason in ("join", "leave", "rebalance"):
            replicas, until = self._scale_expected
            if time.monotonic() < until:
                reason = "scale"
            if len(members) == replicas or time.monotonic() >= until:
                self._scale_expected = None
        return reason

    def _eligible(self) -> set[str]:
        """The members that may own partitions: the live ones, less those cut from NATS
        or from their HTTP handler (stats nats_ok, handler_ok).

        A member that reaches etcd but not NATS keeps its lease, so without this it would
        keep its partitions, and nobody could consume them until NATS came back to it;
        one whose handler accepts no connection (its sidecar restarting) holds its
        messages waiting (reach.py). Each cut applies only while some member has been
        free of it steadily: when none has reached NATS for a while (NATS itself is down,
        or just came back), or none both NATS and its handler (a handler service they all
        share is down), moving partitions would only add churn. Apart: a shared handler
        outage must not let a member cut from NATS back in.
        """
        # A member key without a lease is no live member's (leaseless.py): it would
        # be given partitions nobody consumes. The leader removes it (_lead).
        stats = {
            member: data
            for member, data in self.view.members().items()
            if not leaseless_member(self.view, member)
        }
        nats_cut = {m for m, data in stats.items() if not data.nats_ok}
        handler_cut = {m for m, data in stats.items() if data.handler_ok is False}
        eligible = set(stats)
        if self._steadily_free(self._nats_since, stats, nats_cut):
            eligible -= nats_cut
        if self._steadily_free(self._able_since, stats, nats_cut | handler_cut):
            eligible -= handler_cut
        return eligible

    def _steadily_free(
        self, since: dict[str, float | None], members: Mapping[str, object], cut: set[str]
    ) -> bool:
        """Update `since` (member -> since when it has not been in `cut`, None while it
        is) and say whether some member has been out of `cut` for the steady period (at
        least two stats intervals: members report a recovery seconds apart, and the
        first one back must not take every partition for those seconds)."""
        now = time.monotonic()
        steady = max(NATS_STEADY_SECONDS, 2 * self.config.keepalive_interval)
        for member in list(since):
            if member not in members:
                del since[member]
        for member in members:
            if member in cut:
                since[member] = None
            elif since.get(member) is None:
                since[member] = now
        return any(t is not None and now - t >= steady for t in since.values())

    def _leader_key_is_ours(self) -> bool:
        """The leader key names us and lives on our current lease."""
        current = self.view.leader()
        kv = self.view.kvs.get(self.config.keys.leader)
        return (
            current is not None
            and current.member == self.config.member_id
            and kv is not None
            and kv.lease == self.membership.lease_id
        )

    def _still_leader(self) -> bool:
        current = self.view.leader()
        return (
            self.membership.safe()
            and current is not None
            and current.member == self.config.member_id
            and current.epoch == self.epoch
        )

    async def run(self) -> None:
        keys = self.config.keys
        await self.view.synced.wait()
        while not self.resigning:
            changed = self.view.change_event()
            safe = self.membership.safe()
            # A member on its way out must not take over a group it is leaving.
            eligible = safe and not self.membership.leaving
            if safe and self._leader_key_is_ours():
                # We stopped leading when we were fenced for a moment, but the lease
                # survived and the leader key with it: nobody else can campaign while it
                # exists, so unless we lead again nobody leads (no rebalance after a
                # crash, no autoscaling, no dead-letter sweep) until this pod restarts,
                # or, while we are leaving, until resign() after the drain. No one else
                # can have led meanwhile: the key's create_revision, our epoch, is
                # unchanged. (A leaver leads on, as it did before the fence: only a new
                # campaign is for members that stay.)
                current = self.view.leader()
                assert current is not None
                log.info("Leading again under epoch %d (the lease survived)", current.epoch)
                self.epoch = current.epoch
                await self._lead()
            elif eligible and (revision := leaseless_leader(self.view)) is not None:
                # Nobody can campaign while it exists, and it never expires.
                await self._leaseless.remove({keys.leader: revision})
            elif eligible and self.view.leader() is None:
                try:
                    # The create_revision of the key we created is our epoch.
                    epoch = await self.etcd.create_returning_revision(
                        keys.leader, self.config.member_id.encode(), self.membership.lease_id
                    )
                    self._campaign_failures.recovered()
                    if epoch is not None:
                        self.epoch = epoch
                        await self._lead()
                        continue
                except TRANSIENT_ERRORS as exc:
                    self._campaign_failures.failed(
                        logging.WARNING, "Campaign failed (etcd: %s)", exc
                    )
            try:
                async with asyncio.timeout(1.0):
                    await changed.wait()
            except TimeoutError:
                pass

    async def _lead(self) -> None:
        if not await self._seen_leading():
            return
        self._set_leader(True)
        self._written = {}
        log.info(
            "Became leader of %s/%s (epoch %d)",
            self.config.namespace,
            self.config.group,
            self.epoch,
        )
        if self._loads_wanted():
            # The first assignment weighs partitions by the members' routine stats: wait
            # (a listing: milliseconds) until the view has them, not past a lost etcd.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATS_SYNC_WAIT):
                    await self.view.stats_synced.wait()
        first = True
        applied_members: set[str] = set()
        next_load_check = time.monotonic() + self.config.load_check_interval
        next_leaseless_check = 0.0
        try:
            while self._still_leader() and not self.resigning:
                changed = self.view.change_event()
                # Also wake when our lease is in doubt (membership.changed): a leader cut
                # from etcd sees no view changes, and must stop leading at the fence. Taken
                # before the work, so that a fence signalled during it (an etcd write
                # timing out, as it usually does then) ends the wait below at once.
                fenced = self.membership.changed
                if time.monotonic() >= next_leaseless_check:
                    next_leaseless_check = time.monotonic() + RECHECK_SECONDS
                    if found := leaseless_keys(self.view):
                        await self._leaseless.remove(found)
                members = self._eligible()
                if members != applied_members or first:
                    await self._settle(None if first else applied_members)
                    if not self._still_leader() or self.resigning:
                        break
                    members = self._eligible()
                    if members:
                        ok = await self._rebalance(members, applied_members, first)
                        if not ok:
                            break
                        # A write that failed on an etcd error was not applied: leave
                        # applied_members as it was, so the next round writes it again
                        # (the targets would otherwise name a dead member until the next
                        # membership change).
                        if not self._write_failed:
                            applied_members = members
                            first = False
                elif stalled := self._stalled(members):
                    if not await self._rebalance(members, applied_members, first, stalled):
                        break
                elif (
                    members
                    and time.monotonic() - self._wrote_at >= RECHECK_SECONDS
                    and (astray := self._astray(members))
                ):
                    # Targets deleted, unreadable or naming a non-member while the
                    # membership stayed as it was (a hand-edit, a restore, garbage): their
                    # partitions have no owner until written again, and nothing else
                    # would write them before the next membership change.
                    log.warning(
                        "Partitions %s have no target naming a member (deleted, unreadable "
                        "or astray): assigning them again",
                        partition_list(astray),
                    )
                    if not await self._rebalance(members, applied_members, first):
                        break
                elif self.config.load_aware and time.monotonic() >= next_load_check:
                    next_load_check = time.monotonic() + self.config.load_check_interval
                    gain = self._load_gain(members)
                    if gain >= LOAD_GAIN_THRESHOLD:
                        log.info("Rebalancing for load: busiest member %.0f%% lighter", gain * 100)
                        if not await self._rebalance(members, applied_members, first):
                            break
                waiters = [
                    asyncio.ensure_future(changed.wait()),
                    asyncio.ensure_future(fenced.wait()),
                ]
                try:
                    await asyncio.wait(
                        waiters, timeout=RECHECK_SECONDS, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for waiter in waiters:
                        waiter.cancel()
        finally:
            self._set_leader(False)
            log.info(
                "Stopped leading %s/%s (epoch %d)",
                self.config.namespace,
                self.config.group,
                self.epoch,
            )

    async def _seen_leading(self) -> bool:
        """Wait until the view shows our own leader key, so _still_leader() is meaningful.

        False when it will not: another leader shows, or our key is gone before the view
        showed it (its lease expired, or it was deleted), which the view proves once it
        has caught up past the key's creation (our epoch) without it. Without that, with
        nobody else to campaign, no member would ever lead again. A view that does not
        catch up within a lease TTL (a silent watch) gets the same answer. Either way
        run() decides again from the view: it leads again when the key shows up as ours,
        and campaigns when there is none.
        """
        deadline = time.monotonic() + self.config.lease_ttl
        while (current := self.view.leader()) != self._me():
            if current is not None:
                return False  # someone else leads
            if self.view.revision >= self.epoch:
                log.info("Leader key of epoch %d gone before we saw it; deciding again", self.epoch)
                return False
            if time.monotonic() >= deadline:
                log.warning(
                    "The view has not shown our leader key (epoch %d) after %d s; deciding again",
                    self.epoch,
                    self.config.lease_ttl,
                )
                return False
            await self.view.changed(0.5)
        return True

    def _loads_wanted(self) -> bool:
        return self.config.load_aware and self.config.strategy == "sticky" and self.loads is None

    def _loads(self) -> dict[int, float]:
        if not self.config.load_aware or self.config.strategy != "sticky":
            return {}
        if self.loads is not None:
            return self.loads()
        return loads_from_stats(self.view.members())

    def _load_gain(self, members: set[str]) -> float:
        """How much a load-aware reassignment would lower the busiest member's load."""
        loads = self._loads()
        current = self.view.owners()
        before = max_member_load(current, loads)
        if not loads or before <= 0:
            return 0.0
        after = max_member_load(
            assign(self.config.partitions, members, current, loads=loads), loads
        )
        return (before - after) / before

    def _me(self) -> LeaderKey:
        return LeaderKey(self.config.member_id, self.epoch)

    async def _settle(self, applied: set[str] | None = None) -> None:
        """Debounce: wait until members stop changing for `debounce` seconds (max 5x).

        After the autoscaler added members, wait (up to SCALE_JOIN_WAIT) for all of them:
        pods start seconds apart, and one generation for all moves fewer partitions
        than one per newcomer.

        Returns early when we are no longer safely leader (fenced, deposed, resigning):
        a fenced leader must stop at once, not after SCALE_JOIN_WAIT (the caller checks).
        """
        started = time.monotonic()
        deadline = started + 5 * self.config.debounce
        last = self._eligible()
        while time.monotonic() < deadline or self._awaiting_scale_up(last, started):
            if not await self._pause(self._debounce_for(last, applied)):
                return
            now = self._eligible()
            if now == last and not self._awaiting_scale_up(now, started):
                return
            last = now

    async def _pause(self, seconds: float) -> bool:
        """Sleep `seconds`, or less when a fence is signalled (membership.changed) and we
        are no longer safely leader; False then (True after the whole sleep)."""
        until = time.monotonic() + seconds
        while self._still_leader() and not self.resigning:
            left = until - time.monotonic()
            if left <= 0:
                return True
            fenced = self.membership.changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await fenced.wait()
        return False

    def _unseen_writes(self, targets: dict[int, Target], previous: dict[int, str]) -> int:
        """Put in `previous` the targets this term wrote that the view does not show yet
        (its watch lags behind a loaded etcd or host), and return their newest
        generation (0: none). Computed from the generation before, the next assignment
        would reuse the generation number and leave out the partitions the last write
        moved (they differ in etcd, not in the view): unbalanced until the next
        membership change. A write the view has not shown after RECHECK_SECONDS is
        forgotten: by then the targets are what the view says (deleted by hand, say),
        which _astray, checked only that long after a write, repairs."""
        newest = 0
        now = time.monotonic()
        for p, (owner, generation, at) in list(self._written.items()):
            seen = targets.get(p)
            if (seen is not None and seen.generation >= generation) or now - at > RECHECK_SECONDS:
                del self._written[p]
                continue
            previous[p] = owner
            newest = max(newest, generation)
        return newest

    def _debounce_for(self, members: set[str], applied: set[str] | None) -> float:
        """The debounce, shorter when members only left since the last assignment.

        A leaver's partitions have no consumer until the next target write: a graceful
        leaver has released them already, a crashed one's lease is gone. Waiting the full
        debounce to batch later changes with them was most of a moved partition's pause
        on a leave. Several pods stopped together (a scale-down) still leave within
        LEAVE_DEBOUNCE of each other, and a join during the wait brings back the full one.
        """
        if applied is not None and members < applied:
            return min(self.config.debounce, LEAVE_DEBOUNCE)
        return self.config.debounce

    def _awaiting_scale_up(self, members: set[str], started: float) -> bool:
        if self._scale_expected is None:
            return False
        replicas, until = self._scale_expected
        now = time.monotonic()
        return len(members) < replicas and now < until and now < started + SCALE_JOIN_WAIT

    def _astray(self, members: set[str]) -> list[int]:
        """Partitions whose target is missing, or names someone not in `members`."""
        owners = self.view.owners()
        return [p for p in range(self.config.partitions) if owners.get(p) not in members]

    def _stalled(self, members: set[str]) -> dict[str, list[int]]:
        """The partitions members report stalled (progress.py) that are still theirs."""
        owners = self.view.owners()
        reports: dict[str, list[int]] = {}
        for member, data in self.view.members().items():
            if member not in members:
                continue
            mine = [p for p in data.stalled if owners.get(p) == member]
            if mine:
                reports[member] = mine
        return reports

    async def _rebalance(
        self,
        members: set[str],
        applied: set[str],
        first: bool,
        stalled: dict[str, list[int]] | None = None,
    ) -> bool:
        """Write the assignment for `members`; with `stalled`, only move those stalled
        partitions away from the members that report them (assignor.relieve_stalls)."""
        targets = self.view.targets()
        previous = {p: t.owner for p, t in targets.items()}
        newest_unseen = self._unseen_writes(targets, previous)
        if stalled:
            loads: dict[int, float] = {}
            new = relieve_stalls(previous, stalled, members)
        else:
            loads = self._loads()
            new = assign(
                self.config.partitions,
                members,
                previous,
                loads=loads or None,
                strategy=self.config.strategy,
            )
        changes = {p: owner for p, owner in new.items() if previous.get(p) != owner}
        # Whatever an earlier write did, the assignment is in place now (a write whose
        # answer was lost may have committed): a retry with nothing to change succeeded.
        self._write_failed = False
        if not changes:
            return True
        generation = max([newest_unseen, *(t.generation for t in targets.values())]) + 1
        now = time.time()
        items = {
            self.config.keys.partition(p): TargetValue(
                owner=owner, generation=generation, epoch=self.epoch, ts=now
            ).to_json()
            for p, owner in changes.items()
        }
        try:
            ok = await self.etcd.guarded_put_many(self.config.keys.leader, self.epoch, items)
        except TRANSIENT_ERRORS as exc:
            self._write_failures.failed(
                logging.WARNING, "Could not write the assignment (etcd: %s); will retry", exc
            )
            self._write_failed = True
            await asyncio.sleep(1.0)
            return True
        self._write_failures.recovered()
        if not ok:
            log.warning(
                "Lost leadership (epoch %d) while writing generation %d", self.epoch, generation
            )
            return False
        self.rebalances += 1
        # Our own write reaches the view a moment later, through its watch: until then
        # its targets look missing, which is no reason to write them again (_astray).
        self._wrote_at = time.monotonic()
        self._written.update((p, (o, generation, self._wrote_at)) for p, o in changes.items())
        moves = moved(previous, new)
        reason = (
            "failover" if stalled else self._reason(applied, set(previous.values()), members, first)
        )
        if stalled:
            log.warning(
                "Moved stalled partitions away from the members that reported them: %s",
                ", ".join(f"{p} {src} -> {dst}" for p, src, dst in moves),
            )
        log.info(
            "Wrote generation %d (%s): %d members, %d partitions moved",
            generation,
            reason,
            len(members),
            len(moves),
        )
        if self.on_generation is not None:
            record = GenerationRecord(
                ts=now,
                generation=generation,
                epoch=self.epoch,
                leader=self.config.member_id,
                reason=reason,
                members=sorted(members),
                assignment=dict(sorted(new.items())),
                moved=moves,
                loads=loads or {},
            )
            try:
                await self.on_generation(record)
            except Exception:
                log.exception("Recording generation %d failed", generation)
        return True

    async def resign(self) -> None:
        """Delete the leader key (if ours) so a successor takes over without waiting."""
        self.resigning = True
        if not self.epoch:
            return
        try:
            if await self.etcd.delete_if_created_at(self.config.keys.leader, self.epoch):
                log.info("Resigned leadership (epoch %d)", self.epoch)
        except TRANSIENT_ERRORS as exc:
            log.warning("Could not resign (%s); the lease will expire the leader key", exc)
