"""Pausing a group: its `paused` key (Keys.paused), one writer's intent for every member.

The group is paused while the key exists; its value (PauseRecord) says by whom, when,
through what, and why. The operator writes it from spec.paused (and removes it when the
spec says false); `shoal-consumer pause` and `resume` do the same for groups run without
the operator. Members read it through their view (GroupView.paused) before they claim
anything, so a member that joins a paused group joins paused, and a pause outlives every
member and every leader: nothing but a resume removes the key.
"""

from __future__ import annotations

from shoal.clients.etcd import Etcd
from shoal.contracts.names import Keys
from shoal.contracts.values import PauseRecord, ValueRefused

__all__ = ["RESET_SOURCE", "pause_group", "read_pause", "resume_group", "resume_if_source"]

# PauseRecord.source of the pause `shoal-consumer reset` writes around its work: the
# operator leaves that one alone whatever spec.paused says (the reset resumes the group
# itself, once every durable is at its new position).
RESET_SOURCE = "reset"


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
    the operator (which leaves a reset's pause alone, and would lift a spec.paused or
    CLI pause whenever spec.paused is false, members then pulling while a durable is
    being recreated). The caller says so; the operator pauses the group again after."""
    if await etcd.create_returning_revision(keys.paused, record.to_json(), None) is not None:
        return None
    return await read_pause(etcd, keys) or record


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


async def resume_group(etcd: Etcd, keys: Keys) -> PauseRecord | None:
    """Resume the group: delete its pause key. Returns the record deleted (None: it was
    not paused, nothing done)."""
    record = await read_pause(etcd, keys)
    if record is None:
        return None
    await etcd.delete(keys.paused)
    return record
