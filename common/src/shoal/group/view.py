"""A live local copy of one group's etcd prefix: members, leader, targets and claims.

It lists the prefix, then watches from the revision it listed at, so no event falls
between the two; on any watch error it lists and watches again. Every component reads
this view instead of asking etcd, and waits on `changed()` for the next update.

The members' routine stats (Keys.stats) are not watched: only the leader reads them (its
autoscaler and load-aware balancing), and it polls them (follow_stats). In a group of 64
every member received some 10 rewrites a second, and each cost the receiver half a
millisecond of CPU in gRPC's and the watcher's threads (not in decoding: 40 us): most of
an idle member's CPU. A poll every STATS_POLL_SECONDS asks only for what changed since
the last one, in one call.
Values that are not what the contract says (garbage JSON, wrong fields) are logged once
and ignored: one bad key must never stop a group.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shoal.clients.backoff import Backoff, QuietLog
from shoal.clients.etcd import (
    KV,
    TRANSIENT_ERRORS,
    Etcd,
    Watch,
    describe,
    key_text,
    prefix_end,
)
from shoal.contracts.names import Keys, decimal
from shoal.contracts.values import MemberStats, PauseRecord, TargetValue, ValueRefused
from shoal.group.problems import MemberProblem

log = logging.getLogger(__name__)

# How often the leader reads the members' routine stats (follow_stats): as often as a
# member writes them in a small group (keepalive_interval's default), so they are at most
# this much older than the leader's reading of them.
STATS_POLL_SECONDS = 3.0
# Every this many polls, one lists them all instead of what changed: a listing of changes
# shows no deletions, and the stats of members long gone must not pile up.
STATS_FULL_POLL_EVERY = 10


class NewClient(Exception):
    """Calls moved to another etcd client (an endpoint fail-over, a new token)."""

    def __str__(self) -> str:
        return "etcd calls moved to another endpoint or token"


@dataclass(frozen=True)
class Target:
    """partitions/<p>: who should own p, written by the leader."""

    owner: str
    generation: int
    epoch: int
    ts: float | None
    mod_revision: int


@dataclass(frozen=True)
class Claim:
    """claims/<p>: who consumes p right now, bound to that member's lease."""

    member: str
    lease: int
    create_revision: int


@dataclass(frozen=True)
class LeaderKey:
    member: str
    epoch: int  # the leader key's create_revision: a fencing token


class GroupView:
    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        partitions: int,
        *,
        garbage_logged: set[tuple[str, int]] | None = None,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.partitions = partitions
        self.kvs: dict[str, KV] = {}
        self.revision = 0
        self.synced = asyncio.Event()
        self._event = asyncio.Event()
        # (key, mod_revision) of the garbage already logged; a caller that makes a new
        # view for every reading (the operator's timer) passes one set to all of them.
        self._garbage_logged = garbage_logged if garbage_logged is not None else set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._errors: asyncio.Queue[BaseException] = asyncio.Queue()
        # The members' routine stats (Keys.stats) while follow_stats is on (or from a full
        # listing, load()): apart from kvs, whose listings do not include them. Their
        # revision is not the group's: `revision` says which group events this view has
        # seen (the election and the worker rely on it).
        self.stats_kvs: dict[str, KV] = {}
        self.stats_synced = asyncio.Event()
        self._stats_task: asyncio.Task[None] | None = None
        # targets() and claims() as of the last change: the worker, the leader and the
        # status writer read them every second or so, and parsing 128 JSON values each
        # time was most of what an idle member did.
        self._targets: dict[int, Target] | None = None
        self._claims: dict[int, Claim] | None = None
        # member key -> (its mod_revision, its stats): members() runs every round of the
        # leader and the autoscaler, and a key changes once per stats interval.
        self._stats: dict[str, tuple[int, MemberStats]] = {}
        # claims/<p> -> the revision its last deletion was seen at (handed_over_cleanly).
        self._claim_deleted: dict[str, int] = {}

    # -- reading -------------------------------------------------------------------------

    def change_event(self) -> asyncio.Event:
        """An event set at the next change. Grab it before reading, then wait on it."""
        return self._event

    async def changed(self, timeout: float | None = None) -> None:
        event = self._event
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            pass

    def _json(self, kv: KV) -> dict[str, Any] | None:
        try:
            data = json.loads(kv.value)
        except (ValueError, UnicodeDecodeError, RecursionError):
            data = None
        if isinstance(data, dict):
            return data
        self._garbage(kv, "is not a JSON object")
        return None

    def _garbage(self, kv: KV, why: str) -> None:
        marker = (kv.key, kv.mod_revision)
        if marker not in self._garbage_logged:
            self._garbage_logged.add(marker)
            log.warning("Ignored etcd key %s: value %r %s", kv.key, kv.value[:80], why)

    def members(self) -> dict[str, MemberStats]:
        """Live members and their stats: the newer of members/<id> and stats/<id> (the
        latter only while stats are followed, or after a full listing). A key whose
        value is not a JSON object is ignored; a field that breaks its rule reads as its
        default (MemberStats), and both are logged once."""
        result: dict[str, MemberStats] = {}
        for member, kv in freshest_member_kvs(self.keys, self.kvs, self.stats_kvs).items():
            stats = self._member_stats(kv.key, kv)
            if stats is not None:
                result[member] = stats
        for key in [k for k in self._stats if k not in self.kvs and k not in self.stats_kvs]:
            del self._stats[key]
        return result

    def _member_stats(self, key: str, kv: KV) -> MemberStats | None:
        cached = self._stats.get(key)
        if cached is not None and cached[0] == kv.mod_revision:
            return cached[1]
        try:
            stats = MemberStats.parse(kv.value)
        except ValueRefused as exc:
            self._garbage(kv, str(exc))
            return None
        if stats.problems:
            self._garbage(
                kv, "has fields that break their rule: " + "; ".join(stats.problems.values())
            )
        self._stats[key] = (kv.mod_revision, stats)
        return stats

    def member_ids(self) -> frozenset[str]:
        """Who has a member key (without parsing the stats in it)."""
        prefix = self.keys.members
        return frozenset(
            key[len(prefix) :] for key in self.kvs if key.startswith(prefix) and key != prefix
        )

    def problems(self) -> dict[str, MemberProblem]:
        """member -> why NATS refuses it, or what it waits for (Keys.problems), for
        members that report one;
        values that are not such a report are logged once and ignored."""
        result: dict[str, MemberProblem] = {}
        prefix = self.keys.problems
        for key, kv in self.kvs.items():
            if not key.startswith(prefix) or key == prefix:
                continue
            data = self._json(kv)
            if data is None:
                continue
            problem = MemberProblem.from_json(data)
            if problem is None:
                self._garbage(kv, "has no string reason and message and numeric since")
                continue
            result[key[len(prefix) :]] = problem
        return result

    def is_paused(self) -> bool:
        """Whether the group is paused (the key's presence; nothing parsed)."""
        return self.keys.paused in self.kvs

    def paused(self) -> PauseRecord | None:
        """Who paused the group (Keys.paused), or None while it runs. The key's presence
        is what pauses: an unreadable value is logged once and still pauses."""
        kv = self.kvs.get(self.keys.paused)
        if kv is None:
            return None
        try:
            return PauseRecord.parse(kv.value)
        except ValueRefused as exc:
            self._garbage(kv, f"is not a pause record ({exc}); the group is paused all the same")
            return PauseRecord.unknown()

    def leader(self) -> LeaderKey | None:
        kv = self.kvs.get(self.keys.leader)
        if kv is None:
            return None
        try:
            member = kv.value.decode()
        except UnicodeDecodeError:
            self._garbage(kv, "is not UTF-8")
            return None
        return LeaderKey(member, kv.create_revision)

    def _partition_of(self, key: str, prefix: str) -> int | None:
        p = decimal(key[len(prefix) :])
        return p if p is not None and p < self.partitions else None

    def targets(self) -> dict[int, Target]:
        if self._targets is None:
            self._targets = self._read_targets()
        return dict(self._targets)

    def _read_targets(self) -> dict[int, Target]:
        result: dict[int, Target] = {}
        for key, kv in self.kvs.items():
            if not key.startswith(self.keys.partitions):
                continue
            p = self._partition_of(key, self.keys.partitions)
            if p is None:
                self._garbage(kv, "has a key that is not a partition number")
                continue
            try:
                value = TargetValue.parse(kv.value)
            except ValueRefused as exc:
                self._garbage(kv, f"is not a target ({exc})")
                continue
            result[p] = Target(
                value.owner, value.generation, value.epoch, value.ts, kv.mod_revision
            )
        return result

    def owners(self) -> dict[int, str]:
        return {p: t.owner for p, t in self.targets().items()}

    def generation(self) -> int:
        return max((t.generation for t in self.targets().values()), default=0)

    def claims(self) -> dict[int, Claim]:
        if self._claims is None:
            self._claims = self._read_claims()
        return dict(self._claims)

    def _read_claims(self) -> dict[int, Claim]:
        result: dict[int, Claim] = {}
        for key, kv in self.kvs.items():
            if not key.startswith(self.keys.claims):
                continue
            p = self._partition_of(key, self.keys.claims)
            if p is None:
                self._garbage(kv, "has a key that is not a partition number")
                continue
            try:
                member = kv.value.decode()
            except UnicodeDecodeError:
                self._garbage(kv, "is not UTF-8")
                continue
            result[p] = Claim(member, kv.lease, kv.create_revision)
        return result

    def handback_credits(self, partition: int) -> dict[int, int]:
        """What the last orderly hand-over of `partition` gave back (Keys.handbacks):
        stream sequence -> credit. Read once, when a runner starts; garbage is ignored."""
        kv = self.kvs.get(self.keys.handback(partition))
        if kv is None:
            return {}
        data = self._json(kv)
        if data is None:
            return {}
        credits: dict[int, int] = {}
        for seq, credit in data.items():
            number = decimal(seq)
            if number is not None and isinstance(credit, int) and not isinstance(credit, bool):
                credits[number] = credit
            else:
                self._garbage(kv, f"has a bad entry {seq!r}: {credit!r}")
        return credits

    def handed_over_cleanly(self, partition: int) -> bool:
        """Whether the last owner of `partition` gave it back in order: the deletion of
        its claim, as this view saw it happen, wrote the hand-over record in the same
        transaction (Worker._release). Not seen (a crash, a lost lease, a fence, or a
        view that started after it): False."""
        deleted = self._claim_deleted.get(self.keys.claim(partition))
        record = self.kvs.get(self.keys.handback(partition))
        return deleted is not None and record is not None and record.mod_revision == deleted

    # -- keeping up to date --------------------------------------------------------------

    def load(self, revision: int, kvs: dict[str, KV]) -> None:
        """Replace the whole copy (a fresh listing of the prefix, stats/ included)."""
        stats = self.keys.stats
        self.stats_kvs = {k: kv for k, kv in kvs.items() if k.startswith(stats)}
        self._load_group(revision, {k: kv for k, kv in kvs.items() if not k.startswith(stats)})

    def _load_group(self, revision: int, kvs: dict[str, KV]) -> None:
        self.kvs = kvs
        self._claim_deleted = {}  # a listing shows no deletions
        self.revision = revision
        self._targets = self._claims = None

    def _notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def _apply_events(self, events: list[Any], revision: int) -> None:
        targets, claims, members = self.keys.partitions, self.keys.claims, self.keys.members
        routine = True  # only members' routine stats rewrites (quiet_stats_update)
        for event in events:
            key = key_text(event.key)
            # Parsed again at the next read only if they changed: members rewrite their
            # stats every few seconds, which changes neither (128 targets: 0.4 ms).
            if key.startswith(targets):
                self._targets = None
            elif key.startswith(claims):
                self._claims = None
            if type(event).__name__ == "DeleteEvent":
                self.kvs.pop(key, None)
                routine = False
                if key.startswith(claims):
                    self._claim_deleted[key] = int(event.mod_revision)
            else:
                old = self.kvs.get(key)
                if routine and not (
                    key.startswith(members)
                    and old is not None
                    and old.create_revision == event.create_revision
                    and quiet_stats_update(old.value, event.value)
                ):
                    routine = False
                self.kvs[key] = KV(
                    key, event.value, event.create_revision, event.mod_revision, event.lease
                )
        self.revision = max(self.revision, revision)
        if not routine:
            self._notify()

    def _on_watch(self, response: Any) -> None:
        # Runs on the watcher's thread: hand everything to the event loop.
        assert self._loop is not None
        if isinstance(response, BaseException):
            self._loop.call_soon_threadsafe(self._errors.put_nowait, response)
        else:
            self._loop.call_soon_threadsafe(
                self._apply_events, list(response.events), int(response.header.revision)
            )

    def _on_new_client(self) -> None:
        # Any thread. Our watch stays on the client that made it: after a fail-over
        # that is the endpoint found dead (or cut from its peers, answering nothing),
        # and the view would freeze. Watch again where the calls go now.
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._errors.put_nowait, NewClient())
        except RuntimeError:  # the loop closed meanwhile
            pass

    async def run(self) -> None:
        """List and watch forever; on errors list and watch again with backoff."""
        self._loop = asyncio.get_running_loop()
        self.etcd.on_new_client(self._on_new_client)
        backoff = Backoff(0.2, 5.0)
        # One cause: while etcd is away each retry fails, and says so once per 10 s.
        trouble = QuietLog(log)
        start, end = self.keys.prefix, self.keys.group_end
        while True:
            watch: Watch | None = None
            try:
                revision, kvs = await self.etcd.get_range(start, end)
                self._load_group(revision, kvs)
                while not self._errors.empty():
                    self._errors.get_nowait()
                watch = await self.etcd.watch_range(start, end, revision + 1, self._on_watch)
                self.synced.set()
                self._notify()
                backoff.reset()
                if trouble.failing:
                    log.info(
                        "Watching %s again (after %.1f s)", self.keys.prefix, trouble.recovered()
                    )
                error = await self._errors.get()
                if isinstance(error, NewClient):
                    log.info("Watching %s again: %s", self.keys.prefix, error)
                else:
                    trouble.failed(
                        logging.WARNING,
                        "Watch on %s failed (%s); listing again",
                        self.keys.prefix,
                        describe(error),
                    )
            except TRANSIENT_ERRORS as exc:
                trouble.failed(
                    logging.WARNING,
                    "etcd unreachable while watching %s (%s); retrying",
                    self.keys.prefix,
                    describe(exc),
                )
            except Exception as exc:
                # grpc errors surface with many types; anything else is a bug worth a trace.
                trouble.failed(
                    logging.WARNING, "Watching %s failed: %r; retrying", self.keys.prefix, exc
                )
            finally:
                if watch is not None:
                    await self.etcd.cancel_watch(watch)
            await asyncio.sleep(backoff.next())

    def follow_stats(self, on: bool) -> None:
        """Read the members' routine stats as well (on), or stop (off): the leader's
        (Election), for its autoscaler and load-aware balancing. Until `stats_synced` is
        set, members() gives what members/<id> says."""
        if on and self._stats_task is None:
            self._stats_task = asyncio.create_task(self._poll_stats(), name="view-stats")
        elif not on and self._stats_task is not None:
            self._stats_task.cancel()
            self._stats_task = None
            self.stats_synced.clear()
            self.stats_kvs = {}

    async def _poll_stats(self) -> None:
        start, end = self.keys.stats, prefix_end(self.keys.stats)
        backoff = Backoff(STATS_POLL_SECONDS, 30.0)
        trouble = QuietLog(log)
        seen = 0  # the revision of the last poll: the next asks for what changed since
        polls = 0
        while True:
            try:
                full = polls % STATS_FULL_POLL_EVERY == 0
                revision, kvs = await self.etcd.get_range(
                    start, end, min_mod_revision=None if full else seen + 1
                )
                if full:
                    self.stats_kvs = kvs
                else:
                    self.stats_kvs.update(kvs)
                seen, polls = revision, polls + 1
                self.stats_synced.set()
                if trouble.failing:
                    log.info("Reading members' stats again (after %.1f s)", trouble.recovered())
                backoff.reset()
                await asyncio.sleep(STATS_POLL_SECONDS)
            except Exception as exc:
                # Every error, not only TRANSIENT_ERRORS: etcd3 raises most gRPC errors as
                # they come, and a refusal by etcd's RBAC is EtcdAuthError (the group's
                # watch, run(), retries those too). A poll that ended here would leave the
                # leader reading stats that only grow older (its autoscaler would never
                # scale down again), and nobody would know.
                trouble.failed(
                    logging.WARNING, "Could not read members' stats (%s); retrying", describe(exc)
                )
                await asyncio.sleep(backoff.next())


def freshest_member_kvs(
    keys: Keys, kvs: Mapping[str, KV], stats_kvs: Mapping[str, KV]
) -> dict[str, KV]:
    """member -> the newer of its members/<id> and stats/<id> keys, for each member with a
    members/<id> key (stats/<id> alone is a member leaving: its lease takes it soon, or
    one long gone that the leader's last full poll still showed). Both carry MemberStats;
    members/<id> is rewritten only when a deciding field changes (Keys.stats), so
    stats/<id> is the newer but for a member that registered again, or one of an earlier
    version, which writes members/<id> only."""
    prefix = keys.members
    result: dict[str, KV] = {}
    for key, kv in kvs.items():
        if key.startswith(prefix) and key != prefix:
            member = key[len(prefix) :]
            routine = stats_kvs.get(keys.member_stats(member))
            newer = routine is not None and routine.mod_revision > kv.mod_revision
            result[member] = routine if newer and routine is not None else kv
    return result


# The fields of a member's stats that someone acts on as soon as they change: the
# leader gives nothing to a member cut from NATS or its handler (election._eligible) and moves the
# partitions a member reports stalled (election._stalled). The others (cpu, lag, rates,
# buffered, ...) are read when they are needed: by the autoscaler, the load-aware check
# and status, each on its own clock.
DECIDING_STATS = ("nats_ok", "handler_ok", "stalled")


def quiet_stats_update(old: bytes, new: bytes) -> bool:
    """Whether a member's stats rewrite changes nothing anyone acts on at once.

    Members of earlier versions rewrite their stats in members/<id> every keepalive
    interval (3 s; now they go to Keys.stats, which no watch carries), and every member
    watches members/: a view that woke its readers for each of them (the worker's
    reconcile round, the leader's) made an idle group cost each member CPU in proportion
    to the group's size, the group as a whole in proportion to its square. Such a rewrite
    is stored (members() reads it) without waking anyone; one that changes a deciding
    field, or that cannot be read, wakes them as any other change does."""
    try:
        before, after = json.loads(old), json.loads(new)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    if not isinstance(before, dict) or not isinstance(after, dict):
        return False
    return all(before.get(field) == after.get(field) for field in DECIDING_STATS)
