"""`shoal-consumer`: run a member, produce test traffic, plan an assignment, show status,
pause and resume a group (reset: reset_cli.py; dlq: dlq_cli.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn

import click
from pydantic import ValidationError

from shoal.assignor import assign, min_moves, moved, owner_counts, skew
from shoal.clients.etcd import Etcd, EtcdAuthError, EtcdConfigError
from shoal.clients.natsauth import NatsClosed, NatsConfigError, redacted
from shoal.consumer import eventloop
from shoal.consumer import ready as readiness
from shoal.consumer.cli_options import (
    command_config,
    etcd_option,
    group_option,
    namespace_option,
    nats_option,
    option,
    or_dash,
    partitions_option,
    stream_option,
    subject_prefix_option,
    validation_message,
    whoami,
)
from shoal.consumer.dlq_cli import dlq
from shoal.consumer.handlers import HandlerError
from shoal.consumer.healthport import HealthPortInUse
from shoal.consumer.reset_cli import reset
from shoal.contracts.names import (
    SEQ_HEADER,
    Keys,
    default_stream_name,
    default_subject_prefix,
)
from shoal.group.config import (
    etcd_options_from_env,
    nats_security_from_env,
)
from shoal.logs import log_level_option, setup_logging

log = logging.getLogger(__name__)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@log_level_option
def main(log_level: str) -> None:
    """Shoal consumer: elastic consumer groups for NATS JetStream.

    Every member of a group runs `shoal-consumer run`. Members register in etcd, one of
    them leads and assigns the group's partitions, and each consumes only what it owns.
    """
    setup_logging(log_level)


main.add_command(dlq)
main.add_command(reset)


@main.command()
@group_option
@namespace_option
@nats_option
@etcd_option
@partitions_option
@option(
    "--handler",
    envvar="SHOAL_HANDLER",
    default="shoal.consumer.handlers:noop",
    show_default=True,
    help="Message handler: 'module:function' (async def f(msg)), or an http(s):// URL "
    "each message is POSTed to (see the README's HTTP handlers).",
)
@option(
    "--handler-ready-path",
    envvar="SHOAL_HANDLER_READY_PATH",
    default=None,
    help="With an HTTP handler: join the group only once GET <its host><path> answers 2xx.",
)
@option(
    "--handler-socket",
    envvar="SHOAL_HANDLER_SOCKET",
    default=None,
    help="With an http:// handler: send its requests to this Unix socket instead of the "
    "URL's host and port (a sidecar sharing a directory with the member).",
)
@option(
    "--member-id",
    envvar="SHOAL_MEMBER_ID",
    default=None,
    help="Member id [env SHOAL_MEMBER_ID, else POD_NAME, else host-pid].",
)
@option(
    "--metrics-port",
    envvar="SHOAL_METRICS_PORT",
    type=int,
    default=None,
    help="Serve Prometheus /metrics on this port (0: any free port).",
)
@option(
    "--health-port",
    envvar="SHOAL_HEALTH_PORT",
    type=click.IntRange(0, 65535),
    default=None,
    help="Answer the probes over HTTP on this port too: GET /readyz and /livez say what "
    "`shoal-ready` and `shoal-ready --live` say (200 or 503, and the line); needs "
    "SHOAL_READY_FILE (0: any free port) [env SHOAL_HEALTH_PORT].",
)
@option(
    "--lease-ttl",
    envvar="SHOAL_LEASE_TTL",
    type=int,
    default=None,
    help="Member lease TTL in seconds (default 10).",
)
@option(
    "--event-loop",
    envvar="SHOAL_EVENT_LOOP",
    type=click.Choice(eventloop.CHOICES),
    default=eventloop.DEFAULT,
    show_default=True,
    help="The event loop: uvloop (faster), or asyncio's own (for debugging) "
    "[env SHOAL_EVENT_LOOP].",
)
def run(
    group: str,
    namespace: str,
    nats_url: str,
    etcd_endpoints: str,
    partitions: int,
    handler: str,
    handler_ready_path: str | None,
    handler_socket: str | None,
    member_id: str | None,
    metrics_port: int | None,
    health_port: int | None,
    lease_ttl: int | None,
    event_loop: str,
) -> None:
    """Run one member of a consumer group until SIGTERM (then leave gracefully).

    \b
    etcd TLS and authentication come from the environment only:
      ETCD_CA_FILE    CA certificate of the etcd servers (PEM): enables TLS
      ETCD_CERT_FILE  client certificate (PEM), with ETCD_KEY_FILE
      ETCD_KEY_FILE   client private key (PEM)
      ETCD_USERNAME   etcd user, with ETCD_PASSWORD
      ETCD_PASSWORD   its password
    NATS TLS and authentication, from the environment too (a tls:// URL alone: TLS
    with the system's CAs):
      NATS_CA_FILE       CA certificate of the NATS servers (PEM): enables TLS
      NATS_CERT_FILE     client certificate (PEM), with NATS_KEY_FILE
      NATS_KEY_FILE      client private key (PEM)
      NATS_CREDS_FILE    credentials file (JWT and nkey seed); or
      NATS_USER          user, with NATS_PASSWORD; or
      NATS_NKEY_SEED_FILE  nkey seed file
      NATS_INBOX_PREFIX  reply subjects' prefix (see `permissions --help`)
      NATS_JS_API_PREFIX  JetStream API prefix, for streams in another account
                          (default $JS.API; see `permissions --accounts`)
    Other settings: SHOAL_* (see the README).
    """
    from shoal.consumer.runtime import run_consumer
    from shoal.group.jetstream import PartitionCountMismatch

    config = command_config(
        group=group,
        namespace=namespace,
        nats_url=nats_url,
        etcd_endpoints=etcd_endpoints,
        partitions=partitions,
        handler=handler,
        handler_ready_path=handler_ready_path,
        handler_socket=handler_socket,
        member_id=member_id,
        metrics_port=metrics_port,
        health_port=health_port,
        lease_ttl=lease_ttl,
    )
    try:
        eventloop.run(run_consumer(config), event_loop)
    except (
        HandlerError,
        EtcdConfigError,
        EtcdAuthError,
        NatsConfigError,
        HealthPortInUse,
        PartitionCountMismatch,
    ) as exc:
        raise click.ClickException(str(exc)) from None
    except NatsClosed:
        # (Logged already, with the reason.) A restart connects again, with backoff.
        raise SystemExit(1) from None


@main.command()
@option(
    "--file",
    "ready_file",
    envvar="SHOAL_READY_FILE",
    required=True,
    help="The member's state file [env SHOAL_READY_FILE].",
)
@option(
    "--live",
    is_flag=True,
    help="Liveness instead: fail only if the member's event loop stopped refreshing its "
    "state (never because etcd or NATS are down).",
)
def ready(ready_file: str, live: bool) -> None:
    """Exit 0 if this pod's member is ready: joined, not fenced, reaching NATS (pods
    probe with `shoal-ready` and `shoal-ready --live`, the same checks without this
    CLI's imports)."""
    ok, message = readiness.check_live(ready_file) if live else readiness.check(ready_file)
    if not ok:
        raise click.ClickException(message)
    click.echo(message)


@main.command()
@group_option
@namespace_option
@nats_option
@partitions_option
@option(
    "--projects",
    "-k",
    type=click.IntRange(1),
    default=1000,
    show_default=True,
    help="Number of distinct project ids (project-0 .. project-K-1) of test traffic.",
)
@option(
    "--messages",
    "-m",
    type=click.IntRange(0),
    default=10000,
    show_default=True,
    help="Total messages of test traffic, spread round-robin over the projects.",
)
@option(
    "--rate",
    type=float,
    default=0.0,
    help="Messages per second (0: as fast as JetStream acknowledges).",
)
@subject_prefix_option
@stream_option
@option(
    "--run-id",
    default=None,
    help="Prefix of message ids (default: the time in milliseconds and a random suffix, "
    "as in 1764316800000_3f9a1c).",
)
@option(
    "--stdin",
    "from_stdin",
    is_flag=True,
    help="Publish the lines of standard input, `project_id<TAB>data` each, instead of "
    "test traffic (see above).",
)
@option(
    "--window",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Publishes awaiting JetStream's acknowledgement at most.",
)
@click.pass_context
def produce(
    ctx: click.Context,
    group: str,
    namespace: str,
    nats_url: str,
    partitions: int,
    projects: int,
    messages: int,
    rate: float,
    subject_prefix: str | None,
    stream: str | None,
    run_id: str | None,
    from_stdin: bool,
    window: int,
) -> None:
    """Publish test traffic (M messages over K project ids), or with --stdin the
    lines of standard input.

    Test traffic: message i goes to project-(i mod K), each with a per-project seq.

    With --stdin, one message a line, `project_id<TAB>data`: the data is the rest of the
    line after the first TAB (TABs included), sent as its bytes (UTF-8 text stays UTF-8),
    without the line end (LF or CRLF); empty lines are skipped. Each message goes to its
    project's partition, subject <prefix>.<partition>, with the headers of test traffic:

    \b
      Shoal-Project-Id  the project id
      Nats-Msg-Id       RUN-PROJECT-N (RUN: --run-id; the same input published again
                        with the same --run-id is dropped by JetStream as duplicates
                        while its duplicate window lasts)
      Shoal-Seq         N, the project's count of lines before this one

    At most --window publishes await JetStream's acknowledgement; a project's messages
    enter the stream in the order of their lines (a publish retried after a failed
    acknowledgement keeps its message id but may land after later ones). A line without
    a TAB, whose project id is empty, not UTF-8, or starts or ends with whitespace
    (NATS headers would drop it), or too large for NATS (headers and data over the
    server's max_payload), ends the run with an error naming the line, once every line
    before it is acknowledged. The counts (published: stored; duplicates: dropped by
    JetStream, their message ids already stored), the seconds and the run id go to
    standard error as JSON. A run whose publishing fails, or that is interrupted
    (Ctrl-C, SIGTERM: "interrupted": true, exit status 130), names its run id, so that
    the same input published again with it adds only what is missing.

    The partition count is the group's, as its stream records it (the operator and
    members write it there); --partitions only for a stream that does not (an older
    Shoal), and one that differs from the stream's is refused: its messages would land
    on partitions nobody consumes, or the wrong ones.

    \b
    Example:
      printf 'order-42\\t{"total": 12}\\n' | shoal-consumer produce -g orders --stdin
    """
    from shoal.clients.nats import connect
    from shoal.consumer.producer import (
        LineError,
        MessageTooLarge,
        Outgoing,
        Producer,
        default_run_id,
        parse_line,
        read_lines,
    )

    prefix = subject_prefix or default_subject_prefix(namespace, group)
    run_tag = run_id or default_run_id()
    if from_stdin:
        for name in ("projects", "messages"):
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"--{name} makes no sense with --stdin")
    failure: list[LineError] = []
    interrupted: list[bool] = []

    async def stdin_items(producer: Producer, max_line: int) -> Any:
        """The messages of standard input; at a bad line, remember it and end."""
        seqs: dict[str, int] = {}
        started = time.monotonic()
        sent = 0
        try:
            async for number, line in read_lines(sys.stdin.buffer, max_line=max_line):
                parsed = parse_line(line, number)
                if parsed is None:
                    continue
                project, data = parsed
                seq = seqs[project] = seqs.get(project, -1) + 1
                if rate > 0:
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                sent += 1
                item = Outgoing(project, data, f"{run_tag}-{project}-{seq}", {SEQ_HEADER: str(seq)})
                try:
                    producer.prepare(item)  # too large: this line's error, not a retry's
                except MessageTooLarge as exc:
                    raise LineError(number, str(exc)) from None
                yield item
        except LineError as exc:
            failure.append(exc)

    def summary(producer: Producer | None, started: float, **more: Any) -> str:
        acknowledged = producer.acknowledged if producer else 0
        duplicates = producer.duplicates if producer else 0
        elapsed = time.monotonic() - started
        return json.dumps(
            {
                "published": acknowledged - duplicates,
                "duplicates": duplicates,
                "seconds": round(elapsed, 3),
                "per_second": round(acknowledged / elapsed, 1) if elapsed else None,
                "run_id": run_tag,
                **more,
            }
        )

    stream_name = stream or default_stream_name(namespace, group)
    partitions_given = (
        ctx.get_parameter_source("partitions") is not click.core.ParameterSource.DEFAULT
    )

    async def stream_by_subject(js: Any) -> Any:
        """The stream that stores the group's subjects, under a name of its own
        (spec.nats.stream.name); a UsageError when none does: every publish would fail
        (no stream answers), so say so at once, not after retrying each line."""
        from nats.js.errors import NotFoundError

        try:
            name = await js.find_stream_name_by_subject(f"{prefix}.0")
        except NotFoundError:
            raise click.UsageError(
                f"unknown group {namespace}/{group}: no stream {stream_name}, and none "
                f"stores {prefix}.* (a misspelt --group or --namespace? a stream of "
                "another name: --stream)"
            ) from None
        return await js.stream_info(name)

    async def group_partitions(js: Any, given: int) -> int:
        """The group's partition count from its stream; `given` where it says none."""
        from nats.js.errors import NotFoundError

        from shoal.group.jetstream import stream_partitions

        try:
            async with asyncio.timeout(3):
                try:
                    info = await js.stream_info(stream_name)
                except NotFoundError:
                    info = await stream_by_subject(js)
        except click.UsageError:
            raise
        except Exception as exc:  # no permission (no answer), an outage
            click.echo(
                f"warning: could not read stream {stream_name} ({exc!r}) for the group's "
                f"partition count: publishing for --partitions {given}",
                err=True,
            )
            return given
        recorded = stream_partitions(info)
        if recorded is None:
            return given
        if partitions_given and recorded != given:
            raise click.UsageError(
                f"stream {stream_name} records {recorded} partitions for the group, not "
                f"--partitions {given}: messages would go to partitions nobody consumes, "
                "or the wrong ones (leave --partitions out)"
            )
        return recorded

    async def go() -> None:
        # Ctrl-C (asyncio.run's handler) and SIGTERM cancel this task: say what is stored.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        nc: Any = None
        producer: Producer | None = None
        started = time.monotonic()
        try:
            nc = await connect(
                nats_url,
                name="shoal-produce",
                attempts=5,
                security=nats_security_from_env(os.environ),
            )
            js = nc.jetstream()
            try:
                count = await group_partitions(js, partitions)
            except click.UsageError:
                await nc.close()
                raise
            producer = Producer(js, prefix, count)
            started = time.monotonic()
            await publish(nc, producer, started)
        except asyncio.CancelledError:
            interrupted.append(True)
            click.echo(summary(producer, started, interrupted=True), err=True)
            click.echo(
                f"Interrupted: publish the same input again with --run-id {run_tag} to add "
                "what is missing (JetStream drops the message ids it has, within its "
                "duplicate window)",
                err=True,
            )
            if nc is not None:
                await nc.close()

    async def publish(nc: Any, producer: Producer, started: float) -> None:
        async def items() -> Any:
            for i in range(messages):
                project, seq = f"project-{i % projects}", i // projects
                if rate > 0:
                    ahead = i / rate - (time.monotonic() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                yield Outgoing(
                    project,
                    f"{project}:{seq}".encode(),
                    f"{run_tag}-{project}-{seq}",
                    {SEQ_HEADER: str(seq)},
                )

        try:
            await producer.publish_many(
                stdin_items(producer, nc.max_payload) if from_stdin else items(), window=window
            )
        except Exception as exc:
            await nc.close()
            raise click.ClickException(_publish_failed(exc, prefix, run_tag)) from None
        result = summary(producer, started)
        await nc.drain()
        if producer.duplicates:
            click.echo(
                f"Warning: JetStream dropped {producer.duplicates} messages as duplicates: "
                f"it had their message ids (run id {run_tag}) already",
                err=True,
            )
        try:
            click.echo(result, err=from_stdin)
        except BrokenPipeError:  # everything is published; the reader of stdout left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            click.echo(result, err=True)
        if failure:
            raise click.ClickException(f"stdin {failure[0]}; the lines before it are published")

    try:
        asyncio.run(go())
    except (NatsConfigError, ConnectionError) as exc:  # one line, no traceback
        raise click.ClickException(str(exc)) from None
    except click.ClickException as exc:
        if _stdin_reader_blocked():
            exc.show()
            _exit_now(exc.exit_code)
        raise
    if interrupted:
        if _stdin_reader_blocked():
            _exit_now(130)
        ctx.exit(130)


def _stdin_reader_blocked() -> bool:
    """Whether read_lines' thread still waits in a read of an input left open."""
    return any(t.name == "stdin-reader" and t.is_alive() for t in threading.enumerate())


def _exit_now(code: int) -> NoReturn:
    """Exit without finalizing the interpreter. A thread blocked reading stdin holds the
    buffer's lock, and the finalization that wants it aborts the process ('Fatal Python
    error: _enter_buffered_busy', SIGABRT, exit status 134 instead of the summary's 130).
    What we printed is flushed first; nothing else is left to clean up (the connection
    is closed)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _publish_failed(exc: Exception, prefix: str, run_tag: str) -> str:
    """What a user reads when publishing failed for good (after the retries)."""
    from nats.js.errors import NoStreamResponseError

    if isinstance(exc, NoStreamResponseError):
        why = (
            f"no stream takes subjects {prefix}.* (are --group and --namespace right? "
            "--subject-prefix, if it has another one?)"
        )
    else:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return (
        f"publishing failed: {why}. Some messages may be stored: publish the same input "
        f"again with --run-id {run_tag} and JetStream drops those it has (within its "
        "duplicate window, 2 minutes by default)"
    )


@main.command()
@partitions_option
@option(
    "--members",
    "before",
    required=True,
    help="Members before the change, comma-separated (e.g. c-0,c-1,c-2).",
)
@option("--to", "after", required=True, help="Members after the change, comma-separated.")
@option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plan(partitions: int, before: str, after: str, as_json: bool) -> None:
    """Show the assignment and the moves for a membership change, sticky beside modulo."""
    old = [m for m in before.split(",") if m]
    new = [m for m in after.split(",") if m]
    if not old or not new:
        raise click.UsageError("--members and --to each need at least one member")
    result: dict[str, Any] = {}
    for strategy in ("sticky", "modulo"):
        first = assign(partitions, old, strategy=strategy)
        second = assign(partitions, new, first, strategy=strategy)
        moves = moved(first, second)
        result[strategy] = {
            "moves": len(moves),
            "min_moves": min_moves(partitions, new, first),
            "skew": skew(second, new),
            "counts": owner_counts(second, new),
            "moved": [{"partition": p, "from": a, "to": b} for p, a, b in moves],
        }
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"{partitions} partitions: {len(old)} members -> {len(new)} members")
    click.echo(f"{'strategy':<10}{'moves':>8}{'minimum':>9}{'skew':>6}")
    for strategy, r in result.items():
        click.echo(f"{strategy:<10}{r['moves']:>8}{r['min_moves']:>9}{r['skew']:>6}")
    click.echo(
        "sticky owner counts: "
        + ", ".join(f"{m}={n}" for m, n in sorted(result["sticky"]["counts"].items()))
    )


@main.command()
@group_option
@namespace_option
@subject_prefix_option
@stream_option
@option(
    "--inbox-prefix",
    default=None,
    help="The members' reply prefix, NATS_INBOX_PREFIX (default _SHOAL_INBOX.<namespace>.<group>).",
)
@option("--ledger", is_flag=True, help="The group writes the test ledger.")
@option(
    "--managed/--standalone",
    default=True,
    show_default=True,
    help="Managed: the operator creates the streams and durables; standalone: the "
    "members do (SHOAL_ENSURE_JETSTREAM).",
)
@option(
    "--accounts",
    "as_accounts",
    is_flag=True,
    help="Streams in one account, members in another: print an `accounts` block with the "
    "JetStream account's exports and the members' account's imports.",
)
@option("--js-account", default="SHOAL", show_default=True)
@option("--member-account", default="TEAM", show_default=True)
@option(
    "--api-prefix",
    default=None,
    help="With --accounts: the JetStream API's prefix in the members' account, their "
    "NATS_JS_API_PREFIX (default JS.<js-account>.API).",
)
@option("--member-user", default="shoal-member", show_default=True)
@option("--operator-user", default="shoal-operator", show_default=True)
@option("--producer-user", default="shoal-producer", show_default=True)
@option("--analytics-user", default="shoal-analytics", show_default=True)
@option(
    "--admin-user",
    default="shoal-admin",
    show_default=True,
    help="The user of the `dlq` and `reset` commands.",
)
def permissions(
    group: str,
    namespace: str,
    subject_prefix: str | None,
    stream: str | None,
    inbox_prefix: str | None,
    ledger: bool,
    managed: bool,
    as_accounts: bool,
    js_account: str,
    member_account: str,
    api_prefix: str | None,
    member_user: str,
    operator_user: str,
    producer_user: str,
    analytics_user: str,
    admin_user: str,
) -> None:
    """Print the least NATS permissions of a group's members, the operator, a producer,
    the assignment-log export and an admin (`dlq` and `reset`), as an `authorization {
    users = [...] }` block to paste into a NATS server's config (passwords are read from
    the server's environment: $SHOAL_MEMBER_PASSWORD, $SHOAL_OPERATOR_PASSWORD,
    $SHOAL_PRODUCER_PASSWORD, $SHOAL_ANALYTICS_PASSWORD, $SHOAL_ADMIN_PASSWORD).

    Members and producers must then connect with NATS_INBOX_PREFIX set as shown: with
    nats-py's shared _INBOX, any user allowed to subscribe to its replies could read
    every other client's, other groups' pulled messages included.

    With --accounts: the operator, producers and the export are users of the JetStream
    account (--js-account), the members of their own (--member-account), which imports
    only what they need; members then connect with NATS_JS_API_PREFIX as shown.
    """
    from shoal.consumer import accounts
    from shoal.consumer import permissions as perms
    from shoal.group.config import GroupConfig

    try:
        config = GroupConfig.model_validate(
            {
                "group": group,
                "namespace": namespace,
                "ledger": ledger,
                "ensure_jetstream": not managed,
                **({"subject_prefix": subject_prefix} if subject_prefix else {}),
                **({"stream": stream} if stream else {}),
            }
        )
    except ValidationError as exc:
        raise click.UsageError(validation_message(exc)) from None
    inbox = inbox_prefix or perms.default_inbox_prefix(config)
    click.echo(
        f"# Shoal group {namespace}/{group}: stream {config.stream}, subjects "
        f"{config.subject_prefix}.*"
    )
    producer_inbox = perms.default_producer_inbox_prefix(config)
    click.echo(f"# Members: NATS_USER={member_user} NATS_INBOX_PREFIX={inbox}")
    click.echo(f"# Producers: NATS_USER={producer_user} NATS_INBOX_PREFIX={producer_inbox}")
    export_inbox = perms.default_exporter_inbox_prefix(config)
    click.echo(f"# The export: NATS_USER={analytics_user} NATS_INBOX_PREFIX={export_inbox}")
    admin_inbox = perms.default_admin_inbox_prefix(config)
    click.echo(f"# dlq and reset: NATS_USER={admin_user} NATS_INBOX_PREFIX={admin_inbox}")
    click.echo(f"# The operator: NATS_USER={operator_user} (nats-py's _INBOX)")
    js_users: list[perms.User] = [
        (operator_user, "$SHOAL_OPERATOR_PASSWORD", perms.operator_permissions(config)),
        (
            producer_user,
            "$SHOAL_PRODUCER_PASSWORD",
            perms.producer_permissions(config, producer_inbox),
        ),
        (
            analytics_user,
            "$SHOAL_ANALYTICS_PASSWORD",
            perms.exporter_permissions(config, export_inbox),
        ),
        (admin_user, "$SHOAL_ADMIN_PASSWORD", perms.admin_permissions(config, admin_inbox)),
    ]
    if not as_accounts:
        member = (member_user, "$SHOAL_MEMBER_PASSWORD", perms.member_permissions(config, inbox))
        click.echo(perms.authorization_block([member, *js_users]), nl=False)
        return
    api = api_prefix or accounts.default_api_prefix(js_account)
    click.echo(
        f"# Members are users of account {member_account}: NATS_JS_API_PREFIX={api}; "
        f"the others of {js_account}"
    )
    member = (member_user, "$SHOAL_MEMBER_PASSWORD", perms.member_permissions(config, inbox, api))
    block = accounts.accounts_block(
        accounts.group_exports(config, api), js_users, [member], js_account, member_account
    )
    click.echo(block, nl=False)


@main.command()
@group_option
@namespace_option
@etcd_option
@nats_option
@stream_option
@partitions_option
@option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def status(
    ctx: click.Context,
    group: str,
    namespace: str,
    etcd_endpoints: str,
    nats_url: str,
    stream: str | None,
    partitions: int,
    as_json: bool,
) -> None:
    """Show a group's members, leader, owners per member and skew, read from etcd, and
    the members NATS refuses (wrong credentials, TLS), with the reason.

    The partition count is the group's, as its stream records it (read through --nats;
    the operator and members write it there); --partitions, if given, must agree with
    it. For a stream that records none (an older Shoal), or NATS out of reach: as many
    as --partitions says, else as the group's assignment names.

    etcd TLS and authentication: ETCD_CA_FILE, ETCD_CERT_FILE, ETCD_KEY_FILE, ETCD_USERNAME,
    ETCD_PASSWORD (see `run --help`); NATS's likewise (NATS_*).
    """
    from shoal.group.status import read_status

    # Unless given, as many partitions as the group's targets name (not the option's
    # default: a 16-partition group showed 112 partitions unowned).
    source = ctx.get_parameter_source
    given = source("partitions") is not click.core.ParameterSource.DEFAULT
    counted = partitions if given else None
    config = command_config(group=group, namespace=namespace, nats_url=nats_url, stream=stream)
    recorded = _recorded_partitions(
        config, quiet=source("nats_url") is click.core.ParameterSource.DEFAULT
    )
    if recorded is not None:
        if given and recorded != partitions:
            # `-p 64` on a 128-partition group showed a healthy group of 64.
            flag = (
                f"SHOAL_PARTITIONS={partitions}"
                if source("partitions") is click.core.ParameterSource.ENVIRONMENT
                else f"--partitions {partitions}"
            )
            raise click.UsageError(
                f"stream {config.stream} records {recorded} partitions for the group, not "
                f"{flag}: the status would count partitions that are not the group's "
                "(leave it out: the stream's count is used)"
            )
        counted = recorded

    async def go() -> Any:
        etcd = Etcd(etcd_endpoints, **etcd_options_from_env(os.environ))
        try:
            await etcd.connect(attempts=3)
            return await read_status(etcd, namespace, group, counted)
        finally:
            etcd.close()

    try:
        st = asyncio.run(go())
    except Exception as exc:
        raise click.ClickException(str(exc)) from None
    # From what was read (no second listing): a member NATS refuses has only its
    # problems/ key, a new group no leader yet.
    if not (st.members or st.owners or st.claims or st.leader or st.problems or st.paused):
        # A misspelt name reads as an empty group: say so (on stderr: a group not started
        # yet, or whose members all left, is the same, and scripts poll it).
        click.echo(
            f"note: etcd at {etcd_endpoints} has not one key under "
            f"{Keys(namespace, group).prefix}: no member has run yet, or the group's name "
            "is not right (--group, --namespace)",
            err=True,
        )
    if as_json:
        click.echo(json.dumps(st.as_dict(), indent=2))
        return
    click.echo(
        f"group {namespace}/{group}: {len(st.members)} members, leader "
        f"{st.leader or '-'} (epoch {st.epoch or '-'}), generation {st.generation}, "
        f"skew {st.skew}"
    )
    for member in sorted(st.members):
        stats = st.members[member]
        owned = st.counts.get(member, 0)
        click.echo(
            f"  {member:<30} owns {owned:>4}  rate {or_dash(stats.rate):>8}  "
            f"lag {or_dash(stats.lag):>6}  cpu {or_dash(stats.cpu)}"
        )
    if st.paused is not None:
        click.echo(f"  paused {st.paused.describe()}")
    if not st.owners:
        # (Not "unowned partitions: 128": without targets, the count is not known here.)
        click.echo("  no assignment yet: no leader has given out the partitions")
    elif st.unowned:
        click.echo(f"  unowned partitions: {len(st.unowned)}")
    if st.owners and st.unclaimed:
        # Owned, not consumed: the owner has not claimed it yet, is fenced, or is gone.
        click.echo(f"  unclaimed partitions: {len(st.unclaimed)}")
    moving = st.moving()
    if moving:
        shown = ", ".join(f"{p} ({claim}, target {owner})" for p, (claim, owner) in moving.items())
        click.echo(f"  claimed by another member than their target owner: {shown}")
    if st.stalled:
        # (progress.py: work and no progress; the leader moves them.)
        stalled = ", ".join(f"{p} on {m}" for p, m in sorted(st.stalled.items()))
        click.echo(f"  stalled partitions: {stalled}")
    for member, problem in sorted(st.problems.items()):
        # A refused member never joins: this line is all the group knows of it.
        if problem.waits_for_handler:
            click.echo(
                f"  {member:<30} waits for its handler since {problem.describe_since()}: "
                f"{problem.message}"
            )
            continue
        click.echo(
            f"  {member:<30} cannot connect to NATS since {problem.describe_since()}: "
            f"{problem.reason}: {problem.message}"
        )


def _recorded_partitions(config: Any, *, quiet: bool) -> int | None:
    """The partition count the group's stream records, for `status`; None when the
    stream records none (an older Shoal) or cannot be read (said on standard error
    unless `quiet`: NATS at the default URL, perhaps never meant to be asked)."""
    from shoal.clients.nats import connect
    from shoal.group.jetstream import recorded_partitions

    async def read() -> int | None:
        nc = None
        try:
            async with asyncio.timeout(5):
                nc = await connect(
                    config.nats_url,
                    name="shoal-status",
                    attempts=1,
                    security=config.nats_security(),
                )
                js = nc.jetstream(prefix=config.nats_js_api_prefix)
                return await recorded_partitions(js, config.stream)
        finally:
            if nc is not None:
                await nc.close()

    try:
        return asyncio.run(read())
    except Exception as exc:  # unreachable, refused, no permission (no answer)
        if not quiet:
            click.echo(
                f"note: could not read stream {config.stream} at {redacted(config.nats_url)} "
                f"for the group's partition count ({type(exc).__name__}: {exc}); counting "
                "them from --partitions, else the group's assignment",
                err=True,
            )
        return None


def _pauser() -> str:
    """Who runs `shoal-consumer pause` (user@host), for the pause record."""
    return whoami()


async def _with_etcd(etcd_endpoints: str, work: Any) -> Any:
    etcd = Etcd(etcd_endpoints, **etcd_options_from_env(os.environ))
    try:
        await etcd.connect(attempts=3)
        return await work(etcd)
    finally:
        etcd.close()


@main.command()
@group_option
@namespace_option
@etcd_option
@option("--reason", default="", help="Why, for the record (shown by members and status).")
@option(
    "--force",
    is_flag=True,
    help="Pause a group etcd holds nothing of yet (not started): its members will join "
    "paused. Without it such a group is refused, as a misspelt name would be.",
)
def pause(group: str, namespace: str, etcd_endpoints: str, reason: str, force: bool) -> None:
    """Pause a group: every member finishes the handlers it is running, acks them,
    gives back what it fetched and did not start, and pulls nothing more. Members keep
    their partitions (nothing moves); members that join or restart join paused; the
    autoscaler does nothing. `resume` undoes it.

    Writes the group's `paused` key in etcd, as the operator does from spec.paused. On a
    group the operator runs, this pause is the command's own: the operator leaves it
    whatever spec.paused says (spec.paused: false lifts only the pause spec.paused made),
    and `resume` lifts it. etcd TLS and authentication: as for `status`.
    """
    from shoal.contracts.values import PauseRecord
    from shoal.group.pause import CLI_SOURCE, RESET_SOURCE, group_has_keys, pause_group

    keys = Keys(namespace, group)
    record = PauseRecord(by=_pauser(), time=time.time(), source=CLI_SOURCE, reason=reason)

    async def work(etcd: Etcd) -> PauseRecord | bool | None:
        if not force and not await group_has_keys(etcd, keys):
            return False
        return await pause_group(etcd, keys, record)

    try:
        before = asyncio.run(_with_etcd(etcd_endpoints, work))
    except Exception as exc:
        raise click.ClickException(f"could not pause {namespace}/{group}: {exc}") from None
    if before is False:
        raise click.ClickException(
            f"etcd at {etcd_endpoints} has not one key under {keys.prefix}: the group's "
            "name is not right (--group, --namespace), or no member has run yet; nothing "
            "written (--force pauses it anyway: members that start later join paused)"
        )
    assert before is None or isinstance(before, PauseRecord)
    if before is not None and before.source == RESET_SOURCE:
        click.echo(
            f"Group {namespace}/{group} is paused by a reset ({before.describe()}), which "
            "resumes it when it is done: nothing written. To keep it paused after the "
            "reset, pause it again once the reset has finished"
        )
        return
    if before is not None:
        click.echo(
            f"Group {namespace}/{group} is paused already ({before.describe()}); left as it is"
        )
        return
    click.echo(
        f"Paused group {namespace}/{group} {record.describe()} (etcd key {keys.paused}): "
        "members finish what they run and pull nothing more; "
        f"`shoal-consumer resume --group {group} --namespace {namespace}` resumes it"
    )


@main.command()
@group_option
@namespace_option
@etcd_option
@option(
    "--force",
    is_flag=True,
    help="Lift a pause the operator made from spec.paused too: only for a group no "
    "operator runs any more (one that does pauses it again at once). Without it such a "
    "pause is refused, naming the kubectl command that lifts it.",
)
def resume(group: str, namespace: str, etcd_endpoints: str, force: bool) -> None:
    """Resume a paused group: its members pull again at once (deletes its `paused` key).

    Refused for a pause the operator made from the ConsumerGroup's spec.paused (it would
    pause the group again within seconds): set spec.paused to false instead, as the error
    says. A pause made by `pause` is lifted here, operator or not."""
    from shoal.group.pause import ResetRunning, SpecPaused, resume_group

    keys = Keys(namespace, group)
    try:
        record = asyncio.run(
            _with_etcd(etcd_endpoints, lambda e: resume_group(e, keys, lift_spec=force))
        )
    except ResetRunning as exc:
        raise click.ClickException(f"{namespace}/{group} is {exc}") from None
    except SpecPaused as exc:
        raise click.ClickException(
            f"{namespace}/{group} is {exc}: the operator that runs it would pause it again "
            "within seconds; nothing changed. Resume it through the spec: kubectl patch cg "
            f"{group} -n {namespace} --type merge -p "
            """'{"spec":{"paused":false}}' (--force lifts it here anyway, for a group no """
            "operator runs any more)"
        ) from None
    except Exception as exc:
        raise click.ClickException(f"could not resume {namespace}/{group}: {exc}") from None
    if record is None:
        click.echo(f"Group {namespace}/{group} is not paused: nothing to do")
        return
    since = f", {time.time() - record.time:.0f} s after the pause" if record.time > 0 else ""
    click.echo(
        f"Resumed group {namespace}/{group} (paused {record.describe()}{since}): members pull again"
    )
