"""`shoal-consumer reset`: move a group's position (replay, or skip). What it reads and
writes is shoal.group.reset; this is the command's options, confirmation and output."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from shoal.clients.etcd import TRANSIENT_ERRORS, EtcdAuthError, EtcdConfigError, EtcdUnavailable
from shoal.clients.natsauth import NatsConfigError
from shoal.consumer.cli_options import (
    command_config,
    etcd_option,
    group_option,
    jetstream_refused,
    namespace_option,
    nats_option,
    no_answer,
    option,
    stream_option,
    subject_prefix_option,
    whoami,
)
from shoal.group.config import GroupConfig
from shoal.group.pause import RESET_SOURCE

__all__ = ["reset"]

log = logging.getLogger(__name__)


def _time(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    from shoal.group.reset import parse_reset_time

    if value is None:
        return None
    try:
        return parse_reset_time(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def _step_writer() -> Callable[[str, int, int], None]:
    """The progress line on standard error: rewritten in place on a terminal; elsewhere
    one line when a stage starts and one when it is done (not one per partition)."""
    tty = sys.stderr.isatty()
    said: dict[str, int] = {}

    def step(stage: str, done: int, total: int) -> None:
        line = f"{stage}: {done:,} of {total:,}"
        if tty:
            click.echo("\r" + line + "\x1b[K", err=True, nl=done >= total)
        elif said.get(stage) != done and (stage not in said or done >= total):
            click.echo(line, err=True)
        said[stage] = done

    return step


@click.command()
@group_option
@namespace_option
@nats_option
@etcd_option
@subject_prefix_option
@stream_option
@option(
    "--to-time",
    callback=_time,
    default=None,
    help="Replay from the first message stored at or after this time: RFC 3339 "
    "(2026-11-21T10:00:00Z) or a duration back from now (90s, 15m, -1h, '2h ago').",
)
@option("--to-start", is_flag=True, help="Replay every message the stream holds.")
@option(
    "--to-end",
    is_flag=True,
    help="Skip what waits: deliver only what is published after the command reads the stream.",
)
@option(
    "--to-sequence",
    type=click.IntRange(1),
    default=None,
    help="Replay from this stream sequence (between the stream's first and last).",
)
@option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@option(
    "--wait",
    "wait_timeout",
    type=click.FloatRange(1),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the members to pause before giving up (nothing reset).",
)
@option("--json", "as_json", is_flag=True, help="Print the plan and outcome as JSON.")
def reset(
    group: str,
    namespace: str,
    nats_url: str,
    etcd_endpoints: str,
    subject_prefix: str | None,
    stream: str | None,
    to_time: datetime | None,
    to_start: bool,
    to_end: bool,
    to_sequence: int | None,
    yes: bool,
    wait_timeout: float,
    as_json: bool,
) -> None:
    """Move a group's position: every partition starts over at the stream's start, a
    time, a sequence, or its end. Needs a stream with `limits` retention (a `workqueue`
    or `interest` stream deletes what was acked: nothing to replay).

    It pauses the group (a group paused already stays paused afterwards), waits until
    every member reports its partitions paused (handlers finished and acked, nothing
    held, no pull open), recreates each partition's durable with its configuration and
    the new deliver policy, and resumes the group if it paused it. nats-server 2.12 has
    no consumer reset API (2.14 adds one) and cannot change a durable's deliver policy,
    hence the recreation. Each partition's messages come again in stream order, each
    project's one after another, as always. It says what it will do and asks first.

    For a group the operator runs, the operator's spec.paused is left alone: the reset
    writes the group's pause key itself, as `shoal-consumer pause` does, and removes it.

    \b
    Example:
      shoal-consumer reset -g orders -n prod --to-time 2026-11-21T10:00:00Z

    \b
    NATS TLS and credentials: NATS_CA_FILE, NATS_CERT_FILE, NATS_KEY_FILE,
    NATS_CREDS_FILE, NATS_USER/NATS_PASSWORD, NATS_NKEY_SEED_FILE, NATS_JS_API_PREFIX;
    etcd's: ETCD_CA_FILE, ETCD_CERT_FILE, ETCD_KEY_FILE, ETCD_USERNAME, ETCD_PASSWORD
    (see `run --help`).
    """
    from shoal.group.reset import Position

    chosen = [
        name
        for name, given in (
            ("--to-time", to_time is not None),
            ("--to-start", to_start),
            ("--to-end", to_end),
            ("--to-sequence", to_sequence is not None),
        )
        if given
    ]
    if len(chosen) != 1:
        raise click.UsageError(
            "give exactly one of --to-time, --to-start, --to-end, --to-sequence"
            + (f" (not {' and '.join(chosen)})" if chosen else "")
        )
    if to_time is not None:
        position = Position("time", time=to_time)
    elif to_sequence is not None:
        position = Position("sequence", seq=to_sequence)
    else:
        position = Position("start" if to_start else "end")
    config = command_config(
        group=group,
        namespace=namespace,
        nats_url=nats_url,
        etcd_endpoints=etcd_endpoints,
        subject_prefix=subject_prefix,
        stream=stream,
    )
    from nats.errors import NoRespondersError
    from nats.js.errors import APIError

    try:
        asyncio.run(_run(config, position, yes, wait_timeout, as_json))
    except (
        NatsConfigError,
        EtcdConfigError,
        EtcdAuthError,
        EtcdUnavailable,
        ConnectionError,
    ) as exc:
        raise click.ClickException(str(exc)) from None
    except TimeoutError:
        raise click.ClickException(no_answer(config.nats_url)) from None
    except TRANSIENT_ERRORS as exc:  # etcd went away before anything was paused
        raise click.ClickException(
            f"etcd at {config.etcd_endpoints} did not answer ({type(exc).__name__}); "
            "nothing was changed"
        ) from None
    except (NoRespondersError, APIError) as exc:
        raise click.ClickException(jetstream_refused(exc, config.nats_url)) from None


async def _run(
    config: GroupConfig, position: Any, yes: bool, wait_timeout: float, as_json: bool
) -> None:
    from shoal.clients.etcd import Etcd
    from shoal.clients.nats import connect
    from shoal.group.reset import ResetError, plan_reset, reset_group

    etcd = Etcd(config.etcd_endpoints, **config.etcd_options())
    nc = None
    try:
        await etcd.connect(attempts=3)
        nc = await connect(
            config.nats_url, name="shoal-reset", attempts=3, security=config.nats_security()
        )
        js = nc.jetstream(prefix=config.nats_js_api_prefix)
        try:
            plan = await plan_reset(js, etcd, config, position)
        except ResetError as exc:
            raise click.ClickException(str(exc)) from None
        if as_json:
            click.echo(json.dumps({"plan": plan.as_dict()}))
        else:
            _describe(plan)
        if not yes:
            # (click.confirm blocks the loop: nothing else runs meanwhile.)
            click.confirm("Reset the group's position?", abort=True, err=as_json)
        try:
            result = await reset_group(
                js,
                etcd,
                plan,
                by=whoami(),
                wait_timeout=wait_timeout,
                step=None if as_json else _step_writer(),
            )
        except ResetError as exc:
            raise click.ClickException(str(exc)) from None
    finally:
        if nc is not None:
            await nc.close()
        etcd.close()
    where = f"group {config.namespace}/{config.group}"
    if as_json:
        click.echo(json.dumps({"result": result.as_dict()}))
        return
    click.echo(
        f"Reset {where}: {result.partitions} durables at {position.describe()}, "
        f"{result.pending:,} messages to deliver; {result.seconds:.1f} s (pause "
        f"{result.pause_seconds:.1f} s, recreate {result.recreate_seconds:.1f} s)"
    )
    if result.resumed:
        click.echo("Resumed: the members pull again")
    elif result.paused_by_us:
        click.echo(
            "The group was paused meanwhile and stays paused: "
            f"`shoal-consumer resume -g {config.group} -n {config.namespace}` resumes it"
        )
    else:
        click.echo(
            "The group was paused before the reset and stays paused: "
            f"`shoal-consumer resume -g {config.group} -n {config.namespace}` resumes it"
        )


def _describe(plan: Any) -> None:
    config = plan.config
    where = f"{config.namespace}/{config.group}"
    click.echo(f"Reset group {where}")
    click.echo(
        f"  stream {config.stream} ({plan.retention} retention): {plan.messages:,} messages, "
        f"sequences {plan.first_seq:,}..{plan.last_seq:,}"
    )
    click.echo(f"  partitions: {len(plan.durables)} durables, recreated at the new position")
    click.echo(f"  to: {plan.position.describe()}")
    click.echo(
        f"  delivered from there: {plan.from_position:,} messages (not yet consumed now: "
        f"{plan.outstanding:,}; "
        + (
            f"about {plan.redelivered:,} consumed ones come again)"
            if plan.redelivered >= 0
            else f"about {-plan.redelivered:,} waiting ones are skipped)"
        )
    )
    if plan.missing:
        names = ", ".join(f"p{p}" for p in plan.missing[:10])
        more = f" and {len(plan.missing) - 10} more" if len(plan.missing) > 10 else ""
        click.echo(f"  missing durables, created at the new position: {names}{more}")
    if plan.paused is not None and plan.paused.source == RESET_SOURCE:
        click.echo(
            f"  the group is paused by a reset that did not finish ({plan.paused.describe()}):"
            " this one resumes it afterwards"
        )
    elif plan.paused is not None:
        click.echo(f"  the group is paused ({plan.paused.describe()}) and stays paused")
    else:
        click.echo("  the group is paused meanwhile and resumed afterwards")
