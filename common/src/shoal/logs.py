"""What every Shoal command shares about logging: the --log-level option and the set-up."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

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
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
