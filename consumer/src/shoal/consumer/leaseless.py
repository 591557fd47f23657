"""Keys that Shoal writes only on a lease, found without one, and their removal.

Shoal writes the `leader` key, `members/<id>` and `claims/<p>` on the writer's lease, so
that each goes when its writer does. `etcdctl make-mirror` copies keys without their
leases, and a hand-written `etcdctl put` has none either. Such a key never expires:

- a lease-less `leader` key stops every campaign for good (the group has no leader: no
  rebalance, no autoscaling, no dead-letter sweep);
- a lease-less `members/<id>` is a member that never leaves: it is given partitions that
  nobody consumes;
- a lease-less `claims/<p>` is never released: the partition's owner waits for it for
  good, and p is consumed by nobody.

None of them belongs to a live writer, so removing it is safe: campaigning members remove
a lease-less leader key, the leader the others, each only if nobody wrote it since it was
seen (a writer that put it again on its lease keeps it).
"""

from __future__ import annotations

import logging

from shoal.clients.backoff import QuietLog
from shoal.clients.etcd import TRANSIENT_ERRORS, Etcd
from shoal.contracts.names import decimal
from shoal.group.view import GroupView

log = logging.getLogger(__name__)

WHY = (
    "Shoal writes it only on a lease; one without never expires (copied by etcdctl "
    "make-mirror, or written by hand)"
)


def leaseless_leader(view: GroupView) -> int | None:
    """The leader key's mod_revision if it exists without a lease, else None."""
    kv = view.kvs.get(view.keys.leader)
    return kv.mod_revision if kv is not None and not kv.lease else None


def leaseless_member(view: GroupView, member: str) -> bool:
    """Whether member's members/<id> key exists without a lease."""
    kv = view.kvs.get(view.keys.member(member))
    return kv is not None and not kv.lease


def leaseless_keys(view: GroupView) -> dict[str, int]:
    """members/<id> and claims/<p> keys without a lease: key -> mod_revision.

    Only keys that would act (a member key whose stats parse, a claim of a partition of
    the group); garbage is logged by the view and ignored as before."""
    keys = view.keys
    members = view.members()
    found: dict[str, int] = {}
    for key, kv in view.kvs.items():
        if kv.lease:
            continue
        if key.startswith(keys.members) and key[len(keys.members) :] in members:
            found[key] = kv.mod_revision
        elif key.startswith(keys.claims):
            p = decimal(key[len(keys.claims) :])
            if p is not None and p < view.partitions:
                found[key] = kv.mod_revision
    return found


class LeaselessRemover:
    """Deletes lease-less keys, each logged once, failures at most every 10 s."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self._logged: set[tuple[str, int]] = set()
        self._failures = QuietLog(log)
        self.removed = 0

    async def remove(self, found: dict[str, int]) -> None:
        for key, mod_revision in found.items():
            if (key, mod_revision) not in self._logged:
                self._logged.add((key, mod_revision))
                log.warning("Removing etcd key %s: it has no lease (%s)", key, WHY)
            try:
                if await self.etcd.delete_if_unchanged(key, mod_revision):
                    self.removed += 1
                self._failures.recovered()
            except TRANSIENT_ERRORS as exc:
                self._failures.failed(
                    logging.WARNING, "Could not remove lease-less key %s (etcd: %s)", key, exc
                )
                return
