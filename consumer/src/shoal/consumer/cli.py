"""`shoal-consumer`: run a member, produce test traffic, plan an assignment, show status,
pause and resume a group."""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import os
import socket
import sys
import time
from typing import Any

import click
from pydantic import ValidationError

from shoal.assignor import assign, min_moves, moved, owner_counts, skew
from shoal.clients.etcd import Etcd, EtcdAuthError, EtcdConfigError
from shoal.clients.natsauth import NatsClosed, NatsConfigError
from shoal.consumer import ready as readiness
from shoal.consumer.handlers import HandlerError
from shoal.contracts.names import (
    DEAD_LETTER_REASON_HEADER,
    DEFAULT_PARTITIONS,
    SEQ_HEADER,
    default_subject_prefix,
    format_time,
)
from shoal.group.config import (
    config_from_env,
    etcd_options_from_env,
    nats_security_from_env,
)
from shoal.logs import log_level_option, setup_logging

log = logging.getLogger(__name__)

_group = click.option(
    "--group",
    "-g",
    envvar="SHOAL_GROUP",
    required=True,
    help="Consumer group name [env SHOAL_GROUP].",
)
_namespace = click.option(
    "--namespace",
    "-n",
    envvar="SHOAL_NAMESPACE",
    default="default",
    show_default=True,
    help="Namespace of the group [env SHOAL_NAMESPACE].",
)
_nats = click.option(
    "--nats",
    "nats_url",
    envvar="NATS_URL",
    default="nats://127.0.0.1:4222",
    show_default=True,
    help="NATS server URL [env NATS_URL].",
)
_etcd = click.option(
    "--etcd",
    "etcd_endpoints",
    envvar="ETCD_ENDPOINTS",
    default="127.0.0.1:2379",
    show_default=True,
    help="etcd endpoints, host:port[,host:port] [env ETCD_ENDPOINTS].",
)
_partitions = click.option(
    "--partitions",
    "-p",
    type=click.IntRange(1, 4096),
    envvar="SHOAL_PARTITIONS",
    default=DEFAULT_PARTITIONS,
    show_default=True,
    help="Number of partitions of the group.",
)
_subject_prefix = click.option(
    "--subject-prefix",
    envvar="SHOAL_SUBJECT_PREFIX",
    default=None,
    help="Subject prefix (default shoal.<namespace>.<group>).",
)
_stream = click.option(
    "--stream", envvar="SHOAL_STREAM", default=None, help="Stream name, if not the default."
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@log_level_option
def main(log_level: str) -> None:
    """Shoal consumer: elastic consumer groups for NATS JetStream.

    Every member of a group runs `shoal-consumer run`. Members register in etcd, one of
    them leads and assigns the group's partitions, and each consumes only what it owns.
    """
    setup_logging(log_level)


@main.command()
@_group
@_namespace
@_nats
@_etcd
@_partitions
@click.option(
    "--handler",
    envvar="SHOAL_HANDLER",
    default="shoal.consumer.handlers:noop",
    show_default=True,
    help="Message handler: 'module:function' (async def f(msg)), or an http(s):// URL "
    "each message is POSTed to (see the README's HTTP handlers).",
)
@click.option(
    "--handler-ready-path",
    envvar="SHOAL_HANDLER_READY_PATH",
    default=None,
    help="With an HTTP handler: join the group only once GET <its host><path> answers 2xx.",
)
@click.option(
    "--member-id",
    envvar="SHOAL_MEMBER_ID",
    default=None,
    help="Member id [env SHOAL_MEMBER_ID, else POD_NAME, else host-pid].",
)
@click.option(
    "--metrics-port",
    envvar="SHOAL_METRICS_PORT",
    type=int,
    default=None,
    help="Serve Prometheus /metrics on this port (0: any free port).",
)
@click.option(
    "--lease-ttl",
    envvar="SHOAL_LEASE_TTL",
    type=int,
    default=None,
    help="Member lease TTL in seconds (default 10).",
)
def run(
    group: str,
    namespace: str,
    nats_url: str,
    etcd_endpoints: str,
    partitions: int,
    handler: str,
    handler_ready_path: str | None,
    member_id: str | None,
    metrics_port: int | None,
    lease_ttl: int | None,
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

    try:
        config = config_from_env(
            os.environ,
            group=group,
            namespace=namespace,
            nats_url=nats_url,
            etcd_endpoints=etcd_endpoints,
            partitions=partitions,
            handler=handler,
            handler_ready_path=handler_ready_path,
            member_id=member_id,
            metrics_port=metrics_port,
            lease_ttl=lease_ttl,
        )
    except ValidationError as exc:
        raise click.UsageError(_validation_message(exc)) from None
    try:
        asyncio.run(run_consumer(config))
    except (HandlerError, EtcdConfigError, EtcdAuthError, NatsConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    except NatsClosed:
        # (Logged already, with the reason.) A restart connects again, with backoff.
        raise SystemExit(1) from None


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or 'config'}: {err['msg']}" for err in exc.errors()
    )


@main.command()
@click.option(
    "--file",
    "ready_file",
    envvar="SHOAL_READY_FILE",
    required=True,
    help="The member's state file [env SHOAL_READY_FILE].",
)
@click.option(
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
@_group
@_namespace
@_nats
@_partitions
@click.option(
    "--projects",
    "-k",
    type=click.IntRange(1),
    default=1000,
    show_default=True,
    help="Number of distinct project ids (project-0 .. project-K-1) of test traffic.",
)
@click.option(
    "--messages",
    "-m",
    type=click.IntRange(0),
    default=10000,
    show_default=True,
    help="Total messages of test traffic, spread round-robin over the projects.",
)
@click.option(
    "--rate",
    type=float,
    default=0.0,
    help="Messages per second (0: as fast as JetStream acknowledges).",
)
@_subject_prefix
@click.option("--run-id", default=None, help="Prefix of message ids (default: current time).")
@click.option(
    "--stdin",
    "from_stdin",
    is_flag=True,
    help="Publish the lines of standard input, `project_id<TAB>data` each, instead of "
    "test traffic (see above).",
)
@click.option(
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
    a TAB, or whose project id is empty, not UTF-8, or starts or ends with whitespace
    (NATS headers would drop it), ends the run with an error naming the line, once
    every line before it is acknowledged. The count and the seconds go to standard
    error as JSON.

    \b
    Example:
      printf 'order-42\\t{"total": 12}\\n' | shoal-consumer produce -g orders --stdin
    """
    from shoal.clients.nats import connect
    from shoal.consumer.producer import LineError, Outgoing, Producer, parse_line, read_lines

    prefix = subject_prefix or default_subject_prefix(namespace, group)
    run_tag = run_id or str(int(time.time() * 1000))
    if from_stdin:
        for name in ("projects", "messages"):
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"--{name} makes no sense with --stdin")
    failure: list[LineError] = []

    async def stdin_items() -> Any:
        """The messages of standard input; at a bad line, remember it and end."""
        seqs: dict[str, int] = {}
        started = time.monotonic()
        sent = 0
        try:
            async for number, line in read_lines(sys.stdin.buffer):
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
                yield Outgoing(project, data, f"{run_tag}-{project}-{seq}", {SEQ_HEADER: str(seq)})
        except LineError as exc:
            failure.append(exc)

    async def go() -> None:
        nc = await connect(
            nats_url,
            name="shoal-produce",
            attempts=5,
            security=nats_security_from_env(os.environ),
        )
        producer = Producer(nc.jetstream(), prefix, partitions)
        started = time.monotonic()

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

        count = await producer.publish_many(stdin_items() if from_stdin else items(), window=window)
        elapsed = time.monotonic() - started
        await nc.drain()
        summary = {
            "published": count,
            "seconds": round(elapsed, 3),
            "per_second": round(count / elapsed, 1) if elapsed else None,
        }
        click.echo(json.dumps(summary), err=from_stdin)
        if failure:
            raise click.ClickException(f"stdin {failure[0]}; the lines before it are published")

    try:
        asyncio.run(go())
    except (NatsConfigError, ConnectionError) as exc:  # one line, no traceback
        raise click.ClickException(str(exc)) from None


@main.command()
@_partitions
@click.option(
    "--members",
    "before",
    required=True,
    help="Members before the change, comma-separated (e.g. c-0,c-1,c-2).",
)
@click.option("--to", "after", required=True, help="Members after the change, comma-separated.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
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
@_group
@_namespace
@_subject_prefix
@_stream
@click.option(
    "--inbox-prefix",
    default=None,
    help="The members' reply prefix, NATS_INBOX_PREFIX (default _SHOAL_INBOX.<namespace>.<group>).",
)
@click.option("--ledger", is_flag=True, help="The group writes the test ledger.")
@click.option(
    "--managed/--standalone",
    default=True,
    show_default=True,
    help="Managed: the operator creates the streams and durables; standalone: the "
    "members do (SHOAL_ENSURE_JETSTREAM).",
)
@click.option(
    "--accounts",
    "as_accounts",
    is_flag=True,
    help="Streams in one account, members in another: print an `accounts` block with the "
    "JetStream account's exports and the members' account's imports.",
)
@click.option("--js-account", default="SHOAL", show_default=True)
@click.option("--member-account", default="TEAM", show_default=True)
@click.option(
    "--api-prefix",
    default=None,
    help="With --accounts: the JetStream API's prefix in the members' account, their "
    "NATS_JS_API_PREFIX (default JS.<js-account>.API).",
)
@click.option("--member-user", default="shoal-member", show_default=True)
@click.option("--operator-user", default="shoal-operator", show_default=True)
@click.option("--producer-user", default="shoal-producer", show_default=True)
@click.option("--analytics-user", default="shoal-analytics", show_default=True)
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
) -> None:
    """Print the least NATS permissions of a group's members, the operator, a producer
    and the assignment-log export, as an `authorization { users = [...] }` block to
    paste into a NATS server's config (passwords are read from the server's
    environment: $SHOAL_MEMBER_PASSWORD, $SHOAL_OPERATOR_PASSWORD,
    $SHOAL_PRODUCER_PASSWORD, $SHOAL_ANALYTICS_PASSWORD).

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
        raise click.UsageError(_validation_message(exc)) from None
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


def _or_dash(value: object) -> object:
    return "-" if value is None else value


@main.command()
@_group
@_namespace
@_etcd
@_partitions
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(group: str, namespace: str, etcd_endpoints: str, partitions: int, as_json: bool) -> None:
    """Show a group's members, leader, owners per member and skew, read from etcd, and
    the members NATS refuses (wrong credentials, TLS), with the reason.

    etcd TLS and authentication: ETCD_CA_FILE, ETCD_CERT_FILE, ETCD_KEY_FILE, ETCD_USERNAME,
    ETCD_PASSWORD (see `run --help`).
    """
    from shoal.group.status import read_status

    async def go() -> Any:
        etcd = Etcd(etcd_endpoints, **etcd_options_from_env(os.environ))
        try:
            await etcd.connect(attempts=3)
            return await read_status(etcd, namespace, group, partitions)
        finally:
            etcd.close()

    try:
        st = asyncio.run(go())
    except Exception as exc:
        raise click.ClickException(str(exc)) from None
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
            f"  {member:<30} owns {owned:>4}  rate {_or_dash(stats.rate):>8}  "
            f"lag {_or_dash(stats.lag):>6}  cpu {_or_dash(stats.cpu)}"
        )
    if st.paused is not None:
        click.echo(f"  paused {st.paused.describe()}")
    if st.unowned:
        click.echo(f"  unowned partitions: {len(st.unowned)}")
    if st.stalled:
        # (progress.py: work and no progress; the leader moves them.)
        stalled = ", ".join(f"{p} on {m}" for p, m in sorted(st.stalled.items()))
        click.echo(f"  stalled partitions: {stalled}")
    for member, problem in sorted(st.problems.items()):
        # A refused member never joins: this line is all the group knows of it.
        click.echo(
            f"  {member:<30} cannot connect to NATS since {format_time(problem.since)}: "
            f"{problem.reason}: {problem.message}"
        )


# -- dead letters ------------------------------------------------------------------------------


@main.group()
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


def _dlq_options(command: Any) -> Any:
    """Which group and where: the options every dlq command takes."""
    for option in reversed((_group, _namespace, _nats, _subject_prefix, _stream)):
        command = option(command)
    return command


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    from shoal.contracts.names import parse_since

    if value is None:
        return None
    try:
        return parse_since(value).timestamp()
    except ValueError as exc:
        raise click.BadParameter(str(exc).removeprefix("--since "), ctx, param) from None


def _selection_options(command: Any) -> Any:
    """Which dead letters: --project, --reason, --since."""
    options = (
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
    for option in reversed(options):
        command = option(command)
    return command


def _dlq_config(
    group: str, namespace: str, nats_url: str, subject_prefix: str | None, stream: str | None
) -> Any:
    """The group's names and NATS settings (security and NATS_JS_API_PREFIX from the
    environment, as `run` reads them)."""
    try:
        return config_from_env(
            os.environ,
            group=group,
            namespace=namespace,
            nats_url=nats_url,
            subject_prefix=subject_prefix,
            stream=stream,
        )
    except ValidationError as exc:
        raise click.UsageError(_validation_message(exc)) from None


def _with_jetstream(config: Any, work: Any) -> Any:
    """asyncio.run(work(nc, js)) on a connection to the group's NATS; the errors a user
    can act on as one line."""
    from shoal.clients.nats import connect
    from shoal.group.deadletters import DeadLetterError

    async def go() -> Any:
        nc = await connect(
            config.nats_url, name="shoal-dlq", attempts=3, security=config.nats_security()
        )
        try:
            return await work(nc, nc.jetstream(prefix=config.nats_js_api_prefix))
        finally:
            await nc.close()

    try:
        return asyncio.run(go())
    except (DeadLetterError, NatsConfigError, ConnectionError) as exc:
        raise click.ClickException(str(exc)) from None


def _where(config: Any) -> str:
    return f"group {config.namespace}/{config.group}"


@dlq.command("list")
@_dlq_options
@_selection_options
@click.option(
    "--top",
    type=click.IntRange(1),
    default=20,
    show_default=True,
    help="Projects to list, most dead letters first (--json lists all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def dlq_list(
    group: str,
    namespace: str,
    nats_url: str,
    subject_prefix: str | None,
    stream: str | None,
    project: str | None,
    reason: str | None,
    since: float | None,
    top: int,
    as_json: bool,
) -> None:
    """Count a group's dead letters: by reason, by project, the oldest and the newest.

    \b
    Example:
      shoal-consumer dlq list -g orders -n prod --since 24h
    """
    from shoal.group.deadletters import Selection, ranked, scan, summarize

    config = _dlq_config(group, namespace, nats_url, subject_prefix, stream)
    selection = Selection(project=project, reason=reason, since=since)

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
@_dlq_options
@_selection_options
@click.option(
    "--limit",
    type=click.IntRange(0),
    default=20,
    show_default=True,
    help="Show at most this many, oldest first (0: all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (data as text, or base64).")
def dlq_show(
    group: str,
    namespace: str,
    nats_url: str,
    subject_prefix: str | None,
    stream: str | None,
    project: str | None,
    reason: str | None,
    since: float | None,
    limit: int,
    as_json: bool,
) -> None:
    """Show a group's dead letters, oldest first, with their headers and data.

    \b
    Example:
      shoal-consumer dlq show -g orders -n prod --project order-42 --limit 5
    """
    from shoal.group.deadletters import Selection, scan

    config = _dlq_config(group, namespace, nats_url, subject_prefix, stream)
    selection = Selection(project=project, reason=reason, since=since)
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
            f"{_or_dash(letter.partition(prefix))}  project {_project(letter.project)}"
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
@_dlq_options
@_selection_options
@click.option(
    "--limit",
    type=click.IntRange(1),
    default=None,
    help="Move at most this many, oldest first (default: all).",
)
@click.option(
    "--lanes",
    type=click.IntRange(1, 1024),
    default=64,
    show_default=True,
    help="Projects moved side by side (each project's one after another).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.option("--stop-after", type=click.IntRange(1), default=None, hidden=True)
def dlq_redrive(
    group: str,
    namespace: str,
    nats_url: str,
    subject_prefix: str | None,
    stream: str | None,
    project: str | None,
    reason: str | None,
    since: float | None,
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

    from shoal.group.deadletters import Progress, Redrive, Selection, dead_letter_stream

    config = _dlq_config(group, namespace, nats_url, subject_prefix, stream)
    selection = Selection(project=project, reason=reason, since=since)
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
@_dlq_options
@_selection_options
@click.option(
    "--limit",
    type=click.IntRange(1),
    default=None,
    help="Delete at most this many, oldest first (default: all).",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def dlq_purge(
    group: str,
    namespace: str,
    nats_url: str,
    subject_prefix: str | None,
    stream: str | None,
    project: str | None,
    reason: str | None,
    since: float | None,
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
    from shoal.group.deadletters import Selection, dead_letter_stream, purge, scan

    config = _dlq_config(group, namespace, nats_url, subject_prefix, stream)
    selection = Selection(project=project, reason=reason, since=since)

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


def _pauser() -> str:
    """Who runs `shoal-consumer pause` (user@host), for the pause record."""
    try:
        user = getpass.getuser()
    except Exception:
        user = "someone"
    return f"{user}@{socket.gethostname()}"


async def _with_etcd(etcd_endpoints: str, work: Any) -> Any:
    etcd = Etcd(etcd_endpoints, **etcd_options_from_env(os.environ))
    try:
        await etcd.connect(attempts=3)
        return await work(etcd)
    finally:
        etcd.close()


@main.command()
@_group
@_namespace
@_etcd
@click.option("--reason", default="", help="Why, for the record (shown by members and status).")
def pause(group: str, namespace: str, etcd_endpoints: str, reason: str) -> None:
    """Pause a group: every member finishes the handlers it is running, acks them,
    gives back what it fetched and did not start, and pulls nothing more. Members keep
    their partitions (nothing moves); members that join or restart join paused; the
    autoscaler does nothing. `resume` undoes it.

    Writes the group's `paused` key in etcd, as the operator does from spec.paused: for
    a group the operator runs, set spec.paused instead (the operator would undo this).
    etcd TLS and authentication: as for `status`.
    """
    from shoal.contracts.names import Keys
    from shoal.contracts.values import PauseRecord
    from shoal.group.pause import pause_group

    keys = Keys(namespace, group)
    record = PauseRecord(by=_pauser(), time=time.time(), source="cli", reason=reason)
    try:
        before = asyncio.run(_with_etcd(etcd_endpoints, lambda e: pause_group(e, keys, record)))
    except Exception as exc:
        raise click.ClickException(f"could not pause {namespace}/{group}: {exc}") from None
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
@_group
@_namespace
@_etcd
def resume(group: str, namespace: str, etcd_endpoints: str) -> None:
    """Resume a paused group: its members pull again at once (deletes its `paused` key).
    For a group the operator runs, set spec.paused to false instead."""
    from shoal.contracts.names import Keys
    from shoal.group.pause import resume_group

    keys = Keys(namespace, group)
    try:
        record = asyncio.run(_with_etcd(etcd_endpoints, lambda e: resume_group(e, keys)))
    except Exception as exc:
        raise click.ClickException(f"could not resume {namespace}/{group}: {exc}") from None
    if record is None:
        click.echo(f"Group {namespace}/{group} is not paused: nothing to do")
        return
    since = f", {time.time() - record.time:.0f} s after the pause" if record.time > 0 else ""
    click.echo(
        f"Resumed group {namespace}/{group} (paused {record.describe()}{since}): members pull again"
    )
