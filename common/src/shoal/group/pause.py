"""Pausing a group: its `paused` key (Keys.paused), one writer's intent for every member.

The group is paused while the key exists; its value (PauseRecord) says by whom, when,
through what (its source), and why. The operator writes it from spec.paused (source
SPEC_SOURCE) and removes, when the spec says false, only a pause of that source;
`shoal-consumer pause` writes one of its own (CLI_SOURCE), on any group, and the operator
leaves it for `shoal-consumer resume` to lift. `resume` refuses a spec.paused pause (the
operator would write it again within seconds: spec.paused false lifts it). Members read
the key through their view (GroupView.paused) before they claim anything, so a member
that joins a paused group joins paused, and a pause outlives every member and every
leader: nothing but a resume removes the key.
"""

from __future__ import annotations

from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys
from shoal.contracts.values import PauseRecord, ValueRefused

__all__ = [
    "CLI_SOURCE",
    "RESET_SOURCE",
    "SPEC_SOURCE",
    "ResetRunning",
    "SpecPaused",
    "group_has_keys",
    "lift_if_source",
    "pause_group",
    "read_pause",
    "reset_holder",
    "resume_group",
    "resume_if_source",
]

# PauseRecord.source of the pause `shoal-consumer reset` writes around its work: the
# operator leaves that one alone whatever spec.paused says (the reset resumes the group
# itself, once every durable is at its new position).
RESET_SOURCE = "reset"
# The operator's pause, from the ConsumerGroup's spec.paused: the only one it lifts.
SPEC_SOURCE = "spec.paused"
# `shoal-consumer pause`'s: lifted by `shoal-consumer resume` only, operator or not.
CLI_SOURCE = "cli"

# Attempts at pausing or resuming while someone else changes the key each time between
# our read and our write.
ATTEMPTS = 5


async def read_pause(etcd: Etcd, keys: Keys) -> PauseRecord | None:
    """The group's pause record, or None while it runs (an unreadable value: unknown)."""
    found = await _read_pause(etcd, keys)
    return found[0] if found is not None else None


async def _read_pause(etcd: Etcd, keys: Keys) -> tuple[PauseRecord, int] | None:
    """The pause record and the key's mod_revision; None while the group runs."""
    _, kvs = await etcd.get_prefix(keys.paused)
    kv = kvs.get(keys.paused)
    if kv is None:
        return None
    try:
        return PauseRecord.parse(kv.value), kv.mod_revision
    except ValueRefused:
        return PauseRecord.unknown(), kv.mod_revision


async def pause_group(etcd: Etcd, keys: Keys, record: PauseRecord) -> PauseRecord | None:
    """Pause the group with `record`, unless it is paused already: then nothing is
    written and the record in place is returned (who paused it first stays on record).

    A reset's pause (RESET_SOURCE) is not taken over either, though the reset lifts it
    when it is done: in its place, another pause would lose what protects the reset from
    the operator (which leaves a reset's pause alone, and would lift a spec.paused pause
    whenever spec.paused is false, members then pulling while a durable is being
    recreated). The caller says so; the operator pauses the group again after."""
    for _ in range(ATTEMPTS):
        if await etcd.create_returning_revision(keys.paused, record.to_json(), None) is not None:
            return None
        found = await read_pause(etcd, keys)
        if found is not None:
            return found
        # Resumed between the two calls: not paused after all, try again.
    raise RuntimeError(f"{keys.paused} came and went {ATTEMPTS} times while pausing")


async def resume_if_source(etcd: Etcd, keys: Keys, source: str) -> PauseRecord | None:
    """Resume the group only if its pause is one `source` wrote (a reset lifting its
    own); returns the record left in place otherwise (None: resumed, or not paused)."""
    found = await _read_pause(etcd, keys)
    if found is None:
        return None
    record, revision = found
    if record.source != source:
        return record
    if not await etcd.delete_if_unchanged(keys.paused, revision):
        return await read_pause(etcd, keys)  # written again meanwhile: look again
    return None


async def lift_if_source(
    etcd: Etcd, keys: Keys, source: str
) -> tuple[PauseRecord | None, PauseRecord | None]:
    """Delete the group's pause key only if its record's source is `source`, as read (a
    record written in between is looked at again, never deleted unseen): (the record
    deleted, the record left in place), either None. The operator lifts this way only
    the pause spec.paused made, never one `shoal-consumer pause` or a reset wrote."""
    for _ in range(ATTEMPTS):
        found = await _read_pause(etcd, keys)
        if found is None:
            return None, None
        record, revision = found
        if record.source != source:
            return None, record
        if await etcd.delete_if_unchanged(keys.paused, revision):
            return record, None
    raise RuntimeError(f"{keys.paused} was rewritten {ATTEMPTS} times while resuming")


class ResetRunning(RuntimeError):
    """The pause is a running reset's: lifted now, members would pull while a durable is
    being recreated, and recreate it at its old position (group/reset.py)."""

    def __init__(self, record: PauseRecord, holder: str) -> None:
        super().__init__(
            f"paused by a reset that is still running ({holder}), which resumes the group "
            "when it is done: nothing changed"
        )
        self.record = record


class SpecPaused(RuntimeError):
    """The pause is the operator's, from the ConsumerGroup's spec.paused: deleted, the
    operator writes it again within seconds (its status timer follows the spec), and
    members pull only meanwhile. spec.paused: false is what lifts it."""

    def __init__(self, record: PauseRecord) -> None:
        super().__init__(f"paused through its ConsumerGroup's spec.paused ({record.describe()})")
        self.record = record


async def resume_group(etcd: Etcd, keys: Keys, *, lift_spec: bool = False) -> PauseRecord | None:
    """Resume the group: delete its pause key, as read (a record written in between, a
    reset's, is looked at again, not deleted unseen). Returns the record deleted (None:
    it was not paused, nothing done). ResetRunning for the pause of a reset that still
    runs (Keys.resetting); a reset's pause without it was left by one that did not
    finish, and is lifted. SpecPaused for the operator's pause (SPEC_SOURCE), unless
    `lift_spec` (a group no operator runs any more, whose last pause it left)."""
    for _ in range(ATTEMPTS):
        found = await _read_pause(etcd, keys)
        if found is None:
            return None
        record, revision = found
        if record.source == SPEC_SOURCE and not lift_spec:
            raise SpecPaused(record)
        if record.source == RESET_SOURCE:
            holder = await reset_holder(etcd, keys)
            if holder is not None:
                raise ResetRunning(record, holder)
        if await etcd.delete_if_unchanged(keys.paused, revision):
            return record
    raise RuntimeError(f"{keys.paused} was rewritten {ATTEMPTS} times while resuming")


async def reset_holder(etcd: Etcd, keys: Keys) -> str | None:
    """Who runs the group's reset now (Keys.resetting: by, time; its first 200
    characters), or None when no reset runs."""
    _, kvs = await etcd.get_prefix(keys.resetting)
    kv = kvs.get(keys.resetting)
    return kv.value.decode(errors="replace")[:200] if kv is not None else None


async def group_has_keys(etcd: Etcd, keys: Keys) -> bool:
    """Whether etcd holds anything of the group (a member, a claim, a pause...): a
    group that never ran, or a misspelt name, has nothing."""
    _, kvs = await etcd.get_prefix(keys.prefix)
    return bool(kvs)
