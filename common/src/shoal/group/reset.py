"""Moving a group's position: recreate every partition's durable at a new start.

nats-server 2.12 (the one Shoal pins) has no API to move a durable: JetStream refuses to
update a consumer's deliver policy (error 10012, "deliver policy can not be updated"),
and $JS.API.CONSUMER.RESET arrives only in 2.14 (2.12.15 does not answer it). So a
durable is deleted and created again with the same configuration and the new deliver
policy: by_start_time, all or by_start_sequence (the end too: Position.apply).

Nobody may pull a durable while it is recreated: a member whose pulls go unanswered
(the durable is gone) recreates it itself after about two seconds, with the policy it
knows (all), and the new position would be lost. So the group is paused first (Keys.
paused, unless it is already), and the reset waits until every member reports each of
its partitions done pausing (MemberStats.paused: handlers finished and acked, the rest
given back, no pull open); members that join meanwhile join paused. After the durables
are recreated it writes Keys.reset (members forget what they remembered of the old
durables: worker.follow_reset), clears the hand-over records of the old deliveries
(Keys.handbacks) and resumes the group if it paused it.

Only a `limits` stream keeps what was acked: a `workqueue` stream deletes every message
once acked, an `interest` one once its only consumer (each partition has one durable)
acked it, so there is nothing to replay; even a reset to the end is refused there (it
would leave the unconsumed messages in the stream for good, where a purge removes
them). Per-project order holds in the replay: each partition's messages come again in
stream order, and members run a project's messages one after another as always.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from nats.js import api
from nats.js.errors import APIError, NotFoundError

from shoal.clients.etcd import Etcd
from shoal.contracts.names import (
    Keys,
    TimeOutOfRange,
    decimal,
    durable_name,
    format_time,
    parse_since,
    partition_subject,
)
from shoal.contracts.values import MemberStats, PauseRecord, ValueRefused
from shoal.group.config import GroupConfig
from shoal.group.pause import (
    RESET_SOURCE,
    pause_group,
    read_pause,
    reset_holder,
    resume_if_source,
)
from shoal.group.view import freshest_member_kvs

__all__ = [
    "Position",
    "ResetError",
    "ResetPlan",
    "ResetResult",
    "ResetStep",
    "parse_reset_time",
    "plan_reset",
    "reset_group",
    "wait_paused",
]

log = logging.getLogger(__name__)

Kind = Literal["start", "end", "time", "sequence"]
# (stage, done, total): the command's progress line.
ResetStep = Callable[[str, int, int], None]

# Durables recreated side by side (each is a delete and a create on the meta leader).
CONCURRENCY = 16
# How often the wait for the pause reads the group's keys.
POLL_SECONDS = 0.1


class ResetError(RuntimeError):
    """A reset that cannot be done, or could not be finished (one line, for the user)."""


@dataclass(frozen=True)
class Position:
    """Where the durables start over: the stream's first message, its end (only what
    is published from now on), the first message at or after a time, or a sequence."""

    kind: Kind
    time: datetime | None = None
    seq: int | None = None

    def describe(self) -> str:
        if self.kind == "start":
            return "the start of the stream (every message it holds)"
        if self.kind == "end":
            after = f": stream sequence {self.seq} on" if self.seq is not None else ""
            return f"the end of the stream (only messages published from now on{after})"
        if self.kind == "time":
            assert self.time is not None
            return f"the first message at or after {self.time.isoformat()}"
        return f"stream sequence {self.seq}"

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"to": self.kind}
        if self.time is not None:
            data["time"] = self.time.isoformat()
        if self.seq is not None:
            data["seq"] = self.seq
        return data

    def apply(self, config: api.ConsumerConfig) -> api.ConsumerConfig:
        """`config` starting here. The end, once planned, is the sequence after the
        stream's last when the command read it (plan_reset), not deliver policy `new`:
        `new` counts from when the durable is created, after the confirmation and the
        wait for the pause, and would skip what was published meanwhile."""
        end = (
            (api.DeliverPolicy.NEW, None, None)
            if self.seq is None
            else (api.DeliverPolicy.BY_START_SEQUENCE, self.seq, None)
        )
        policy, seq, start = {
            "start": (api.DeliverPolicy.ALL, None, None),
            "end": end,
            "time": (api.DeliverPolicy.BY_START_TIME, None, self.time),
            "sequence": (api.DeliverPolicy.BY_START_SEQUENCE, self.seq, None),
        }[self.kind]
        return dataclasses.replace(
            config, deliver_policy=policy, opt_start_seq=seq, opt_start_time=start
        )


def parse_reset_time(text: str, now: datetime | None = None) -> datetime:
    """--to-time: RFC 3339 (UTC unless it says otherwise), or a duration back from now
    (`1h`, `-1h`, `2h ago`). ValueError, saying what it expected, for anything else."""
    cleaned = text.strip()
    if cleaned.endswith("ago"):
        cleaned = cleaned[: -len("ago")].strip()
    elif cleaned.startswith("-"):
        cleaned = cleaned[1:]
    try:
        return parse_since(cleaned, now)
    except TimeOutOfRange:
        raise
    except ValueError:
        raise ValueError(
            f"{text!r} is no time: expected RFC 3339 (2026-11-21T10:00:00Z) or a duration "
            "back from now (90s, 15m, -1h, 2h ago, 7d)"
        ) from None


@dataclass
class ResetPlan:
    """What a reset will do, read before anything changes."""

    config: GroupConfig
    position: Position
    retention: str
    first_seq: int
    last_seq: int
    messages: int
    durables: dict[int, api.ConsumerConfig]
    # Messages the recreated durables will deliver (from the position to the end).
    from_position: int
    # What the durables have not delivered or not had acked yet (delivered anyway).
    outstanding: int
    paused: PauseRecord | None
    # Partitions whose durable did not exist: created at the position.
    missing: list[int] = field(default_factory=list)

    @property
    def redelivered(self) -> int:
        """About how many already consumed messages come again (negative: skipped)."""
        return self.from_position - self.outstanding

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.config.group,
            "namespace": self.config.namespace,
            "stream": self.config.stream,
            "retention": self.retention,
            "partitions": len(self.durables),
            "position": self.position.as_dict(),
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "messages": self.messages,
            "from_position": self.from_position,
            "outstanding": self.outstanding,
            "paused_already": self.paused is not None,
            "missing_durables": [durable_name(p) for p in self.missing],
        }


def _where(config: GroupConfig) -> str:
    return f"group {config.namespace}/{config.group}"


async def plan_reset(
    js: Any, etcd: Etcd, config: GroupConfig, position: Position, now: float | None = None
) -> ResetPlan:
    """Read the stream and its durables and check the reset makes sense; ResetError (and
    nothing changed) when it does not."""
    now = time.time() if now is None else now
    try:
        info = await js.stream_info(config.stream)
    except NotFoundError:
        _, kvs = await etcd.get_prefix(config.keys.prefix)
        known = f" (etcd has {len(kvs)} keys under {config.keys.prefix})" if kvs else ""
        raise ResetError(
            f"unknown {_where(config)}: no stream {config.stream} on this NATS server{known} "
            "(are --group and --namespace right? --stream, if it has another name?)"
        ) from None
    retention = str(getattr(info.config.retention, "value", info.config.retention))
    if retention != "limits":
        raise ResetError(
            f"{_where(config)}: stream {config.stream} has {retention} retention: JetStream "
            "deletes each message once it is acked, so there is nothing to replay (and a "
            "reset to the end would only leave the unconsumed messages in the stream: "
            "purge the stream to skip them). Replay needs spec.nats.stream.retention: "
            "limits (SHOAL_RETENTION=limits), from before the messages were consumed"
        )
    state = info.state
    first, last = int(state.first_seq), int(state.last_seq)
    if position.kind == "end" and position.seq is None:
        # "From now on" is from now, not from whenever the durables are recreated.
        position = Position("end", seq=last + 1)
    if position.kind == "time":
        assert position.time is not None
        if position.time.timestamp() > now:
            raise ResetError(
                f"the reset time {position.time.isoformat()} is in the future "
                f"(now {format_time(now)})"
            )
    if position.kind == "sequence":
        assert position.seq is not None
        if not first <= position.seq <= last:
            held = f"holds {first}..{last}" if int(state.messages) else "is empty"
            raise ResetError(f"sequence {position.seq} is not in stream {config.stream}: it {held}")
    durables: dict[int, api.ConsumerConfig] = {}
    outstanding = 0
    names = {durable_name(p): p for p in range(4096)}
    for consumer in await all_consumers(js, config.stream):
        p = names.get(consumer.name)
        if p is not None and consumer.config.durable_name == consumer.name:
            durables[p] = consumer.config
            outstanding += int(consumer.num_pending or 0) + int(consumer.num_ack_pending or 0)
    if not durables:
        raise ResetError(
            f"{_where(config)}: stream {config.stream} has no partition durables (p0, p1, "
            "...): nothing to reset (the operator, or a member with "
            "SHOAL_ENSURE_JETSTREAM, creates them)"
        )
    template = durables[min(durables)]
    # A durable missing in the group's range (a reset interrupted between a durable's
    # delete and its create, or one deleted by hand) is created at the position too: a
    # reset that planned only the durables it found left that partition consumed by
    # nobody, or, where members recreate durables, at its old position.
    missing = [
        p for p in range(await _partition_count(etcd, config, durables)) if p not in durables
    ]
    for p in missing:
        durables[p] = dataclasses.replace(
            template,
            durable_name=durable_name(p),
            name=None,
            filter_subject=partition_subject(config.subject_prefix, p),
            filter_subjects=None,
        )
    from_position = await _count_from(js, config, position.apply(template))
    return ResetPlan(
        config=config,
        position=position,
        retention=retention,
        first_seq=first,
        last_seq=last,
        messages=int(state.messages),
        durables=durables,
        from_position=from_position,
        outstanding=outstanding,
        paused=await read_pause(etcd, config.keys),
        missing=missing,
    )


async def _partition_count(
    etcd: Etcd, config: GroupConfig, durables: dict[int, api.ConsumerConfig]
) -> int:
    """How many partitions the group has, from what exists: its durables and the
    leader's targets (partitions/<p>, one per partition once a leader ran). Not
    config.partitions: a command line's --partitions defaults to 128 whatever the group
    has, and durables made from it would be consumed by nobody."""
    _, kvs = await etcd.get_prefix(config.keys.partitions)
    targets = [decimal(key[len(config.keys.partitions) :]) for key in kvs]
    highest = max((p for p in targets if p is not None and p < 4096), default=-1)
    return max(highest, max(durables)) + 1


async def all_consumers(js: Any, stream: str) -> list[api.ConsumerInfo]:
    """Every consumer of the stream (JetStream lists 256 at a time)."""
    found: list[api.ConsumerInfo] = []
    while True:
        page = await js.consumers_info(stream, offset=len(found) or None)
        found.extend(page)
        if not page:
            return found


async def _count_from(js: Any, config: GroupConfig, template: api.ConsumerConfig) -> int:
    """How many of the group's messages a consumer starting at the template's position
    would deliver: the server counts it (an ephemeral consumer over every partition,
    never pulled), so by_start_time means exactly what the recreated durables will do."""
    probe = api.ConsumerConfig(
        deliver_policy=template.deliver_policy,
        opt_start_seq=template.opt_start_seq,
        opt_start_time=template.opt_start_time,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=f"{config.subject_prefix}.*",
        inactive_threshold=10.0,
        mem_storage=True,
        num_replicas=1,
    )
    info = await js.add_consumer(config.stream, config=probe)
    try:
        return int(info.num_pending or 0)
    finally:
        try:
            await js.delete_consumer(config.stream, info.name)
        except Exception:  # it goes by itself after inactive_threshold
            log.debug("Could not delete the counting consumer %s", info.name, exc_info=True)


@dataclass(frozen=True)
class Quiet:
    """What the wait for the pause found: whether every consumer stopped, and who not."""

    done: bool
    members: int
    partitions: int
    waiting: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        return "; ".join(
            f"{member}: partition(s) {', '.join(map(str, ps[:8]))}"
            + (f" and {len(ps) - 8} more" if len(ps) > 8 else "")
            for member, ps in sorted(self.waiting.items())
        )


async def quiet(etcd: Etcd, keys: Keys) -> Quiet:
    """Whether every partition anyone consumes is done pausing: each member's stats,
    written after the pause key was (mod_revision), list every partition it claims and
    every one it runs as paused. A member whose stats predate the pause has not said
    yet."""
    _, kvs = await etcd.get_prefix(keys.prefix)
    pause = kvs.get(keys.paused)
    if pause is None:
        raise ResetError("the group was resumed while the reset waited for it to pause")
    stats: dict[str, tuple[int, MemberStats]] = {}
    claims: dict[str, list[int]] = {}
    for member, kv in freshest_member_kvs(keys, kvs, kvs).items():
        try:
            stats[member] = (kv.mod_revision, MemberStats.parse(kv.value))
        except ValueRefused:
            stats[member] = (0, MemberStats())
    for key, kv in kvs.items():
        if key.startswith(keys.claims) and key != keys.claims:
            p = decimal(Keys.tail(key, keys.claims))
            if p is not None:
                claims.setdefault(kv.value.decode(errors="replace"), []).append(p)
    waiting: dict[str, list[int]] = {}
    for member, (revision, member_stats) in stats.items():
        running = set(member_stats.owned) | set(claims.get(member, []))
        fresh = revision > pause.mod_revision
        left = sorted(running if not fresh else running - set(member_stats.paused or ()))
        if left:
            waiting[member] = left
    for member, held in claims.items():
        if member not in stats:
            # A claim outlives its member key while the member leaves (or until its lease
            # expires): it may still consume; wait for the claim to go.
            waiting[member] = sorted(held)
    partitions = sum(len(ps) for ps in claims.values())
    return Quiet(not waiting, len(stats), partitions, waiting)


async def wait_paused(
    etcd: Etcd, keys: Keys, timeout: float, step: ResetStep | None = None
) -> Quiet:
    """Until every member says it stopped (quiet); ResetError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        state = await quiet(etcd, keys)
        if step is not None:
            busy = sum(len(ps) for ps in state.waiting.values())
            step("waiting for the members to pause", state.partitions - busy, state.partitions)
        if state.done:
            return state
        if time.monotonic() >= deadline:
            raise ResetError(
                f"the members did not report their partitions paused within {timeout:.0f} s "
                f"({state.describe()}); nothing was reset"
            )
        await asyncio.sleep(POLL_SECONDS)


async def recreate_durable(
    js: Any, stream: str, current: api.ConsumerConfig, position: Position
) -> None:
    """Delete the durable and create it again with `current` at `position`.

    If someone creates it in between (the operator's reconcile, a member starting:
    jetstream.ensure_group creates missing durables with deliver policy all), the create
    is refused as an update of the deliver policy: delete that one and try again.
    """
    wanted = position.apply(current)
    name = current.durable_name
    for _ in range(5):
        try:
            await js.delete_consumer(stream, name)
        except NotFoundError:
            pass
        try:
            await js.add_consumer(stream, config=wanted)
            return
        except APIError as exc:
            if exc.err_code != 10012:  # anything but "deliver policy can not be updated"
                raise
            log.warning("Durable %s was recreated by someone else meanwhile; again", name)
    raise ResetError(f"durable {name} keeps being recreated by someone else meanwhile")


async def recreate_durables(js: Any, plan: ResetPlan, step: ResetStep | None = None) -> None:
    sem = asyncio.Semaphore(CONCURRENCY)
    total = len(plan.durables)
    done = 0

    async def one(current: api.ConsumerConfig) -> None:
        nonlocal done
        async with sem:
            await recreate_durable(js, plan.config.stream, current, plan.position)
        done += 1
        if step is not None:
            step("recreating durables", done, total)

    await asyncio.gather(*(one(c) for c in plan.durables.values()))


async def check_durables(js: Any, plan: ResetPlan) -> list[str]:
    """The durables that are not where the reset put them (missing, or another policy)."""
    wanted = plan.position.apply(next(iter(plan.durables.values()))).deliver_policy
    found = {c.name: c.config for c in await all_consumers(js, plan.config.stream)}
    return [
        current.durable_name or ""
        for current in plan.durables.values()
        if current.durable_name not in found or found[current.durable_name].deliver_policy != wanted
    ]


@dataclass(frozen=True)
class ResetResult:
    partitions: int
    paused_by_us: bool
    resumed: bool
    seconds: float
    pause_seconds: float
    recreate_seconds: float
    pending: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# A reset that cannot resume the group it paused tries this often, a second apart.
RESUME_ATTEMPTS = 10


def _still_paused(config: GroupConfig) -> str:
    return (
        "the group stays paused by this reset: run the reset again (it resumes the group "
        "when it is done), or resume it at the position it has now with `shoal-consumer "
        f"resume -g {config.group} -n {config.namespace}`"
    )


def _failed(exc: BaseException) -> str:
    what = str(exc) or type(exc).__name__
    return f"the reset failed ({what})"


async def _resume_own(etcd: Etcd, keys: Keys) -> tuple[bool, PauseRecord | None]:
    """Lift this reset's pause (retrying a while: etcd may be away for a moment):
    (resumed, the pause left in place: someone paused the group meanwhile). (False,
    None): etcd would not answer."""
    for attempt in range(RESUME_ATTEMPTS):
        try:
            left = await resume_if_source(etcd, keys, RESET_SOURCE)
        except Exception as exc:
            log.warning("Could not resume the group (%r); again in 1 s", exc)
            if attempt + 1 < RESUME_ATTEMPTS:
                await asyncio.sleep(1.0)
            continue
        if left is not None:
            log.warning("The group was paused meanwhile (%s): left paused", left.describe())
            return False, left
        return True, None
    return False, None


async def _resume_after_failure(etcd: Etcd, keys: Keys) -> bool:
    """Lift this reset's pause after a failure; False when etcd would not answer."""
    resumed, left = await _resume_own(etcd, keys)
    return resumed or left is not None


# The lease of the `resetting` key (Keys.resetting), renewed every third of it.
LOCK_TTL = 10


class _ResetLock:
    """Keys.resetting on a lease this process keeps alive while it resets."""

    def __init__(self, etcd: Etcd, lease: int, keeper: asyncio.Task[None]) -> None:
        self.etcd, self.lease, self.keeper = etcd, lease, keeper

    @classmethod
    async def take(cls, etcd: Etcd, keys: Keys, by: str) -> _ResetLock:
        lease = await etcd.grant_lease(LOCK_TTL)
        value = json.dumps({"by": by, "time": time.time()}).encode()
        try:
            taken = await etcd.create_returning_revision(keys.resetting, value, lease)
        except BaseException:
            await _revoke(etcd, lease)
            raise
        if taken is None:
            await _revoke(etcd, lease)
            holder = await reset_holder(etcd, keys) or "?"
            raise ResetError(
                f"another reset of the group is running ({holder}): wait for it to end; "
                "nothing was changed"
            )
        return cls(etcd, lease, asyncio.create_task(_keep_alive(etcd, lease)))

    async def release(self) -> None:
        self.keeper.cancel()
        await asyncio.gather(self.keeper, return_exceptions=True)
        await _revoke(self.etcd, self.lease)


async def _keep_alive(etcd: Etcd, lease: int) -> None:
    while True:
        await asyncio.sleep(LOCK_TTL / 3)
        try:
            await etcd.refresh_lease(lease)
        except Exception as exc:  # the next one may pass; the work goes on regardless
            log.warning("Could not renew the reset's lease (%r)", exc)


async def _revoke(etcd: Etcd, lease: int) -> None:
    try:
        await etcd.revoke_lease(lease)
    except Exception as exc:  # it expires on its own
        log.debug("Could not revoke the reset's lease: %r", exc)


async def reset_group(
    js: Any,
    etcd: Etcd,
    plan: ResetPlan,
    *,
    by: str,
    wait_timeout: float = 60.0,
    step: ResetStep | None = None,
) -> ResetResult:
    """Pause (unless paused), wait for the members to stop, recreate the durables at the
    plan's position, record the reset, resume (only if it paused, or finishes the work
    of a reset that did not). One reset at a time (Keys.resetting)."""
    lock = await _ResetLock.take(etcd, plan.config.keys, by)
    try:
        return await _reset_group(js, etcd, plan, by, wait_timeout, step)
    finally:
        await lock.release()


async def _reset_group(
    js: Any,
    etcd: Etcd,
    plan: ResetPlan,
    by: str,
    wait_timeout: float,
    step: ResetStep | None,
) -> ResetResult:
    config, keys = plan.config, plan.config.keys
    started = time.monotonic()
    record = PauseRecord(
        by=by, time=time.time(), source=RESET_SOURCE, reason=f"reset to {plan.position.describe()}"
    )
    earlier = await pause_group(etcd, keys, record)
    # A reset's pause while no reset runs (we hold Keys.resetting) is one left by a reset
    # that did not finish (Ctrl-C, etcd away at its end): this one finishes that one's
    # work, so it resumes the group too, once the durables are reset. (Before, the
    # group stayed paused for good: the operator leaves a reset's pause alone, and a
    # second reset took it for someone else's.)
    interrupted = earlier is not None and earlier.source == RESET_SOURCE
    paused_by_us = earlier is None or interrupted
    log.info(
        "%s %s; waiting for its members to stop",
        _where(config),
        "paused"
        if earlier is None
        else f"paused already ({earlier.describe()}"
        + ("; left by a reset that did not finish: resumed at the end" if interrupted else "")
        + ")",
    )
    try:
        await wait_paused(etcd, keys, wait_timeout, step)
    except BaseException as exc:
        # Nothing reset yet: lift the pause if it is the one just written. An inherited
        # one stays: the reset that left it may have reset some durables and deleted
        # others, which must not be consumed.
        if earlier is None and not await _resume_after_failure(etcd, keys):
            raise ResetError(f"{_failed(exc)}; {_still_paused(config)}") from exc
        if interrupted and isinstance(exc, Exception):
            raise ResetError(f"{_failed(exc)}; {_still_paused(config)}") from exc
        raise
    stopped = time.monotonic()
    # From here on the group stays paused if anything fails: a partition without its
    # durable, or at the old position, must not be consumed (run the reset again).
    try:
        await recreate_durables(js, plan, step)
        wrong = await check_durables(js, plan)
        if wrong:
            raise ResetError(
                f"durable(s) {', '.join(sorted(wrong)[:10])} are not at the new position"
            )
        recreated = time.monotonic()
        names = {c.durable_name for c in plan.durables.values()}
        pending = sum(
            int(c.num_pending or 0) + int(c.num_ack_pending or 0)
            for c in await all_consumers(js, config.stream)
            if c.name in names
        )
        reset_record = {"by": by, "time": time.time(), **plan.position.as_dict()}
        await etcd.put(keys.reset, json.dumps(reset_record, sort_keys=True).encode())
        # The hand-over records name deliveries of the old durables (their credits would
        # count against replayed messages of the same sequences).
        await etcd.delete_prefix(keys.handbacks)
    except ResetError as exc:
        raise ResetError(f"{exc}; {_still_paused(config)}") from exc
    except Exception as exc:
        raise ResetError(f"{_failed(exc)}; {_still_paused(config)}") from exc
    except BaseException:
        log.error("Interrupted: %s", _still_paused(config))
        raise
    resumed = False
    if paused_by_us:
        resumed, left = await _resume_own(etcd, keys)
        if not resumed and left is None:
            raise ResetError(f"the durables are reset, but {_still_paused(config)}")
    now = time.monotonic()
    return ResetResult(
        partitions=len(plan.durables),
        paused_by_us=paused_by_us,
        resumed=resumed,
        seconds=now - started,
        pause_seconds=stopped - started,
        recreate_seconds=recreated - stopped,
        pending=pending,
    )
