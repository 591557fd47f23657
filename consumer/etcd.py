"""An asyncio face on the synchronous etcd3 client.

etcd3 blocks; every call here runs in a worker thread so the event loop never stalls
(a stalled loop would miss lease keep-alives and fetch deadlines). Watches run on
etcd3's own watcher thread and are handed to the loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import etcd3
import etcd3.exceptions

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "etcd is not reachable right now": worth a retry, never a crash.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    TimeoutError,
)


_previous_excepthook = threading.excepthook


def _quiet_closed_watchers(args: threading.ExceptHookArgs) -> None:
    # etcd3's watcher thread has no stop: closing the client makes its blocked stream
    # raise "Cannot invoke RPC: Channel closed!" there, a traceback at every clean exit.
    thread = args.thread
    if (
        thread is not None
        and thread.name.startswith("etcd3_watch_")
        and isinstance(args.exc_value, ValueError)
        and "Channel closed" in str(args.exc_value)
    ):
        log.debug("etcd watcher thread ended with the closed client")
        return
    _previous_excepthook(args)


threading.excepthook = _quiet_closed_watchers


class EtcdUnavailable(RuntimeError):
    """etcd could not be reached within the allowed attempts."""


def parse_endpoints(value: str | Sequence[str]) -> list[tuple[str, int]]:
    """Parse "host:port,host2:port2" (an optional http:// is dropped) into pairs."""
    items = value.split(",") if isinstance(value, str) else list(value)
    endpoints: list[tuple[str, int]] = []
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        host, sep, port = item.rstrip("/").rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint {raw!r} is not host:port")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ValueError("no etcd endpoint given (set ETCD_ENDPOINTS or --etcd)")
    return endpoints


@dataclass(frozen=True)
class KV:
    """One key as etcd last reported it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


class Etcd:
    """A connection to one of several etcd endpoints, with async wrappers."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 3.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self._index = 0
        self.client: Any = self._make_client()
        # Our own threads: a hand-over issues dozens of claims and releases at once, and
        # asyncio's default executor (cores + 4 threads) would queue them one behind the
        # other. The gRPC channel multiplexes the calls.
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="etcd")

    def _make_client(self) -> Any:
        host, port = self.endpoints[self._index % len(self.endpoints)]
        return etcd3.client(host=host, port=port, timeout=self.timeout)

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self._index % len(self.endpoints)]
        return f"{host}:{port}"

    def rotate(self) -> None:
        """Move to the next endpoint (after a connection failure)."""
        if len(self.endpoints) > 1:
            self._index += 1
            self.client.close()
            self.client = self._make_client()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def connect(self, *, attempts: int | None = None, max_delay: float = 10.0) -> None:
        """Wait until etcd answers, retrying with capped exponential backoff and jitter."""
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.call(self.client.status)
                if attempt > 1:
                    log.info("Connected to etcd at %s after %d attempts", self.endpoint, attempt)
                return
            except TRANSIENT_ERRORS as exc:
                if attempts is not None and attempt >= attempts:
                    raise EtcdUnavailable(
                        f"etcd at {self.endpoint} unreachable after {attempt} attempts: {exc}"
                    ) from exc
                log.warning(
                    "etcd at %s unreachable (%s); retrying in %.1f s", self.endpoint, exc, delay
                )
                self.rotate()
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, max_delay)

    async def get_prefix(self, prefix: str) -> tuple[int, dict[str, KV]]:
        """All keys under prefix and the store revision they were read at."""
        response = await self.call(self.client.get_prefix_response, prefix)
        kvs = {
            kv.key.decode(): KV(
                kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease
            )
            for kv in response.kvs
        }
        return int(response.header.revision), kvs

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self.call(self.client.put, key, value, lease=lease)

    async def delete(self, key: str) -> bool:
        return bool(await self.call(self.client.delete, key))

    async def delete_prefix(self, prefix: str) -> None:
        await self.call(self.client.delete_prefix, prefix)

    async def create_returning_revision(
        self, key: str, value: bytes, lease: int | None
    ) -> int | None:
        """Create key only if absent; its create_revision if we created it, else None.

        One round trip: the put and a read of the new key in the same transaction.
        """
        tx = self.client.transactions
        ok, responses = await self.call(
            self.client.transaction,
            compare=[tx.create(key) == 0],
            success=[tx.put(key, value, lease=lease), tx.get(key)],
            failure=[],
        )
        if not ok:
            return None
        for response in responses:
            if isinstance(response, list) and response:
                _value, meta = response[0]
                return int(meta.create_revision)
        return None

    async def delete_if_created_at(self, key: str, create_revision: int) -> bool:
        """Delete key only if it is still the incarnation created at create_revision."""
        tx = self.client.transactions
        ok, _ = await self.call(
            self.client.transaction,
            compare=[tx.create(key) == create_revision],
            success=[tx.delete(key)],
            failure=[],
        )
        return bool(ok)

    async def guarded_put_many(
        self, guard_key: str, guard_create_revision: int, items: dict[str, bytes]
    ) -> bool:
        """Put all items in one transaction that holds only if guard_key has that incarnation.

        etcd allows 128 operations per transaction by default; larger writes go in chunks,
        each guarded on its own, so a deposed writer stops at the first failed chunk.
        """
        tx = self.client.transactions
        keys = sorted(items)
        for start in range(0, len(keys), 128):
            chunk = keys[start : start + 128]
            ok, _ = await self.call(
                self.client.transaction,
                compare=[tx.create(guard_key) == guard_create_revision],
                success=[tx.put(k, items[k]) for k in chunk],
                failure=[],
            )
            if not ok:
                return False
        return True

    async def grant_lease(self, ttl: int) -> int:
        lease = await self.call(self.client.lease, ttl)
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        """Send one keep-alive; return the remaining TTL (0 or less: the lease is gone)."""
        responses = await self.call(lambda: list(self.client.refresh_lease(lease_id)))
        if not responses:
            return 0
        return int(responses[-1].TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        await self.call(self.client.revoke_lease, lease_id)

    def add_watch_prefix(
        self, prefix: str, start_revision: int, callback: Callable[[Any], None]
    ) -> int:
        """Blocking: register a watch (call via `call`). The callback runs on etcd3's thread."""
        return int(
            self.client.add_watch_prefix_callback(prefix, callback, start_revision=start_revision)
        )

    def cancel_watch(self, watch_id: int) -> None:
        try:
            self.client.cancel_watch(watch_id)
        except Exception:  # cancelling a watch on a dead connection is not an error
            log.debug("Cancelling watch %s failed", watch_id, exc_info=True)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            log.debug("Closing the etcd client failed", exc_info=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
