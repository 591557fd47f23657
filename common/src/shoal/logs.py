"""What every Shoal command shares about logging: the --log-level option and the set-up.

Importing a Shoal module changes nothing process-wide: what quiets the libraries' known
noise is installed by `quiet_known_noise`, which `setup_logging` (every command) calls;
tests and benchmarks call it themselves.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable

import click

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log_level_option = click.option(
    "--log-level",
    envvar="SHOAL_LOG_LEVEL",
    default="info",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    help="Log level [env SHOAL_LOG_LEVEL].",
)


def setup_logging(level: str, *, quiet: Iterable[str] = ()) -> None:
    """Log to stderr at `level`; the `quiet` loggers (chatty libraries) only from WARNING."""
    logging.basicConfig(level=getattr(logging, level.upper()), format=FORMAT, stream=sys.stderr)
    quiet_known_noise()
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


class _EofWarning(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl"
    each time a nats-py TLS connection ends (its protocol is a StreamReaderProtocol):
    noise that would follow every refused attempt and every close."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


class _QuietClosedWatchers:
    """A threading.excepthook: etcd3's watcher thread has no stop, so closing the client
    makes its blocked stream raise "Cannot invoke RPC: Channel closed!" there, a
    traceback at every clean exit. Everything else goes to the hook it replaced."""

    def __init__(self, previous: Callable[[threading.ExceptHookArgs], object]) -> None:
        self.previous = previous

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        thread = args.thread
        if (
            thread is not None
            and thread.name.startswith("etcd3_watch_")
            and isinstance(args.exc_value, ValueError)
            and "Channel closed" in str(args.exc_value)
        ):
            logging.getLogger(__name__).debug("etcd watcher thread ended with the closed client")
            return
        self.previous(args)


def quiet_known_noise() -> None:
    """Silence the two known, harmless messages of libraries Shoal uses (see
    _EofWarning, _QuietClosedWatchers), process-wide. Idempotent."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _EofWarning) for f in asyncio_log.filters):
        asyncio_log.addFilter(_EofWarning())
    if not isinstance(threading.excepthook, _QuietClosedWatchers):
        threading.excepthook = _QuietClosedWatchers(threading.excepthook)
