"""The member's NATS client: nats-py's, with a direct path for its pull replies.

nats-py turns every message into a ``Msg``: it decodes the subject and the reply
subject, parses every header into a dict, queues the message for the subscription's
task and awaits the callback from there. For a member reading tens of thousands of
messages a second that was a third of its CPU (py-spy on the noop throughput bench:
header parsing alone 14 % of the samples, building the Msg 5 %, the queue and the
subscription task 5 %), and most of it is work nobody needs: the member itself reads
one header (the project id) and the reply subject; the handler may read the headers,
or not.

So a subscription registered with :meth:`DirectClient.route_directly` skips all that:
its JetStream messages (those with a reply subject) go, as they are read, to a plain
function with the raw bytes, which wraps them in a :class:`Delivery`: headers parsed
only when someone reads them (:class:`LazyHeaders`), the same ack verbs as ``Msg``.
Statuses (no reply subject: 404/408/409, heartbeats) still have their headers parsed
by nats-py and go to a second function, in the order they were read. Every other
subscription takes nats-py's own path, unchanged.

Reading and acking are lean as well: :class:`FastParser` replaces nats-py's protocol
parser for messages, and :meth:`DirectClient.publish_ack` publishes an ack without
``publish()``'s per-call checks, and lets the acks of the next millisecond join it in one
write (ACK_FLUSH_DELAY).

All this leans on private parts of nats-py 2.16: ``Client._process_msg`` and
``_process_info`` (overridden; TLSClient's refusal of a server without TLS),
``_process_headers``, ``_send_command``, ``_flush_pending``, ``_flush_queue``,
``_pending``, ``_pending_data_size``, ``_max_pending_size``, ``_subs``, ``_ps`` and the
parser's state; its tests also read ``_resp_map``. ``tests/test_natsclient.py`` checks
them against nats-py itself (the same parser calls for random wires cut anywhere, the
same headers for odd header blocks) and the direct path against a real nats-server, so a
nats-py upgrade that moves them fails there first. (docs/journal/ has the measurements.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, ItemsView, Iterator, Mapping
from typing import Any

from nats import errors
from nats.aio.client import Client
from nats.protocol.parser import AWAITING_CONTROL_LINE, AWAITING_MSG_PAYLOAD, Parser

from shoal.clients.backoff import QuietLog
from shoal.clients.natsauth import TLSNotOffered

log = logging.getLogger(__name__)

# A header block starts with this line (no inline status on a JetStream message).
_HEADER_LINE = b"NATS/1.0\r\n"
_CRLF = b"\r\n"
_WHITESPACE = re.compile(r"\s")

# How long an ack waits for the acks after it before they are written together. The
# server gives a message ack_wait (30 s by default) for its ack; a hand-over flushes with
# a round trip before it releases a partition (worker._let_go), and close() writes what
# is pending. Written at once, each ack of a member whose handlers finish one by one
# (a 20 ms handler, an HTTP service) cost a write of its own: 20 % of such a member's
# samples (py-spy) were the flusher's writelines.
ACK_FLUSH_DELAY = 0.001

OnMessage = Callable[["Delivery"], None]
OnStatus = Callable[[str, dict[str, str]], None]


def parse_headers(raw: bytes | None) -> dict[str, str]:
    """A message's header block (``NATS/1.0\\r\\nName: value\\r\\n...``) as nats-py gives
    it: names and values stripped, values decoded as UTF-8 (bad bytes replaced), lines
    without a colon and names that are not ASCII or contain whitespace skipped, the last
    of repeated names kept. (For a JetStream message: statuses take nats-py's path.)"""
    out: dict[str, str] = {}
    if not raw:
        return out
    for line in raw[len(_HEADER_LINE) :].split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if _WHITESPACE.search(key):  # header names are tokens
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def header_value(raw: bytes | None, name: bytes) -> str | None:
    """One header's value from a header block, without parsing the others; what
    ``parse_headers(raw).get(name)`` gives."""
    if not raw:
        return None
    # The last occurrence: parse_headers keeps the last of repeated names.
    at = raw.rfind(_CRLF + name + b":")
    if at < 0 or raw.count(name) > 1:
        # Not in the plain "Name:" form (spaces around the name, say), or named more
        # than once, perhaps in another form (" Name :" after "Name:", which the last
        # plain line would not see): parse it all, as a handler's msg.headers does.
        return parse_headers(raw).get(name.decode("ascii"))
    start = at + len(name) + 3
    end = raw.find(_CRLF, start)
    return raw[start : end if end >= 0 else len(raw)].strip().decode("utf-8", "replace")


class LazyHeaders(Mapping[str, str]):
    """A message's headers, parsed the first time anyone reads them."""

    __slots__ = ("_parsed", "_raw")

    def __init__(self, raw: bytes | None) -> None:
        self._raw = raw
        self._parsed: dict[str, str] | None = None

    def _dict(self) -> dict[str, str]:
        parsed = self._parsed
        if parsed is None:
            parsed = self._parsed = parse_headers(self._raw)
        return parsed

    def __getitem__(self, key: str) -> str:
        return self._dict()[key]

    # The dict's own get, items and `in`: Mapping's generic ones go through __getitem__
    # key by key, and its get raises and catches KeyError for every header a message
    # lacks (the member asks for two such headers per message for its message id).
    def get(self, key: str, default: Any = None) -> Any:
        return self._dict().get(key, default)

    def items(self) -> ItemsView[str, str]:
        return self._dict().items()

    def __contains__(self, key: object) -> bool:
        return key in self._dict()

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __repr__(self) -> str:
        return f"LazyHeaders({self._dict()!r})"


class Delivery:
    """A JetStream message as the direct path hands it over: what a member needs of
    nats-py's ``Msg`` (subject, reply, data, headers and the ack verbs), without the
    work it does not need on every message."""

    __slots__ = ("_client", "_headers", "_raw_headers", "_subject", "data", "reply")

    def __init__(
        self,
        client: DirectClient,
        subject: bytes,
        reply: str,
        data: bytes,
        raw_headers: bytes | None,
    ) -> None:
        self._client = client
        self._subject = subject
        self.reply = reply
        self.data = data
        self._raw_headers = raw_headers
        self._headers: LazyHeaders | None = None

    @property
    def subject(self) -> str:
        return self._subject.decode()

    @property
    def headers(self) -> LazyHeaders:
        headers = self._headers
        if headers is None:
            headers = self._headers = LazyHeaders(self._raw_headers)
        return headers

    def header(self, name: bytes) -> str | None:
        """One header's value, without parsing the others."""
        return header_value(self._raw_headers, name)

    async def ack(self) -> None:
        if not self._client.queue_ack(self.reply):
            await self._client.publish_ack(self.reply)

    async def nak(self, delay: float | None = None) -> None:
        payload = b"-NAK"
        if delay:
            payload += b" " + json.dumps({"delay": int(delay * 1e9)}).encode()
        await self._client.publish_ack(self.reply, payload)

    async def term(self) -> None:
        await self._client.publish_ack(self.reply, b"+TERM")

    async def in_progress(self) -> None:
        await self._client.publish_ack(self.reply, b"+WPI")


_H, _M = ord("H"), ord("M")


def _message_line(line: bytes) -> tuple[bytes, int, bytes, int, int] | None:
    """(subject, sid, reply, header size, total size) of a ``MSG`` or ``HMSG`` line, read
    as nats-py's grammar reads it; None for any other line, which nats-py's parser then
    takes. (A split and int() cost 0.5 us a message where the regular expression took
    0.8.)"""
    args = line.split()
    n = len(args)
    if not args or not args[-1].isdigit() or line[-1:].isspace():
        return None
    try:
        if args[0] == b"HMSG" and args[-2].isdigit():
            if n == 6:
                return args[1], int(args[2]), args[3], int(args[4]), int(args[5])
            if n == 5:
                return args[1], int(args[2]), b"", int(args[3]), int(args[4])
        elif args[0] == b"MSG":
            if n == 5:
                return args[1], int(args[2]), args[3], 0, int(args[4])
            if n == 4:
                return args[1], int(args[2]), b"", 0, int(args[3])
    except ValueError:  # a sid that is not a number: nats-py says so
        pass
    return None


class FastParser(Parser):
    """nats-py's protocol parser, with a fast path for messages.

    nats-py's parser tries its regular expressions on the front of a bytearray, deletes
    each line and each message from that front, and copies every payload twice: a
    quarter of a busy member's CPU (py-spy). This one walks a single copy of what was
    read with an offset, splits a message's line on whitespace and slices its
    header block and payload once. Anything that is not a message (PING, PONG, +OK,
    -ERR, INFO) goes to nats-py's parser, with the same state (buf, state, msg_arg,
    needed, header_needed), so either can go on where the other stopped.
    """

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        if self.state == AWAITING_MSG_PAYLOAD and len(buf) < self.needed + 2:
            # Still inside a message's payload: copying the buffer on every read made a
            # large payload (a raised max_payload) cost time in its square: 8 s for 32 MB
            # read 32 KB at a time (nats-py's parser: 0.05 s).
            return
        view = bytes(buf)
        end = len(view)
        pos = 0
        nc = self.nc
        # A client that can take a message without a coroutine (DirectClient.take).
        take = getattr(nc, "take", None)
        try:
            while pos < end:
                if self.state == AWAITING_MSG_PAYLOAD:
                    needed = self.needed
                    if end - pos < needed + 2:
                        break  # the rest of this message is still to come
                    a = self.msg_arg
                    sid, subject, reply = a["sid"], a["subject"], a["reply"]
                    header_size = self.header_needed
                    self.header_needed = 0
                    self.state = AWAITING_CONTROL_LINE
                else:
                    first = view[pos]
                    eol = view.find(b"\r\n", pos)
                    if eol < 0:
                        break  # a line not complete yet
                    # MSG <subject> <sid> [reply] <size>
                    # HMSG <subject> <sid> [reply] <header size> <size>
                    parsed = _message_line(view[pos:eol]) if first == _H or first == _M else None
                    if parsed is None:
                        # Not a message: nats-py's parser takes it (and the rest of this
                        # read), and says what is wrong with a line it cannot parse.
                        del buf[:pos]
                        pos = 0
                        await super().parse()
                        return
                    subject, sid, reply, header_size, needed = parsed
                    pos = eol + 2
                    if end - pos < needed + 2:
                        # The rest comes with the next read: the state nats-py keeps.
                        self.msg_arg.update(subject=subject, sid=sid, reply=reply)
                        self.needed = needed
                        self.header_needed = header_size
                        self.state = AWAITING_MSG_PAYLOAD
                        break
                if header_size:
                    headers: bytes | None = view[pos : pos + header_size]
                    payload = view[pos + header_size : pos + needed]
                else:
                    headers = None
                    payload = view[pos : pos + needed]
                pos += needed + 2
                if take is None or not take(sid, subject, reply, payload, headers):
                    await nc._process_msg(sid, subject, reply, payload, headers)
        finally:
            if pos:
                del buf[:pos]


def reraise_dropped_cancel(cancels_before: int = 0) -> None:
    """Raise CancelledError if this task was cancelled and the cancellation got lost.

    nats-py waits for every request's answer with asyncio.wait_for, which on Python 3.11
    returns the answer when a cancellation arrives in the loop iteration that brings it,
    and drops the cancellation (CPython gh-86296; Shoal's own code uses asyncio.timeout,
    and ruff bans wait_for). The task stays marked as cancelling, so a call that counts
    the task's cancellations before it waits can tell, after, that one arrived and was
    not raised, and raise it. The count, not "is it cancelling": a `finally:` that
    cleans up after a cancellation runs while the task is marked cancelling, and its
    requests must still return their answers."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > cancels_before:
        raise asyncio.CancelledError


class TLSClient(Client):
    """nats-py's client, refusing a server that does not offer TLS when TLS is
    configured: before its CONNECT is written, at every connection (reconnects too).
    What answers on the NATS address without TLS (a server set to allow_non_tls, the
    wrong Service, an impostor) gets nothing."""

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if (
            initial_connection
            and not info.get("tls_required")
            and not self.options.get("tls_handshake_first")
            and self._tls_configured()
        ):
            server = self._current_server.uri.netloc if self._current_server else "?"
            raise TLSNotOffered(
                f"the NATS server at {server} does not offer TLS, which this client is "
                "configured for: refusing to send it the credentials in the clear"
            )
        await super()._process_info(info, initial_connection)

    def _tls_configured(self) -> bool:
        server = self._current_server
        return "tls" in self.options or (server is not None and server.uri.scheme == "tls")


class DirectClient(TLSClient):
    """nats-py's client; see the module docstring for what `route_directly` changes."""

    def __init__(self) -> None:
        super().__init__()
        # Set once the connection is closed for good (shoal.clients.nats.connect
        # sets it from its closed callback; the member's runtime waits on it).
        self.closed_event = asyncio.Event()
        self._ps = FastParser(self)
        self._direct: dict[int, tuple[OnMessage, OnStatus]] = {}
        # The timer of the acks' next flush (publish_ack), while one is due.
        self._ack_flush: asyncio.TimerHandle | None = None
        self._callback_failures = QuietLog(log)

    def route_directly(self, sub: Any, on_message: OnMessage, on_status: OnStatus) -> None:
        """Send `sub`'s JetStream messages to `on_message` and its statuses to
        `on_status`, both called as each is read (neither may block)."""
        self._direct[sub._id] = (on_message, on_status)

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Any:
        """nats-py's request (JetStream's API calls and publishes go through it), refused
        up front when its publish would be: nats-py registers the reply's future before
        it publishes, and only an answer or the timeout removes it, so every request
        whose publish raised (the reconnect buffer full while NATS is away) stayed in
        `_resp_map` for good. A member asking for its lag, its health and its dead
        letters through a long outage grew by about a megabyte a minute.

        And nats-py waits for the answer with asyncio.wait_for, which drops a cancellation
        that arrives with the answer (see reraise_dropped_cancel): raised again here, for
        every JetStream call a loop makes."""
        if self.is_closed:
            raise errors.ConnectionClosedError
        if not self.is_connected and (
            self._max_pending_size <= 0
            or self._pending_data_size + len(payload) + len(subject) >= self._max_pending_size
        ):
            raise errors.OutboundBufferLimitError
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            answer = await super().request(
                subject, payload, timeout=timeout, old_style=old_style, headers=headers
            )
        except Exception:
            reraise_dropped_cancel(cancels)  # a timeout, say, that won over a cancel
            raise
        reraise_dropped_cancel(cancels)
        return answer

    async def _flush_pending(self, force_flush: bool = False) -> Any:
        """nats-py's, which waits for a flush it forced (more pending than the buffer
        holds: NATS slow or away) and swallows a cancellation that comes meanwhile: a
        publish, or an ack, cancelled there returned as if it had not been. Raised again."""
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        result = await super()._flush_pending(force_flush=force_flush)
        reraise_dropped_cancel(cancels)
        return result

    def queue_ack(self, subject: str, payload: bytes = b"+ACK") -> bool:
        """Queue an ack (or another verb) for a JetStream reply subject, without a
        coroutine, when that is all it takes: the connection is up, the pending buffer
        has room, and a flush is on its way already (queued by an earlier publish in this
        turn of the event loop, or an ack's flush due within ACK_FLUSH_DELAY). Otherwise
        queue nothing and return False: the caller awaits `publish_ack`."""
        queue = self._flush_queue
        if (
            self._status != Client.CONNECTED
            or queue is None
            or (queue.empty() and self._ack_flush is None)
        ):
            return False
        cmd = self._ack_command(subject, payload)
        size = self._pending_data_size + len(cmd)
        if self._max_pending_size > 0 and size > self._max_pending_size:
            return False
        self._count_out(payload)
        self._pending.append(cmd)
        self._pending_data_size = size
        return True

    async def publish_ack(self, subject: str, payload: bytes = b"+ACK") -> None:
        """Publish an ack (or another verb) to a JetStream reply subject: what
        ``publish(subject, payload)`` does, without checks that cannot fail here (the
        server made the subject; no headers, no reply) and at a tenth of its cost. While
        not connected, ``publish`` itself decides (buffer or refuse)."""
        if self._status != Client.CONNECTED:
            await self.publish(subject, payload)
            return
        self._count_out(payload)
        await self._send_command(self._ack_command(subject, payload))
        # Unlike publish, not at once: in ACK_FLUSH_DELAY, with the acks that follow.
        if self._flush_queue is not None and self._flush_queue.empty():
            self._schedule_ack_flush()

    def _schedule_ack_flush(self) -> None:
        if self._ack_flush is None:
            loop = asyncio.get_running_loop()
            self._ack_flush = loop.call_later(ACK_FLUSH_DELAY, self._flush_acks)

    def _flush_acks(self) -> None:
        """Wake the flusher for the acks pending, unless a flush is queued already (it
        writes them too) or the connection is down (nats-py writes what is pending once
        it is back, and before it closes)."""
        self._ack_flush = None
        queue = self._flush_queue
        if self._status != Client.CONNECTED or queue is None or not queue.empty():
            return
        if self._pending_data_size > 0:
            queue.put_nowait(asyncio.get_running_loop().create_future())

    @staticmethod
    def _ack_command(subject: str, payload: bytes) -> bytes:
        return b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(payload), payload)

    def _count_out(self, payload: bytes) -> None:
        stats = self.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += len(payload)

    def take(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> bool:
        """The direct path for a JetStream message of a routed subscription, without a
        coroutine (FastParser calls this first); False for anything else."""
        direct = self._direct.get(sid)
        if direct is None or not reply or sid not in self._subs:
            return False
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            direct[0](Delivery(self, subject, reply.decode(), data, headers))
        except Exception:
            # Called inside nats-py's read loop, which an exception would end for good
            # (the connection then reads nothing more). The message is dropped here;
            # JetStream delivers it again after ack_wait. At most a traceback per 10 s:
            # one that fails every time must not flood the log from the read loop.
            self._callback_failures.failed(
                logging.ERROR,
                "A delivery on %s could not be taken; dropped",
                subject.decode(),
                exc_info=True,
            )
        return True

    async def _process_msg(
        self,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: bytes,  # (or None: nats-py's own annotation says bytes)
    ) -> None:
        if self.take(sid, subject, reply, data, headers):
            return
        direct = self._direct.get(sid)
        if direct is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        elif sid not in self._subs:  # unsubscribed: nats-py drops what still comes
            del self._direct[sid]
        else:  # a status: no reply subject
            self.stats["in_msgs"] += 1
            try:
                status = await self._process_headers(headers)
                direct[1](subject.decode(), status or {})
            except Exception:  # in the read loop too (see take)
                self._callback_failures.failed(
                    logging.ERROR,
                    "A status on %s could not be taken; dropped",
                    subject.decode(),
                    exc_info=True,
                )
