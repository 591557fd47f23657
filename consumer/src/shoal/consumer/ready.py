"""Readiness and liveness probes of a consumer pod: `shoal-ready` and `shoal-ready --live`.

The member rewrites a small JSON state file about every second (HealthFile, from its
event loop): whether it has joined its group, whether its lease is certainly alive
(not fenced), whether NATS answers, whether it is leaving, and a monotonic timestamp.

* Readiness (`shoal-ready`): ready only while the state is fresh (refreshed within
  --max-age, default 5 s) and the member is joined, not fenced, reaches NATS, is not
  leaving and holds no stalled partition (progress.py). A member fenced for good, cut
  from NATS or frozen turns unready within seconds, and ready again once it recovers.
* Liveness (`shoal-ready --live`): fails when the state has not been refreshed for
  a generous time (--max-age, default 60 s): the process's event loop is stuck or the
  process is frozen; or when the member is wedged: it still holds a partition stalled for
  three stallAfterSeconds, long after the leader should have moved it, so something in
  the process is stuck for good. It never fails because etcd or NATS are down (a stall
  does not count while they are: progress.py): a member that cannot
  reach them stops consuming by itself and recovers by itself when they come back, while
  restarting every pod during an etcd or NATS outage would only add a storm of restarts
  (and of re-joins and hand-overs) to the outage.

Kubernetes runs the probe every couple of seconds in every consumer pod, so this module
imports nothing but the standard library: the full CLI would spend ~0.3 s of CPU per
probe on imports (15% of a core per pod at a 2 s period). And only the cheap part of it:
dataclasses (which imports inspect and ast), pathlib and argparse took 24 of the 36 ms
the import took, and a probe's CPU was 2.2 % of a core per member at 50 groups
(bench/groups.py), four times the member's own; MemberState is a NamedTuple, files are
read with os, and the probes' own arguments (none, or --live) skip argparse.

Timestamps are CLOCK_MONOTONIC (time.monotonic), which every process on the host shares
and which wall-clock changes (NTP steps) do not move.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import argparse

ENV = "SHOAL_READY_FILE"

#: How often the member rewrites its state.
REFRESH_SECONDS = 1.0
#: Readiness: state older than this is stale (a few missed refreshes).
READY_MAX_AGE = 5.0
#: Liveness: state older than this means the event loop is stuck. Generous on purpose:
#: a restart costs a hand-over of every partition the member holds.
LIVE_MAX_AGE = 60.0


class MemberState(NamedTuple):
    """What the member last said about itself."""

    member: str
    pid: int
    mono: float  # time.monotonic() when written
    ts: float  # time.time() when written (for people reading the file)
    joined: bool  # holds a lease and has registered in the group
    safe: bool  # its lease is certainly alive (not fenced)
    nats: bool  # NATS round trips succeed
    leaving: bool  # shutting down
    # Owned partitions with work and no progress (progress.py); the leader moves them.
    # (A NamedTuple's default is shared: nobody mutates it.)
    stalled: list[int] = []
    # A partition stalled far longer than the leader needs to move it: stuck for good.
    wedged: bool = False
    # Why a server refuses the member, e.g. "NatsAuthFailed: ..." (empty: nothing).
    problem: str = ""
    # When the writing process started (/proc/<pid>/stat's starttime, clock ticks since
    # boot; 0: unknown): with the pid, which process wrote the state (process_gone()).
    started: int = 0


def process_start(pid: int | str = "self") -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22), or
    None if there is no such process or no /proc to tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses:
    # the fields after it start after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_gone(state: MemberState) -> bool:
    """Whether the process that wrote `state` has ended (its pid is free, or is another
    process's now). A container restarted after a crash finds the dead process's state
    file, fresh for a few seconds: without this check its pod was Ready before the new
    process had even started, and a SIGTERM then killed it before its handlers were
    installed (e2e/test_image_pods.py). Unknown (no /proc, an old file): not gone."""
    if not state.started or not os.path.exists("/proc/self/stat"):
        return False
    return process_start(state.pid) != state.started


def write_state(path: str | os.PathLike[str], state: MemberState) -> None:
    """Replace the file atomically (a probe never reads half a file)."""
    folder, name = os.path.split(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(state._asdict(), sort_keys=True))
    os.replace(tmp, path)


def read_state(path: str | os.PathLike[str]) -> MemberState:
    """The state in the file; OSError or ValueError if there is none or it is garbage."""
    with open(path) as f:
        data: Any = json.loads(f.read())
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        return MemberState(
            member=str(data["member"]),
            pid=int(data["pid"]),
            mono=float(data["mono"]),
            ts=float(data["ts"]),
            joined=bool(data["joined"]),
            safe=bool(data["safe"]),
            nats=bool(data["nats"]),
            leaving=bool(data["leaving"]),
            # (Absent from files written before stall checks existed.)
            stalled=[int(p) for p in data.get("stalled", [])],
            wedged=bool(data.get("wedged", False)),
            problem=str(data.get("problem", "")),
            started=int(data.get("started", 0)),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"missing or bad field: {exc}") from None


def _load(state_file: str) -> tuple[MemberState | None, str]:
    try:
        return read_state(state_file), ""
    except FileNotFoundError:
        return None, f"{state_file} does not exist (the member has not started yet)"
    except OSError as exc:
        return None, f"cannot read {state_file}: {exc.strerror or exc}"
    except ValueError as exc:
        return None, f"{state_file} is not a member state: {exc}"


def check(
    state_file: str, max_age: float = READY_MAX_AGE, now: float | None = None
) -> tuple[bool, str]:
    """Readiness: (ready, one line saying why)."""
    state, problem = _load(state_file)
    if state is None:
        return False, f"not ready: {problem}"
    age = (time.monotonic() if now is None else now) - state.mono
    who = f"member {state.member}"
    if age > max_age:
        return False, (
            f"not ready: {who} has not refreshed its state for {age:.1f} s "
            f"(> {max_age:g} s): its process is stuck or frozen"
        )
    if state.leaving:
        return False, f"not ready: {who} is leaving the group"
    if process_gone(state):
        return False, (
            f"not ready: the process that wrote {state_file} (pid {state.pid}) has ended; "
            "its successor has not written its own state yet"
        )
    if state.problem:
        return False, f"not ready: {who}: {state.problem}"
    if not state.joined:
        return False, f"not ready: {who} has not joined its group yet (etcd unreachable?)"
    if not state.safe:
        return False, (
            f"not ready: {who} is fenced (cannot renew its etcd lease) and consumes nothing"
        )
    if not state.nats:
        return False, f"not ready: {who} cannot reach NATS and has given its partitions up"
    if state.stalled:
        return False, (
            f"not ready: {who} has stalled partition(s) {state.stalled}: work and no "
            "progress; the leader moves them to other members"
        )
    return True, f"ready: {who} has joined, holds its lease and reaches NATS"


def check_live(
    state_file: str, max_age: float = LIVE_MAX_AGE, now: float | None = None
) -> tuple[bool, str]:
    """Liveness: (alive, one line). Only a stuck event loop fails it, never etcd or NATS
    being away (see the module's docstring)."""
    state, problem = _load(state_file)
    if state is None:
        # Not written yet: the process is still starting (the probe's initial delay and
        # failure threshold give it time), or it never got its loop running.
        return False, f"not alive: {problem}"
    age = (time.monotonic() if now is None else now) - state.mono
    if age > max_age:
        return False, (
            f"not alive: member {state.member} (pid {state.pid}) has not refreshed its "
            f"state for {age:.0f} s (> {max_age:g} s): its event loop is stuck"
        )
    if state.wedged:
        return False, (
            f"not alive: member {state.member} (pid {state.pid}) has held stalled "
            f"partition(s) {state.stalled} long after the leader should have moved them"
        )
    return True, f"alive: member {state.member} refreshed its state {age:.1f} s ago"


class HealthFile:
    """The member's side: rewrite the state file every REFRESH_SECONDS from the loop.

    `probe` returns the current state; it must only read memory (never wait on etcd or
    NATS), so that a stale file means exactly "the event loop did not run".
    """

    def __init__(
        self, path: str, probe: Callable[[], MemberState], interval: float = REFRESH_SECONDS
    ) -> None:
        self.path = path
        self.probe = probe
        self.interval = interval
        self._failing = False

    def write(self) -> None:
        import logging

        try:
            write_state(self.path, self.probe())
        except OSError as exc:  # a full or read-only /tmp: the probes will say so
            logging.getLogger(__name__).warning("Cannot write %s: %s", self.path, exc)
        except Exception:
            # A defect in the probe: the file goes stale and the probes fail (the state is
            # unknown), but the task goes on, and the log says why once. Raised, it ended
            # the task: the pod turned unready and was restarted with nothing logged.
            if not self._failing:
                logging.getLogger(__name__).exception(
                    "Cannot tell the member's state for the probes; they will fail"
                )
            self._failing = True
        else:
            self._failing = False

    async def run(self) -> None:
        import asyncio

        while True:
            self.write()
            await asyncio.sleep(self.interval)


def _parser() -> argparse.ArgumentParser:
    import argparse

    parser = argparse.ArgumentParser(
        prog="shoal-ready",
        description=(
            "Readiness (default) or liveness (--live) probe of a Shoal consumer pod. "
            "Exit 0: ready / alive; 1: not; 2: usage. One line says why."
        ),
        epilog=(
            "Ready: the member's state is fresh and it has joined its group, holds its etcd "
            "lease (not fenced), reaches NATS and is not leaving. Alive: the member's event "
            "loop refreshed its state within --max-age; etcd or NATS being down never fails "
            "liveness (restarting every pod during an outage only makes it worse)."
        ),
    )
    parser.add_argument(
        "state_file",
        nargs="?",
        metavar="STATE_FILE",
        help=f"the member's state file (default: ${ENV})",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="liveness: fail only if the state was not refreshed for --max-age seconds",
    )
    parser.add_argument(
        "--max-age",
        type=float,
        metavar="SECONDS",
        help=f"oldest acceptable state (default {READY_MAX_AGE:g} s for readiness, "
        f"{LIVE_MAX_AGE:g} s with --live)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in ([], ["--live"]):  # what the pod's probes run: no parser to import
        state_file, live, max_age = "", bool(argv), None
    else:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as exc:  # --help (0) or a usage error (2)
            return int(exc.code or 0)
        state_file, live, max_age = args.state_file, args.live, args.max_age
    state_file = state_file or os.environ.get(ENV, "")
    if not state_file:
        print(f"not ready: no state file given and {ENV} is not set", file=sys.stderr)
        return 2
    if live:
        ok, message = check_live(state_file, max_age or LIVE_MAX_AGE)
    else:
        ok, message = check(state_file, max_age or READY_MAX_AGE)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
