"""Handlers for tests and fault scenarios (members run them as `harness.handlers:<name>`).

`scripted_ledger` records like the `ledger` handler of shoal.consumer.handlers, after doing
what the message's data says: ``wait:<ms>`` awaits that long (an I/O-bound handler),
``fail:<n>`` fails its first n attempts, ``poison`` fails every attempt, ``permanent``
raises PermanentError (dead-lettered at once), ``hang`` never returns, ``hang-on:<member>``
never returns on that member only (a pod whose downstream connection is wedged),
``fail-runs:<n>`` fails the first n times it actually runs, whichever member runs it
(counted in files under $SHOAL_TEST_STATE_DIR: attempts, not JetStream's deliveries),
``permanent-runs:<n>`` raises PermanentError the first n times it runs, counted alike (a
message dead-lettered at once that succeeds once redriven),
``wait-on:<member>:<ms>`` awaits that long on that member only (a slow pod), ``cancelled``
raises CancelledError although nobody cancelled the handler,
``deaf-on:<member>`` never returns on that member and ignores being cancelled (a handler
stuck in code that swallows CancelledError: only ending the process stops it),
``hang-then-raise`` never returns, and raises ScriptedFailure when it is cancelled (a
cleanup that raised: the cancel becomes an ordinary error).

`stamped` is `noop` that also notes when each message finished (time.monotonic(), one
clock for every process of the machine) and writes the times, as float64s, to
$SHOAL_STAMPS_FILE when the member exits: bench/ramp.py reads from them what the
member's handler saw, second by second, at the cost of a list append per message.

`slow_ledger` is the `ledger` handler of shoal.consumer.handlers with two differences a
scenario needs: a message whose data is ``sleep:<seconds>[:<cleanup>]`` takes that long
(and, when cancelled, `cleanup` seconds more to stop), and the
record is published without `msg.ensure_owned()`. It models a handler whose side effect
is not guarded, so the ledger shows when such a handler ran on after its member lost
the partition (the overlap a fence or a shutdown must prevent by stopping the handler,
since not every handler guards itself).
"""

from __future__ import annotations

import array
import asyncio
import atexit
import json
import logging
import os
import time
from pathlib import Path

from shoal.consumer.handlers import Message, PermanentError, noop
from shoal.contracts.names import SEQ_HEADER, ledger_subject

__all__ = ["SLEEP_PREFIX", "scripted_ledger", "slow_ledger", "stamped"]

log = logging.getLogger(__name__)

SLEEP_PREFIX = b"sleep:"


_STAMPS = array.array("d")


def _write_stamps() -> None:
    path = os.environ.get("SHOAL_STAMPS_FILE")
    if path:
        with open(path, "wb") as out:
            _STAMPS.tofile(out)


atexit.register(_write_stamps)


async def stamped(msg: Message) -> None:
    await noop(msg)
    _STAMPS.append(time.monotonic())


def read_stamps(path: Path) -> list[float]:
    """The times a `stamped` member wrote, in order."""
    stamps = array.array("d")
    stamps.frombytes(path.read_bytes())
    return sorted(stamps)


async def slow_ledger(msg: Message) -> None:
    started = time.time()
    if msg.data.startswith(SLEEP_PREFIX):
        seconds, _, cleanup = msg.data[len(SLEEP_PREFIX) :].decode().partition(":")
        log.info("Slow message %s: %s s", msg.message_id, seconds)
        try:
            await asyncio.sleep(float(seconds))
        except asyncio.CancelledError:
            # Stopping takes time too (say, rolling a transaction back): `cleanup` s.
            await asyncio.sleep(float(cleanup or 0))
            # When it stopped, for scenarios that compare it with the next owner's start.
            log.warning("Slow message %s stopped at %.3f (cancelled)", msg.message_id, time.time())
            raise
        log.info("Slow message %s stopped at %.3f (done)", msg.message_id, time.time())
    await _record(msg, started)


async def _record(msg: Message, started: float) -> None:
    seq = msg.headers.get(SEQ_HEADER, "")
    record = {
        "project_id": msg.project_id,
        "message_id": msg.message_id,
        "seq": int(seq) if seq.isdigit() else None,
        "partition": msg.partition,
        "member": msg.context.member_id,
        "delivery_count": msg.delivery_count,
        "stream_sequence": msg.stream_sequence,
        "started": started,
        "finished": time.time(),
    }
    await msg.context.js.publish(
        ledger_subject(msg.context.subject_prefix, msg.partition),
        json.dumps(record, separators=(",", ":")).encode(),
    )


def _count_run(message_id: str, *, add: bool = True) -> int:
    """How many times this message has run so far, over every member (this run too)."""
    path = Path(os.environ["SHOAL_TEST_STATE_DIR"]) / f"{message_id}.runs"
    if add:
        with path.open("a") as runs:
            runs.write(f"{os.getpid()}\n")
    return len(path.read_text().splitlines()) if path.exists() else 0


class ScriptedFailure(RuntimeError):
    """What `scripted_ledger` raises for ``fail:<n>`` and ``poison`` messages."""


async def scripted_ledger(msg: Message) -> None:
    started = time.time()
    command, _, arg = msg.data.decode(errors="replace").partition(":")
    if command == "wait":
        await asyncio.sleep(float(arg) / 1000)
    elif command == "fail" and msg.delivery_count <= int(arg):
        raise ScriptedFailure(f"attempt {msg.delivery_count} of {msg.message_id} fails")
    elif command == "poison":
        raise ScriptedFailure(f"{msg.message_id} is poison")
    elif command == "permanent":
        raise PermanentError(f"{msg.message_id} can never succeed")
    elif command == "hang" or (command == "hang-on" and arg == msg.context.member_id):
        await asyncio.Event().wait()
    elif command == "wait-on":
        member, _, ms = arg.partition(":")
        if member == msg.context.member_id:
            await asyncio.sleep(float(ms) / 1000)
    elif command == "deaf-on" and arg == msg.context.member_id:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                log.warning("Handler of %s ignores its cancellation", msg.message_id)
    elif command == "hang-then-raise":
        try:
            await asyncio.Event().wait()
        finally:
            raise ScriptedFailure(f"cleanup of {msg.message_id} failed")
    elif command == "cancelled":
        raise asyncio.CancelledError()  # as a task of its own cancelled under it would
    elif command == "fail-runs" and _count_run(msg.message_id) <= int(arg):
        raise ScriptedFailure(f"run {_count_run(msg.message_id, add=False)} of {msg.message_id}")
    elif command == "permanent-runs" and _count_run(msg.message_id) <= int(arg):
        raise PermanentError(f"run {_count_run(msg.message_id, add=False)} of {msg.message_id}")
    msg.ensure_owned()
    await _record(msg, started)
