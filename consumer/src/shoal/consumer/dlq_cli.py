"""`shoal-consumer dlq`: a group's dead letters from the command line (list, show,
redrive, purge). What they read and write is shoal.group.deadletters; this is the
commands' options and output."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from shoal.clients.natsauth import NatsConfigError
from shoal.consumer.cli_options import (
    command_config,
    group_option,
    jetstream_refused,
    namespace_option,
    nats_option,
    no_answer,
    option,
    or_dash,
    stream_option,
    subject_prefix_option,
)
from shoal.contracts.names import DEAD_LETTER_REASON_HEADER, format_time

if TYPE_CHECKING:
    from shoal.group.config import GroupConfig
    from shoal.group.deadletters import Selection

__all__ = ["dlq"]

T = TypeVar("T")


@click.group()
def dlq() -> None:
    """A group's dead letters: list, show, redrive, purge.

    \b
    A message is dead-lettered when its handler raises PermanentError (an HTTP handler
    answers 4xx), fails maxDeliver attempts, or JetStream stops delivering it: a copy
    goes to <prefix>.dlq.<partition>, in the stream <stream>_dlq, with its original
    headers plus Shoal-Dead-Letter-Reason, Shoal-Original-Subject and Shoal-Member.
    It stays there until redriven or purged.

    NATS TLS and credentials: NATS_CA_FILE, NATS_CERT_FILE, NATS_KEY_FILE,
    NATS_CREDS_FILE, NATS_USER/NATS_PASSWORD, NATS_NKEY_SEED_FILE, NATS_JS_API_PREFIX
    (see `run --help`).
    """


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    from shoal.contracts.names import parse_since

    if value is None:
        return None
    try:
        return parse_since(value).timestamp()
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("--since "), ctx, param) from None


def _dead_letters_command(command: Callable[..., None]) -> Callable[..., None]:
    """The options every dlq command takes, given to it as `config` (which group, and
    where: -g, -n, --nats, --subject-prefix, --stream; security and NATS_JS_API_PREFIX
    from the environment, as `run` reads them) and `selection` (which dead letters:
    --project, --reason, --since)."""

    @functools.wraps(command)
    def run(
        group: str,
        namespace: str,
        nats_url: str,
        subject_prefix: str | None,
        stream: str | None,
        project: str | None,
        reason: str | None,
        since: float | None,
        **rest: Any,
    ) -> None:
        from shoal.group.deadletters import Selection

        config = command_config(
            group=group,
            namespace=namespace,
            nats_url=nats_url,
            subject_prefix=subject_prefix,
            stream=stream,
        )
        command(config, Selection(project=project, reason=reason, since=since), **rest)

    options = (
        group_option,
        namespace_option,
        nats_option,
        subject_prefix_option,
        stream_option,
        click.option("--project", default=None, help="Only this project's dead letters."),
        click.option(
            "--reason",
            default=None,
            help="Only dead letters whose reason contains this text (case-insensitive).",
        ),
        click.option(
            "--since",
            callback=_since,
            default=None,
            help="Only dead letters stored at or after this time: RFC 3339 "
            "(2026-11-21T10:00:00Z), a date (2026-11-21) or a duration back from now "
            "(30m, 24h, 7d).",
        ),
    )
    for decorate in reversed(options):
        run = decorate(run)
    return run


def _with_jetstream(config: GroupConfig, work: Callable[[Any, Any], Awaitable[T]]) -> T:
    """asyncio.run(work(nc, js)) on a connection to the group's NATS; the errors a user
    can act on as one line."""
    from shoal.clients.nats import connect
    from shoal.group.deadletters import DeadLetterError

    async def go() -> T:
        nc = await connect(
            config.nats_url, name="shoal-dlq", attempts=3, security=config.nats_security()
        )
        try:
            return await work(nc, nc.jetstream(prefix=config.nats_js_api_prefix))
        finally:
            await nc.close()

    from nats.errors import NoRespondersError
    from nats.js.errors import APIError

    from shoal.group.jetstream import MessageDeleteError

    try:
        return asyncio.run(go())
    except (DeadLetterError, NatsConfigError, ConnectionError) as exc:
        raise click.ClickException(str(exc)) from None
    except TimeoutError:
        raise click.ClickException(no_answer(config.nats_url)) from None
    except (NoRespondersError, APIError) as exc:  # not enabled, no permission, ...
        raise click.ClickException(jetstream_refused(exc, config.nats_url)) from None
    except MessageDeleteError as exc:
        raise click.ClickException(f"JetStream refused to delete a dead letter: {exc}") from None


def _where(config: GroupConfig) -> str:
    return f"group {config.namespace}/{config.group}"


@dlq.command("list")
@_dead_letters_command
@option(
    "--top",
    type=click.IntRange(1),
    default=20,
    show_default=True,
    help="Projects to list, most dead letters first (--json lists all).",
)
@option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def dlq_list(
    config: GroupConfig,
    selection: Selection,
    top: int,
    as_json: bool,
) -> None:
    """Count a group's dead letters: by reason, by project, the oldest and the newest.

    \b
    Example:
      shoal-consumer dlq list -g orders -n prod --since 24h
    """
    from shoal.group.deadletters import ranked, scan, summarize

    async def work(nc: Any, js: Any) -> Any:
        return summarize(await scan(js, config, selection, headers_only=True))

    summary = _with_jetstream(config, work)
    if as_json:
        body = {"group": config.group, "namespace": config.namespace}
        click.echo(json.dumps({**body, "stream": config.dlq_stream, **summary.as_dict()}, indent=2))
        return
    which = selection.describe()
    if not summary.count:
        click.echo(f"{_where(config)}: no dead letters{which} (stream {config.dlq_stream})")
        return
    click.echo(
        f"{_where(config)}: {summary.count:,} dead letters{which} ({summary.bytes:,} bytes "
        f"of data) in stream {config.dlq_stream}"
    )
    for label, end in (("oldest", summary.oldest), ("newest", summary.newest)):
        click.echo(
            f"  {label}: #{end.seq} at {format_time(end.time)}, project {_project(end.project)}"
        )
    click.echo("  by reason:")
    for kind, n in ranked(summary.by_reason):
        click.echo(f"    {n:>9,}  {kind}")
    projects = ranked(summary.by_project)
    shown = f"the {top} with the most of {len(projects):,}" if len(projects) > top else "all"
    click.echo(f"  by project ({shown}):")
    for name, n in projects[:top]:
        click.echo(f"    {n:>9,}  {_project(name)}")


def _project(project: str | None) -> str:
    return "(no project id)" if project is None else repr(project)


@dlq.command("show")
@_dead_letters_command
@option(
    "--limit",
    type=click.IntRange(0),
    default=20,
    show_default=True,
    help="Show at most this many, oldest first (0: all).",
)
@option("--json", "as_json", is_flag=True, help="Print JSON (data as text, or base64).")
def dlq_show(
    config: GroupConfig,
    selection: Selection,
    limit: int,
    as_json: bool,
) -> None:
    """Show a group's dead letters, oldest first, with their headers and data.

    \b
    Example:
      shoal-consumer dlq show -g orders -n prod --project order-42 --limit 5
    """
    from shoal.group.deadletters import scan

    # One more than asked for: to say whether there are more.
    wanted = None if limit == 0 else limit + 1

    async def work(nc: Any, js: Any) -> Any:
        return await scan(js, config, selection, headers_only=False, limit=wanted)

    letters = _with_jetstream(config, work)
    more = limit != 0 and len(letters) > limit
    letters = letters[:limit] if limit else letters
    prefix = config.subject_prefix
    if as_json:
        body = {
            "group": config.group,
            "namespace": config.namespace,
            "stream": config.dlq_stream,
            "more": more,
            "messages": [letter.as_dict(prefix) for letter in letters],
        }
        click.echo(json.dumps(body, indent=2))
        return
    if not letters:
        click.echo(f"{_where(config)}: no dead letters{selection.describe()}")
        return
    for letter in letters:
        click.echo(
            f"#{letter.seq}  {format_time(letter.time)}  partition "
            f"{or_dash(letter.partition(prefix))}  project {_project(letter.project)}"
        )
        click.echo(f"  reason: {letter.reason or '-'}")
        for name, value in sorted(letter.headers.items()):
            if name != DEAD_LETTER_REASON_HEADER:  # the line above
                click.echo(f"  {name}: {value}")
        click.echo(f"  data ({letter.size:,} bytes): {_preview(letter.data)}")
    if more:
        click.echo(f"(the first {limit}; --limit for more)")


def _preview(data: bytes, width: int = 200) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return repr(data[:width]) + ("..." if len(data) > width else "")
    text = text if len(text) <= width else text[:width] + "..."
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _progress_writer() -> Any:
    """A progress line on standard error: rewritten in place on a terminal, else one line
    per update."""
    tty = sys.stderr.isatty()

    def write(line: str, final: bool) -> None:
        if tty:
            click.echo("\r" + line + "\x1b[K", err=True, nl=final)
        else:
            click.echo(line, err=True)

    return write


@dlq.command("redrive")
@_dead_letters_command
@option(
    "--limit",
    type=click.IntRange(1),
    default=None,
    help="Move at most this many, oldest first (default: all).",
)
@option(
    "--lanes",
    type=click.IntRange(1, 1024),
    default=64,
    show_default=True,
    help="Projects moved side by side (each project's one after another).",
)
@option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@option("--stop-after", type=click.IntRange(1), default=None, hidden=True)
def dlq_redrive(
    config: GroupConfig,
    selection: Selection,
    limit: int | None,
    lanes: int,
    as_json: bool,
    stop_after: int | None,
) -> None:
    """Move dead letters back to their partitions, to be processed again.

    Each is republished to the partition it came from with its original data and
    headers (its project id, its original message id, ...), plus Shoal-Redriven-From
    (its sequence in the dead-letter stream) and Nats-Msg-Id redrive-<stream>-<seq>,
    and deleted from the dead letters once JetStream acknowledged the republish. A
    project's dead letters go one after another in the order they were dead-lettered;
    each lands at the end of its partition, after what its project published since.
    Dead letters that arrive while it runs are left for the next run.

    Ctrl-C stops it after the messages in flight; run it again to move the rest: it
    moves only what is still there, and JetStream drops a second publish of one whose
    delete did not happen (within the partition stream's duplicate window, 120 s).
    Progress goes to standard error. Exit status 1 if some could not be moved (they
    stay, and their project's later dead letters with them), 130 if interrupted.

    \b
    Example:
      shoal-consumer dlq redrive -g orders -n prod --reason "permanent error"
    """
    import signal

    from shoal.group.deadletters import Progress, Redrive, dead_letter_stream

    write = _progress_writer()

    async def work(nc: Any, js: Any) -> Any:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def interrupted() -> None:
            stop.set()
            # A second Ctrl-C: Python's default (KeyboardInterrupt), at once.
            loop.remove_signal_handler(signal.SIGINT)
            click.echo(
                "\nStopping after the messages in flight (Ctrl-C again to stop at once); "
                "run it again to move the rest",
                err=True,
            )

        loop.add_signal_handler(signal.SIGINT, interrupted)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        until = int((await dead_letter_stream(js, config)).state.last_seq)
        redrive = Redrive(
            nc, js, config, selection, limit=limit, lanes=lanes, stop=stop, stop_after=stop_after
        )
        total = await redrive.count(until)
        progress = Progress("redrive: moved", total, write)
        redrive.progress = progress.update
        try:
            result = await redrive.run(until_seq=until)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if result.moved and result.seconds >= progress.every:
            progress.update(result.moved, final=True)
        return result

    result = _with_jetstream(config, work)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        which = selection.describe()
        click.echo(
            f"{_where(config)}: moved {result.moved:,} of {result.selected:,} dead letters"
            f"{which} back to their partitions in {result.seconds:.1f} s "
            f"({result.rate:,.0f}/s)"
        )
        if result.duplicates:
            click.echo(
                f"  {result.duplicates:,} of them had been republished by an earlier run "
                "that stopped before deleting them: JetStream dropped the second publish"
            )
    for seq, error in result.failed[:10]:
        click.echo(f"  dead letter #{seq}: {error}", err=True)
    if len(result.failed) > 10:
        click.echo(f"  ... and {len(result.failed) - 10} more", err=True)
    if result.held_back:
        click.echo(
            f"  {result.held_back:,} later dead letters of the same projects stay, for their "
            "order: run it again once the cause is fixed",
            err=True,
        )
    if result.stopped:
        click.echo("Interrupted: run it again to move the rest", err=True)
        sys.exit(130)
    if result.failed or result.held_back:
        sys.exit(1)


@dlq.command("purge")
@_dead_letters_command
@option(
    "--limit",
    type=click.IntRange(1),
    default=None,
    help="Delete at most this many, oldest first (default: all).",
)
@option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def dlq_purge(
    config: GroupConfig,
    selection: Selection,
    limit: int | None,
    yes: bool,
) -> None:
    """Delete dead letters for good (all of them, or those the options select).

    It counts them and asks first (--yes: it does not); dead letters that arrive after
    the count are kept.

    \b
    Example:
      shoal-consumer dlq purge -g orders -n prod --project order-42 --yes
    """
    from shoal.group.deadletters import dead_letter_stream, purge, scan

    async def count(nc: Any, js: Any) -> tuple[int, int]:
        info = await dead_letter_stream(js, config)
        until = int(info.state.last_seq)
        if selection.everything and limit is None:
            return int(info.state.messages), until
        return len(await scan(js, config, selection, limit=limit, until_seq=until)), until

    total, until = _with_jetstream(config, count)
    which = selection.describe()
    if not total:
        click.echo(f"{_where(config)}: no dead letters{which}: nothing to purge")
        return
    if not yes:
        click.confirm(
            f"Delete {total:,} dead letters{which} of {_where(config)} from stream "
            f"{config.dlq_stream}? They cannot be recovered",
            abort=True,
        )

    async def work(nc: Any, js: Any) -> int:
        return await purge(nc, js, config, selection, limit=limit, until_seq=until)

    purged = _with_jetstream(config, work)
    click.echo(f"{_where(config)}: purged {purged:,} dead letters{which}")
